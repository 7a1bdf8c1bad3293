"""Per-rank peak memory of DPO training steps with ``XparDPOTrainer`` on 4 CPU (gloo) ranks, ``Mesh(ep=2)``: the
policy with a second xpar_zoo model as the reference, against the policy alone (reference log-probabilities
precomputed) and a LoRA policy (the reference: its adapter disabled).

Each case runs in fresh processes: peak RSS growth (``VmHWM`` reset through ``/proc/self/clear_refs``) from after the
imports over building the models and the trainer and 2 DPO steps (AdamW), worst rank reported, beside the local
parameter bytes of the models.

    python bench/dpo_memory.py
"""

from __future__ import annotations

import datetime
import gc
import json
import platform
import re
import sys
import tempfile
from pathlib import Path

import torch

WORLD = 4
MIB = 1 << 20
CONFIG = dict(vocab_size=8000, hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
              head_dim=64, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=512, intermediate_size=1024,
              max_position_embeddings=512)
CASES = ("reference model", "precomputed", "lora (adapter disabled)")


def _status(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024


def _local_bytes(model) -> int:
    return sum((p.to_local() if hasattr(p, "to_local") else p).nbytes for p in model.parameters())


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = "abcdefghijklmnopqrstuvwxyz .,"
    vocab = {"<unk>": 0, "</s>": 1, "<pad>": 2, **{c: i + 3 for i, c in enumerate(chars)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>", pad_token="<pad>")


def run_case(case: str, out: str) -> list[dict]:
    """Every rank: build, train 2 steps; rank 0 gets every rank's peak RSS growth."""
    import torch.distributed as dist
    from datasets import load_dataset
    from peft import LoraConfig
    from trl import DPOConfig

    import xpar_zoo
    from xpar_zoo.integrations.dpo import XparDPOTrainer

    gc.collect()
    dist.barrier()
    Path("/proc/self/clear_refs").write_text("5")
    rss = _status("VmRSS")
    mesh = xpar_zoo.Mesh(ep=2)
    if case.startswith("lora"):
        torch.manual_seed(0)
        policy = xpar_zoo.from_pretrained(f"{out}/base", mesh, progress=False, peft_config=LoraConfig(
            r=16, lora_alpha=32, target_modules=["q_proj", "v_proj"],
            target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]))
    else:
        policy = xpar_zoo.from_pretrained(f"{out}/base", mesh, progress=False)
    reference = xpar_zoo.from_pretrained(f"{out}/base", mesh, progress=False) if case == "reference model" else None
    data = load_dataset("json", data_files=f"{out}/pairs.json", split="train", cache_dir=f"{out}/datasets")
    args = DPOConfig(output_dir=f"{out}/run", per_device_train_batch_size=4, max_steps=2, learning_rate=1e-4,
                     logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True, use_cpu=True,
                     bf16=False, max_length=256, precompute_ref_log_probs=case == "precomputed")
    trainer = XparDPOTrainer(model=policy, ref_model=reference, args=args, train_dataset=data,
                             processing_class=_tokenizer())
    trainer.train()
    row = {"rss": _status("VmHWM") - rss, "params": _local_bytes(policy) + (_local_bytes(reference) if reference
                                                                          else 0)}
    rows = [None] * WORLD
    dist.all_gather_object(rows, row)
    return rows


def main() -> None:
    from xpar_zoo.testing import launch, parity

    print(f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; hardware: "
          f"{platform.machine()}, torch {torch.__version__}; Python {sys.version.split()[0]}")
    print("| case | worst rank: peak RSS growth | local parameters (policy + reference) |")
    print("|---|---|---|")
    with tempfile.TemporaryDirectory() as out:
        parity.build_model(parity.tiny_config("qwen3_moe", **CONFIG)).save_pretrained(f"{out}/base")
        text = "the cat sat on the mat, a dog ran to the park. " * 8
        Path(out, "pairs.json").write_text("".join(json.dumps(
            {"prompt": text[i:i + 40], "chosen": text[i + 40:i + 140], "rejected": text[i + 50:i + 160]}) + "\n"
            for i in range(32)))
        for case in CASES:
            rows = launch.run(run_case, WORLD, case, out, timeout_s=1800)
            print(f"| {case} | {max(r['rss'] for r in rows) / MIB:.0f} MiB | "
                  f"{max(r['params'] for r in rows) / MIB:.0f} MiB |", flush=True)


if __name__ == "__main__":
    main()
