"""Long context on a hybrid model (issue 30): the per-rank activation peak of one forward+backward of qwen3_next
(gated delta net layers on the sequence group's whole rows, attention split) under sp / cp, with the mixers'
whole-row forward recomputed in backward (the default) and kept (``XPAR_ZOO_MIXER_RECOMPUTE=0``), against FSDP
alone on the same full-length rows. 4 gloo ranks, fp32, one row per micro-batch; worst rank's peak of live tensor
bytes above those live before the step (``xpar_zoo.testing.parity.live_peak_bytes``).

    python bench/hybrid_long_context.py [--seq 4096] [--no-write]
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import platform
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORLD = 4
MB = 1024 * 1024
CONFIG = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=32, moe_intermediate_size=256,
              intermediate_size=512, shared_expert_intermediate_size=256, num_experts=16, num_experts_per_tok=2,
              num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"], vocab_size=2048,
              linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=32, linear_value_head_dim=32,
              max_position_embeddings=131072, attn_implementation="sdpa", use_cache=False)
RUNS = {  # name -> (mesh, XPAR_ZOO_MIXER_RECOMPUTE)
    "fsdp": ({}, None),
    "sp4": ({"sp": 4}, None),
    "sp4_kept": ({"sp": 4}, "0"),
    "cp4": ({"cp": 4}, None),
    "sp2_cp2_ep2": ({"sp": 2, "cp": 2, "ep": 2}, None),
}
LABELS = {"fsdp": "FSDP alone `Mesh()`", "sp4": "`Mesh(sp=4)`, mixers recomputed (default)",
          "sp4_kept": "`Mesh(sp=4)`, mixers kept (`XPAR_ZOO_MIXER_RECOMPUTE=0`)", "cp4": "`Mesh(cp=4)`",
          "sp2_cp2_ep2": "`Mesh(sp=2, cp=2, ep=2)`"}


def _step(model, n: int, offset: int):
    """One forward+backward of a row of ``n`` random tokens (seeded ``n + offset``), as a call for the profiler."""
    import torch

    ids = torch.randint(0, CONFIG["vocab_size"], (1, n), generator=torch.Generator().manual_seed(n + offset))

    def run():
        model(input_ids=ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)
    return run


def _runs(seq: int, trace_dir: str) -> dict:
    import torch
    import torch.distributed as dist
    from transformers.utils import logging

    import xpar_zoo
    from xpar_zoo.testing import parity

    logging.set_verbosity_error()
    rank = dist.get_rank()
    out = {}
    for name, (mesh, recompute) in RUNS.items():
        if recompute is None:
            os.environ.pop("XPAR_ZOO_MIXER_RECOMPUTE", None)
        else:
            os.environ["XPAR_ZOO_MIXER_RECOMPUTE"] = recompute
        torch.manual_seed(0)
        model = xpar_zoo.parallelize(parity.build_model(parity.tiny_config("qwen3_next", **CONFIG)),
                                     xpar_zoo.Mesh(**mesh))
        model.train()
        offset = 0 if "sp" in mesh or "cp" in mesh else rank  # a sequence group's ranks pass the same row
        _step(model, 256, offset)()
        gc.collect()
        dist.barrier()
        peak = parity.live_peak_bytes(_step(model, seq, offset), f"{trace_dir}/{name}-{rank}.json")
        gc.collect()
        dist.barrier()
        t0 = time.perf_counter()
        _step(model, seq, offset)()
        seconds = time.perf_counter() - t0
        peaks = [None] * dist.get_world_size()
        dist.all_gather_object(peaks, peak)
        out[name] = {"peak": max(peaks), "seconds": seconds}
        del model
        gc.collect()
    os.environ.pop("XPAR_ZOO_MIXER_RECOMPUTE", None)
    return out if rank == 0 else None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import transformers

    from xpar_zoo.testing import launch

    load = os.getloadavg()[0]
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        res = launch.run(_runs, WORLD, args.seq, tmp, timeout_s=1800)
    base = res["fsdp"]["peak"]
    lines = ["## Long context on a hybrid model: qwen3_next's mixers on whole rows, recomputed or kept (issue 30)", "",
             f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; hardware: {platform.processor() or platform.machine()}, "
             f"{os.cpu_count()} cores (a shared VM), load {load:.1f} before / {os.getloadavg()[0]:.1f} after; torch "
             f"{torch.__version__}, transformers {transformers.__version__}; `python bench/hybrid_long_context.py "
             f"--seq {args.seq}` ({(time.time() - t0) / 60:.1f} min)",
             "- model: qwen3_next fp32, 4 layers (3 gated delta net, 1 full attention), hidden 256, 16 experts of 256 "
             "(top-2) + a shared expert, attention 4 query / 2 key-value heads of 32, linear attention 4 key / 8 value "
             "heads of 32; sdpa; 4 gloo ranks; one row per micro-batch; worst rank's live peak of one forward+backward",
             "", f"| mesh | peak at {args.seq} tokens (MiB) | × FSDP alone | step (s) |", "|---|---|---|---|"]
    for name in RUNS:
        r = res[name]
        lines.append(f"| {LABELS[name]} | {r['peak'] / MB:.1f} | {r['peak'] / base:.2f}× | {r['seconds']:.1f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if not args.no_write:
        with open(HERE / "RESULTS.md", "a") as f:
            f.write("\n" + text)


if __name__ == "__main__":
    main()
