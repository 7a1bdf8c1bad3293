"""Fine-tune an xpar_zoo model with transformers' Trainer, or with TRL's SFTTrainer (--sft).

    torchrun --nproc-per-node 8 examples/finetune_trainer.py --model Qwen/Qwen3-30B-A3B --data train.jsonl \\
        --mesh ep=8 --dtype bf16 --output runs/ft
    accelerate launch --config_file examples/accelerate/gpu.yaml examples/finetune_trainer.py --model … --sft
    ACCELERATE_USE_CPU=true accelerate launch --config_file examples/accelerate/cpu.yaml \\
        examples/finetune_trainer.py --model DIR --data train.jsonl --mesh ep=2

--data is JSONL with a "text" field per line. The model (hub format) and the tokenizer end in --output; checkpoints
in --output/checkpoint-N resume with --resume.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from transformers import (
    AutoTokenizer,
    DataCollatorForLanguageModeling,
    TrainingArguments,
)

import xpar_zoo
from xpar_zoo.integrations.trainer import XparTrainer, XparTrainerMixin
from xpar_zoo.train.config import parse_mesh
from xpar_zoo.train.loop import init_distributed

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="hub id or directory (with a tokenizer)")
    p.add_argument("--data", required=True, help="JSONL, a 'text' field per line")
    p.add_argument("--mesh", default="", help="xpar_zoo plans, e.g. ep=8,emb=2 (default: FSDP only)")
    p.add_argument("--output", required=True)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--save-steps", type=int, default=500)
    p.add_argument("--sft", action="store_true", help="TRL's SFTTrainer instead of transformers' Trainer")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --output")
    return p.parse_args(argv)


def read_texts(path: str) -> list[str]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f if line.strip()]


def main(argv=None) -> None:
    args = parse_args(argv)
    init_distributed()  # the launcher's process group (torchrun or accelerate launch), before the model is loaded
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = xpar_zoo.from_pretrained(args.model, mesh=xpar_zoo.Mesh(**parse_mesh(args.mesh)),
                                     dtype=DTYPES[args.dtype])
    common = dict(output_dir=args.output, per_device_train_batch_size=args.micro_batch,
                  gradient_accumulation_steps=args.grad_accum, max_steps=args.steps, learning_rate=args.lr,
                  save_steps=args.save_steps, logging_steps=1, report_to="none",
                  use_cpu=not torch.cuda.is_available(), bf16=False)
    texts = read_texts(args.data)
    if args.sft:
        from datasets import Dataset
        from trl import SFTConfig, SFTTrainer

        class XparSFTTrainer(XparTrainerMixin, SFTTrainer):
            pass

        trainer = XparSFTTrainer(model=model, args=SFTConfig(max_length=args.seq_len, **common),
                                 train_dataset=Dataset.from_dict({"text": texts}), processing_class=tokenizer)
    else:
        rows = [{"input_ids": tokenizer(t, truncation=True, max_length=args.seq_len)["input_ids"]} for t in texts]
        trainer = XparTrainer(model=model, args=TrainingArguments(**common), train_dataset=rows,
                              data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
                              processing_class=tokenizer)
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    trainer.save_model()  # every rank: the hub's format (or the adapter of a PEFT model) in --output
    if trainer.is_world_process_zero():
        print(json.dumps({"output": os.path.abspath(args.output), "steps": trainer.state.global_step,
                          "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h]}), flush=True)


if __name__ == "__main__":
    main()
