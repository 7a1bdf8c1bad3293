"""Per-rank peak memory of getting a ≈1.5 GB fp32 qwen3_moe out of 4 CPU (gloo) ranks on ``Mesh(ep=2, emb=2,
head=2)``: ``xpar_zoo.iter_hub_weights`` with 64 MiB and 512 MiB buckets (every rank receives every tensor), against
``xpar_zoo.full_state_dict`` (rank 0 receives the model) and the hub export ``model.save_pretrained`` (rank 0
writes it).

Each method runs in fresh processes. Per rank: the peak of live torch CPU tensor bytes above those live before the
call (``xpar_zoo.testing.parity.live_peak_bytes``, the allocator's own accounting) and the peak RSS growth
(``VmHWM`` reset through ``/proc/self/clear_refs``; includes gloo's and the allocator's own buffers). The worst rank
and rank 0 are reported.

    python bench/weight_stream.py [--layers 6] [--methods "full_state_dict,save_pretrained"]
"""

from __future__ import annotations

import argparse
import datetime
import gc
import platform
import re
import sys
import tempfile
import time
from pathlib import Path

import torch

WORLD = 4
MIB = 1 << 20
MESH = {"ep": 2, "emb": 2, "head": 2}
CONFIG = dict(vocab_size=32000, hidden_size=1024, num_attention_heads=8, num_key_value_heads=4, head_dim=128,
              num_experts=16, num_experts_per_tok=2, moe_intermediate_size=1024, intermediate_size=2048,
              max_position_embeddings=256)
METHODS = ("iter_hub_weights 64 MiB", "iter_hub_weights 512 MiB", "full_state_dict", "save_pretrained")


def _status(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024


def _model(layers: int):
    """The model on the mesh, its local shards filled with random numbers (no full copy on any rank)."""
    import xpar_zoo
    from xpar_zoo.testing import parity
    from xpar_zoo.zoo.registry import build_meta

    config = parity.tiny_config("qwen3_moe", num_hidden_layers=layers, **CONFIG)
    model = xpar_zoo.materialize(xpar_zoo.parallelize(build_meta(config, torch.float32), xpar_zoo.Mesh(**MESH)))
    with torch.no_grad():
        for p in model.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            local.normal_(std=0.02)
    return model


def _call(method: str, model, out: Path):
    import xpar_zoo

    if method.startswith("iter_hub_weights"):
        bucket = int(method.split()[1]) * MIB
        return lambda: sum(t.numel() for b in xpar_zoo.iter_hub_weights(model, bucket) for _, t in b)
    if method == "full_state_dict":
        return lambda: xpar_zoo.full_state_dict(model)
    return lambda: model.save_pretrained(out / "hub", max_shard_size="500MB", progress=False)


def measure(method: str, layers: int, out: str) -> list[dict]:
    """Every rank: the peaks of one call of ``method``; rank 0 gets every rank's."""
    import torch.distributed as dist

    from xpar_zoo.testing import parity

    model = _model(layers)
    call = _call(method, model, Path(out))
    local = sum((p.to_local() if hasattr(p, "to_local") else p).nbytes for p in model.parameters())
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    gc.collect()
    dist.barrier()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    rss = _status("VmRSS")
    start = time.perf_counter()
    live = parity.live_peak_bytes(call, f"{out}/trace{dist.get_rank()}.json")
    row = {"live": live, "rss": _status("VmHWM") - rss, "seconds": time.perf_counter() - start, "local": local,
           "total": total}
    rows = [None] * WORLD
    dist.all_gather_object(rows, row)
    return rows


def main(argv=None) -> None:
    from xpar_zoo.testing import launch

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--methods", default=",".join(METHODS), help="comma-separated, of: " + ", ".join(METHODS))
    args = p.parse_args(argv)
    print(f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; hardware: "
          f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads; torch {torch.__version__};"
          f" Python {sys.version.split()[0]}")
    print("| method | worst rank: live tensor peak | worst rank: RSS growth | rank 0: live / RSS | time |")
    print("|---|---|---|---|---|")
    for method in args.methods.split(","):
        with tempfile.TemporaryDirectory() as out:
            rows = launch.run(measure, WORLD, method, args.layers, out, timeout_s=1800)
        worst_live, worst_rss = max(r["live"] for r in rows), max(r["rss"] for r in rows)
        print(f"| `{method}` | {worst_live / MIB:.0f} MiB | {worst_rss / MIB:.0f} MiB | "
              f"{rows[0]['live'] / MIB:.0f} / {rows[0]['rss'] / MIB:.0f} MiB | {rows[0]['seconds']:.1f} s |", flush=True)
    print(f"- model: {rows[0]['total'] / MIB:.0f} MiB fp32; local shards per rank: "
          f"{max(r['local'] for r in rows) / MIB:.0f} MiB (worst)")


if __name__ == "__main__":
    main()
