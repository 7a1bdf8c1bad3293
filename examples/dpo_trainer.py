"""Preference-tune an xpar_zoo model with TRL's DPOTrainer (XparDPOTrainer), on any mesh.

    torchrun --nproc-per-node 4 examples/dpo_trainer.py --output runs/dpo_tiny          # tiny-qwen3-moe, 4 CPU ranks
    torchrun --nproc-per-node 8 examples/dpo_trainer.py --model Qwen/Qwen3-30B-A3B --data pairs.jsonl \\
        --mesh ep=8 --dtype bf16 --reference lora --output runs/dpo

--data is JSONL with "prompt", "chosen" and "rejected" fields. The reference is a second xpar_zoo model on the same
ranks (--reference model), the policy's log-probabilities computed once before training (--reference precompute),
or, with LoRA on attention and the fused experts, the policy with its adapter disabled (--reference lora). The model
(or the adapter) and the tokenizer end in --output/final; the last line printed is a JSON report of the steps.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist

import xpar_zoo
from xpar_zoo.train.config import parse_mesh
from xpar_zoo.train.loop import init_distributed
from xpar_zoo.train.tiny import TINY_MODEL
from xpar_zoo.train.tiny_vl import resolve_model

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
HERE = os.path.dirname(os.path.abspath(__file__))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=TINY_MODEL, help=f"hub id or directory with a tokenizer (default {TINY_MODEL}, "
                                                       "built in code)")
    p.add_argument("--data", default=os.path.join(HERE, "data", "tiny_preferences.jsonl"))
    p.add_argument("--mesh", default="ep=2", help="xpar_zoo plans, e.g. ep=8,emb=2")
    p.add_argument("--output", required=True)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--reference", choices=("model", "precompute", "lora"), default="model")
    p.add_argument("--lora-rank", type=int, default=8, help="with --reference lora")
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--max-length", type=int, default=256)
    return p.parse_args(argv)


def load_model(name: str, mesh: xpar_zoo.Mesh, dtype: torch.dtype, lora_rank: int | None = None):
    peft_config = None
    if lora_rank:
        from peft import LoraConfig

        peft_config = LoraConfig(r=lora_rank, lora_alpha=2 * lora_rank, target_modules=["q_proj", "v_proj"],
                                 target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    return xpar_zoo.from_pretrained(name, mesh=mesh, dtype=dtype, peft_config=peft_config)


def main(argv=None) -> None:
    from datasets import load_dataset
    from transformers import AutoTokenizer
    from trl import DPOConfig

    from xpar_zoo.integrations.dpo import XparDPOTrainer

    args = parse_args(argv)
    init_distributed()  # the launcher's process group, before the model is loaded
    if dist.get_rank() == 0:
        resolve_model(args.model, args.output)  # tiny-qwen3-moe: written into --output once
    dist.barrier()
    name = resolve_model(args.model, args.output)
    mesh, dtype = xpar_zoo.Mesh(**parse_mesh(args.mesh)), DTYPES[args.dtype]
    tokenizer = AutoTokenizer.from_pretrained(name)
    policy = load_model(name, mesh, dtype, args.lora_rank if args.reference == "lora" else None)
    reference = load_model(name, mesh, dtype) if args.reference == "model" else None
    # a dataset with files: the precomputed reference log-probabilities are cached beside them, seen by every rank
    data = load_dataset("json", data_files=args.data, split="train",
                        cache_dir=os.path.join(args.output, "datasets"))
    config = DPOConfig(output_dir=args.output, per_device_train_batch_size=args.micro_batch, max_steps=args.steps,
                       learning_rate=args.lr, beta=args.beta, max_length=args.max_length, logging_steps=1,
                       save_strategy="no", report_to="none", use_cpu=not torch.cuda.is_available(), bf16=False,
                       precompute_ref_log_probs=args.reference == "precompute")
    trainer = XparDPOTrainer(model=policy, ref_model=reference, args=config, train_dataset=data,
                             processing_class=tokenizer)
    trainer.train()
    final = os.path.join(args.output, "final")
    trainer.save_model(final)  # every rank: the hub's format (the adapter, with --reference lora)
    if trainer.is_world_process_zero():
        keys = ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/accuracies")
        steps = [{k: h[k] for k in keys if k in h} for h in trainer.state.log_history if "loss" in h]
        print(json.dumps({"output": os.path.abspath(final), "steps": steps}), flush=True)


if __name__ == "__main__":
    main()
