"""Long context on a hybrid model (issue 30): the per-rank activation peak of one forward+backward of qwen3_next
(gated delta net layers on the sequence group's whole rows, attention split) under sp / cp, with the mixers'
whole-row forward recomputed in backward (the default) and kept (``ParallelOptions(mixer_recompute=False)``), against FSDP
alone on the same full-length rows. 4 gloo ranks, fp32, one row per micro-batch; worst rank's peak of live tensor
bytes above those live before the step (``xpar_zoo.testing.parity.live_peak_bytes``).

    python bench/hybrid_long_context.py [--seq 4096] [--no-write]
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from long_context import MB, WORLD, peak_and_time, run_line, write_results  # noqa: E402  (the measuring helpers)

CONFIG = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=32, moe_intermediate_size=256,
              intermediate_size=512, shared_expert_intermediate_size=256, num_experts=16, num_experts_per_tok=2,
              num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"], vocab_size=2048,
              linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=32, linear_value_head_dim=32,
              max_position_embeddings=131072, attn_implementation="sdpa", use_cache=False)
RUNS = {  # name -> (mesh, ParallelOptions.mixer_recompute)
    "fsdp": ({}, True),
    "sp4": ({"sp": 4}, True),
    "sp4_kept": ({"sp": 4}, False),
    "cp4": ({"cp": 4}, True),
    "sp2_cp2_ep2": ({"sp": 2, "cp": 2, "ep": 2}, True),
}
LABELS = {"fsdp": "FSDP alone `Mesh()`", "sp4": "`Mesh(sp=4)`, mixers recomputed (default)",
          "sp4_kept": "`Mesh(sp=4)`, mixers kept (`ParallelOptions(mixer_recompute=False)`)", "cp4": "`Mesh(cp=4)`",
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
        torch.manual_seed(0)
        model = xpar_zoo.parallelize(parity.build_model(parity.tiny_config("qwen3_next", **CONFIG)),
                                     xpar_zoo.Mesh(**mesh), options=xpar_zoo.ParallelOptions(mixer_recompute=recompute))
        model.train()
        offset = 0 if "sp" in mesh or "cp" in mesh else rank  # a sequence group's ranks pass the same row
        _step(model, 256, offset)()
        out[name] = peak_and_time(_step(model, seq, offset), f"{trace_dir}/{name}-{rank}.json")
        del model
        gc.collect()
    return out if rank == 0 else None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    from xpar_zoo.testing import launch

    load = os.getloadavg()[0]
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        res = launch.run(_runs, WORLD, args.seq, tmp, timeout_s=1800)
    base = res["fsdp"]["peak"]
    lines = ["## Long context on a hybrid model: qwen3_next's mixers on whole rows, recomputed or kept (issue 30)", "",
             run_line(f"python bench/hybrid_long_context.py --seq {args.seq}", t0, load),
             "- model: qwen3_next fp32, 4 layers (3 gated delta net, 1 full attention), hidden 256, 16 experts of 256 "
             "(top-2) + a shared expert, attention 4 query / 2 key-value heads of 32, linear attention 4 key / 8 value "
             "heads of 32; sdpa; 4 gloo ranks; one row per micro-batch; worst rank's live peak of one forward+backward",
             "", f"| mesh | peak at {args.seq} tokens (MiB) | × FSDP alone | step (s) |", "|---|---|---|---|"]
    for name in RUNS:
        r = res[name]
        lines.append(f"| {LABELS[name]} | {r['peak'] / MB:.1f} | {r['peak'] / base:.2f}× | {r['seconds']:.1f} |")
    write_results("\n".join(lines) + "\n", args.no_write)


if __name__ == "__main__":
    main()
