"""CPU suite (issue 9, not a test): xpar_zoo against transformers' own distributed path on the same model and mesh,
4 gloo ranks, side by side in one run — load time (in a fresh process, and again with transformers' modules
imported: the loader alone) and peak RSS, training step time, peak RSS and peak live tensor bytes (the torch
profiler's allocator accounting, which glibc's retention of freed heap does not blur), checkpoint save time.

    python bench/cpu_suite.py [--keep DIR] [--steps N] [--seq 128,1024] [--rounds 2] [--stacks xpar_zoo,transformers]

Peer: ``AutoModelForCausalLM.from_pretrained(dir, distributed_config=DistributedConfig(fsdp_size=4, ep_size=2))``
(needs ``accelerate``: ``pip install --target /tmp/accel --no-deps accelerate psutil pyyaml`` and run with
``PYTHONPATH=/tmp/accel``), trained with the same AdamW and saved with its own ``save_pretrained`` (model weights; ours saves the same,
as an atomic DCP checkpoint). Ours:
``xpar_zoo.from_pretrained(dir, mesh=Mesh(ep=2))`` (FSDP2 over the 4 ranks, experts split in 2 and FSDP-sharded on
dim 0: 16 local experts over 2 FSDP ranks), ``xpar_zoo.save_checkpoint``. The checkpoint is bench/load_memory.py's ≈ 400 MB qwen3_moe. The training rows
are measured at each sequence length (2×128 tokens per rank, where FSDP's collectives dominate, and 2×1024, where
activations and the loss do). The stacks run alternately, ``--rounds`` times each; every figure is the median over
rounds of the worst rank's; ratios are xpar_zoo / transformers. ``--stacks`` may add ``xpar_zoo_dim1``: ours with
every planned slice forced onto FSDP dim 1, the placement before issue 23, to measure what dim 1 costs in the
same run; and ``xpar_zoo_gloo_copies``: ours with gloo's own all-gather and reduce-scatter (each stages a copy of the
unsharded buffer) instead of :mod:`xpar_zoo.parallel.gloo_comms`.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gc
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import load_memory  # noqa: E402  (the shared checkpoint and RSS helpers)

WORLD = 4
MB = 1024 * 1024
STACKS = {"xpar_zoo": "xpar_zoo `Mesh(ep=2)`",
          "xpar_zoo_dim1": "xpar_zoo `Mesh(ep=2)`, planned slices forced to dim 1",
          "xpar_zoo_gloo_copies": "xpar_zoo `Mesh(ep=2)`, gloo's own FSDP collectives",
          "transformers": "transformers `DistributedConfig(fsdp_size=4, ep_size=2)`"}
LIVE_STEPS = 3  # profiled steps after the timed ones; each step's live peak, their median


def cpu_model() -> str:
    """The CPU's model name (lscpu's), for RESULTS.md."""
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def allocator_env() -> str:
    """The environment variables that change how CPU memory is allocated (glibc's ``MALLOC_*``, torch's
    ``THP_MEM_ALLOC_ENABLE``, a preloaded allocator): the ranks inherit them, so they hold for both stacks."""
    keys = sorted(k for k in os.environ if k.startswith("MALLOC_") or k in ("THP_MEM_ALLOC_ENABLE", "LD_PRELOAD"))
    return ", ".join(f"`{k}={os.environ[k]}`" for k in keys) or "glibc's and torch's defaults"


def _step(model, opt, ids):
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def _side(which: str, directory: str, out: str, steps: int, batch: int, seqs: list[int]) -> dict:
    import torch
    import torch.distributed as dist

    from xpar_zoo.testing import parity

    rank = dist.get_rank()
    if which == "xpar_zoo_dim1":  # the placement before issue 23, for comparison (this process only)
        from xpar_zoo.parallel import fsdp_layout

        fsdp_layout.planned_shard_dim = lambda rows, fsdp: 1
    if which == "xpar_zoo_gloo_copies":  # FSDP2's default collectives, before xpar_zoo.parallel.gloo_comms (this process only)
        os.environ["XPAR_ZOO_GLOO_IN_PLACE"] = "0"  # parallelize's switch (cpu_collectives="gloo")
    ours = which.startswith("xpar_zoo")
    gc.collect()
    row: dict = {}
    try:
        dist.barrier()
        before = load_memory._status("VmRSS")
        load_memory._reset_peak()
        t0 = time.perf_counter()
        model = load_memory._load("xpar_zoo" if ours else which, directory)()
        dist.barrier()
        row["load_s"] = time.perf_counter() - t0
        row["load_peak_growth_MiB"] = (load_memory._status("VmHWM") - before) / MB
        del model  # again, with transformers' modules imported and the config parsed: the loader alone
        gc.collect()
        dist.barrier()
        t0 = time.perf_counter()
        model = load_memory._load("xpar_zoo" if ours else which, directory)()
        dist.barrier()
        row["warm_load_s"] = time.perf_counter() - t0
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        g = torch.Generator().manual_seed(rank)
        for seq in seqs:  # each sequence length: its step time, RSS growth and live peak
            times = []
            gc.collect()
            before = load_memory._status("VmRSS")
            load_memory._reset_peak()
            for step in range(steps + 1):
                ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=g)
                dist.barrier()
                t0 = time.perf_counter()
                loss = _step(model, opt, ids)
                dist.barrier()
                if step:  # the first step warms up
                    times.append(time.perf_counter() - t0)
            row[f"step_s@{seq}"] = statistics.median(times)
            row[f"train_peak_growth_MiB@{seq}"] = (load_memory._status("VmHWM") - before) / MB  # incl. AdamW's
            row[f"loss@{seq}"] = loss.item()
            peaks = []
            for _ in range(LIVE_STEPS):  # a single step's peak varies with when the async collectives land (±20 %)
                ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=g)
                dist.barrier()
                peaks.append(parity.live_peak_bytes(functools.partial(_step, model, opt, ids), f"{out}.trace-{rank}.json") / MB)
            row[f"step_live_peak_MiB@{seq}"] = statistics.median(peaks)
        dist.barrier()
        t0 = time.perf_counter()
        if ours:
            import xpar_zoo

            xpar_zoo.save_checkpoint(out, model, step=steps)  # model weights, like save_pretrained
        else:
            model.save_pretrained(out)
        dist.barrier()
        row["save_s"] = time.perf_counter() - t0
    except Exception:
        row["error"] = traceback.format_exc(limit=4)[-1500:]
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    return rows


def _worst(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if key in r]
    return max(values) if values else None


def _figure(rounds: list[list[dict]], key: str) -> float | None:
    """The median over rounds of the worst rank's value."""
    values = [v for v in (_worst(rows, key) for rows in rounds) if v is not None]
    return statistics.median(values) if values else None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--keep", help="work directory to keep (default: a temporary one)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", default="128,1024",
                    help="sequence lengths, comma-separated: the training rows are measured at each")
    ap.add_argument("--rounds", type=int, default=2,
                    help="run the two stacks alternately this many times (a 2-core host's load drifts by tens of "
                         "percent over minutes); each figure is the median over rounds")
    ap.add_argument("--stacks", default="xpar_zoo,transformers",
                    help=f"comma-separated, run in this order each round: {', '.join(STACKS)}")
    args = ap.parse_args()
    stacks = args.stacks.split(",")
    if "transformers" not in stacks or set(stacks) - set(STACKS):
        ap.error(f"--stacks: some of {', '.join(STACKS)}, transformers included")
    seqs = [int(x) for x in args.seq.split(",")]
    from xpar_zoo.testing import launch

    work = Path(args.keep or tempfile.mkdtemp(prefix="xpar-cpu-suite-"))
    ckpt = work / "hub"
    if not ckpt.exists():
        ckpt.mkdir(parents=True)
        load_memory.make_checkpoint(ckpt)
    nbytes = sum(p.stat().st_size for p in ckpt.glob("*.safetensors"))
    results: dict[str, list] = {s: [] for s in stacks}  # per stack, per round: every rank's row
    load = [os.getloadavg()]  # other work on the host distorts the timings: reported beside them
    for _ in range(args.rounds):
        for which in results:
            out = work / f"save-{which}"
            shutil.rmtree(out, ignore_errors=True)
            results[which].append(launch.run(_side, WORLD, which, str(ckpt), str(out), args.steps, args.batch,
                                             seqs, timeout_s=1800))
            load.append(os.getloadavg())
    print(json.dumps(results, indent=1, default=str))

    import torch
    import transformers

    peer = results["transformers"]
    mine = [s for s in stacks if s != "transformers"]
    lines = ["", "## CPU suite: xpar_zoo vs transformers DistributedConfig (issue 9)", "",
             f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; hardware: "
             f"{cpu_model()}, "
             f"{os.cpu_count()} cores; torch {torch.__version__}, transformers {transformers.__version__}; "
             f"allocator settings (both stacks): {allocator_env()}",
             f"- model: bench/load_memory.py's qwen3_moe fp32 ({nbytes / MB:.0f} MiB hub checkpoint); 4 gloo ranks; "
             f"AdamW; {args.batch}×seq tokens per rank per step (seq = {args.seq}); worst rank; median of "
             f"{args.steps} steps after one warm-up at each seq; the stacks run alternately, {args.rounds} rounds "
             "each, and every figure is the median over rounds",
             "- host load average (1 min) before the run and after each stack's turn: "
             + ", ".join(f"{a[0]:.1f}" for a in load), "",
             "| | " + " | ".join(STACKS[s] for s in mine + ["transformers"]) + " | "
             + " | ".join("ratio" + (f" ({s})" if len(mine) > 1 else "") for s in mine) + " |",
             "|---" * (2 * len(mine) + 2) + "|"]
    table = [("load_s", "load time, fresh process (s)"),
            ("warm_load_s", "load time, transformers imported and config read (s)"),
            ("load_peak_growth_MiB", "load peak RSS growth (MiB)")]
    for i, seq in enumerate(seqs):
        over = "incl. AdamW states" if i == 0 else f"over the RSS after seq {seqs[i - 1]}"
        table += [(f"step_s@{seq}", f"training step, seq {seq} (s)"),
                 (f"train_peak_growth_MiB@{seq}", f"training peak RSS growth, seq {seq} (MiB, {over})"),
                 (f"step_live_peak_MiB@{seq}",
                  f"training step peak live tensors over its start, seq {seq} (MiB, median of {LIVE_STEPS} steps)")]
    table.append(("save_s", "save model weights (s)"))
    fmt = (lambda v: "failed" if v is None else f"{v:.2f}")
    for key, label in table:
        values = [_figure(results[s], key) for s in mine]
        b = _figure(peer, key)
        ratios = [f"{a / b:.2f}×" if a and b else "—" for a in values]
        lines.append(f"| {label} | " + " | ".join(fmt(v) for v in values + [b]) + " | " + " | ".join(ratios) + " |")
    for s in mine:
        for seq in seqs:
            per_round = [(_worst(a, f"step_s@{seq}") or 0) / (_worst(b, f"step_s@{seq}") or float("inf"))
                         for a, b in zip(results[s], peer)]
            lines.append(f"- {s} / transformers, training step ratio per round, seq {seq}: "
                         + ", ".join(f"{r:.2f}×" for r in per_round))
    for which, rounds in results.items():
        errors = {r["error"] for rows in rounds for r in rows if "error" in r}
        for e in errors:
            last = e.strip().splitlines()[-1]
            lines.append(f"- {which} failed: `{last[:300]}`")
    lines.append("")
    with open(HERE / "RESULTS.md", "a") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
