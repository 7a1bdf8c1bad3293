"""Vocab-parallel head benchmark (issue 4, not a test): peak memory and step time of the ``head`` plan (fused
vocab-parallel logits + cross-entropy) against a plain FSDP2 ``lm_head`` at a large vocabulary, side by side in one run.

    python bench/vocab.py [--steps N] [--batch B] [--seq S] [--no-append]

Model: a 1-layer qwen3_moe around the head (V = 151936, H = 1024, fp32), built from the same seed in every variant;
4 gloo ranks, each with its own ``batch × seq`` tokens; forward + backward of ``model(ids, labels=ids).loss``. Memory
is each rank's peak RSS growth over the step (``VmHWM`` reset through ``/proc/self/clear_refs``, minus ``VmRSS``
before); every figure is the worst rank's, time is the median over the timed steps after one warm-up. The ratios
(head plan / plain FSDP) are appended to bench/RESULTS.md under "## Vocab parallel (issue 4)".
"""

from __future__ import annotations

import argparse
import datetime
import gc
import platform
import statistics
import subprocess
import time
from pathlib import Path

WORLD = 4
MB = 1024 * 1024
VOCAB, HIDDEN = 151936, 1024
RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
VARIANTS = {"plain FSDP lm_head": {}, "head=2": {"head": 2}, "head=4": {"head": 4},
            "head=4 + emb=4": {"head": 4, "emb": 4}}


def _status(field: str) -> int:
    """``/proc/self/status`` field in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _config():
    from xpar_zoo.testing import parity

    return parity.tiny_config("qwen3_moe", vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=1,
                              num_attention_heads=8, num_key_value_heads=4, head_dim=128, intermediate_size=256,
                              moe_intermediate_size=128, num_experts=4, max_position_embeddings=4096)


def _variant(mesh_kwargs: dict, steps: int, batch: int, seq: int) -> dict:
    import torch
    import torch.distributed as dist

    import xpar_zoo
    from xpar_zoo.testing import parity

    rank = dist.get_rank()
    model = xpar_zoo.parallelize(parity.build_model(_config()), xpar_zoo.Mesh(**mesh_kwargs))
    ids = torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(rank))
    gc.collect()
    times, peaks = [], []
    for step in range(steps + 1):
        dist.barrier()
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        before = _status("VmRSS")
        start = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        dist.barrier()
        elapsed = time.perf_counter() - start
        peak = _status("VmHWM") - before
        model.zero_grad(set_to_none=True)
        del loss
        gc.collect()
        if step:  # the first step warms up
            times.append(elapsed)
            peaks.append(peak)
    stats = torch.tensor([statistics.median(times), max(peaks)], dtype=torch.float64)
    gathered = [torch.empty_like(stats) for _ in range(WORLD)]
    dist.all_gather(gathered, stats)
    worst = torch.stack(gathered).max(0).values
    return {"step_s": worst[0].item(), "peak_MiB": worst[1].item() / MB}


def _cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except Exception:  # lscpu missing: still name something
        return platform.processor() or "unknown CPU"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2, help="timed steps after one warm-up")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--no-append", action="store_true", help="print only; leave RESULTS.md alone")
    args = parser.parse_args()

    import os

    import torch
    import transformers

    from xpar_zoo.testing import launch

    rows = {}
    for name, mesh_kwargs in VARIANTS.items():
        rows[name] = launch.run(_variant, WORLD, mesh_kwargs, args.steps, args.batch, args.seq, timeout_s=1800)
        print(f"{name:>20}: step {rows[name]['step_s']:.2f} s, peak RSS growth {rows[name]['peak_MiB']:.0f} MiB",
              flush=True)
    base = rows["plain FSDP lm_head"]
    tokens = args.batch * args.seq
    logits_mib = tokens * VOCAB * 4 / MB
    lines = [
        "",
        "## Vocab parallel (issue 4)",
        "",
        f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; hardware: {_cpu_model()}, "
        f"{os.cpu_count()} cores; torch {torch.__version__}, transformers {transformers.__version__}",
        f"- model: 1-layer qwen3_moe, V = {VOCAB}, H = {HIDDEN}, fp32; {WORLD} gloo ranks, {args.batch}×{args.seq} "
        f"tokens per rank; forward + backward of `model(ids, labels=ids).loss`; the embedding is plain FSDP "
        f"(its full weight and gradient, ~2 × 594 MiB, count in the peak) except in the last row; worst rank; median of {args.steps} steps after one warm-up; `python bench/vocab.py`",
        f"- for scale: one rank's full fp32 logits [{tokens}, {VOCAB}] = {logits_mib:.0f} MiB; the full lm_head "
        f"weight = {VOCAB * HIDDEN * 4 / MB:.0f} MiB",
        "",
        "| | step (s) | peak RSS growth over the step (MiB) | step ratio | memory ratio |",
        "|---|---|---|---|---|",
    ]
    for name, row in rows.items():
        lines.append(f"| {name} | {row['step_s']:.2f} | {row['peak_MiB']:.0f} | {row['step_s'] / base['step_s']:.2f}× "
                     f"| {row['peak_MiB'] / base['peak_MiB']:.2f}× |")
    text = "\n".join(lines) + "\n"
    print(text)
    if not args.no_append:
        with RESULTS.open("a") as f:
            f.write(text)


if __name__ == "__main__":
    main()
