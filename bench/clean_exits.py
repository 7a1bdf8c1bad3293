"""Clean exits (issue 36): short 4-rank CPU training runs repeated beside CPU-burning processes; how many end with a
nonzero exit status on some rank, with the ranks ending through xpar_zoo's safe rank exit (``--ending rank``: what
``xpar-zoo train`` and the launched helpers do) or through the interpreter's own exit (``--ending interpreter``: a
plain script under torchrun).

    python bench/clean_exits.py [--runs 50] [--ending rank|interpreter] [--burners 2] [--write]

Every rank is forked from this process (torch, transformers and xpar_zoo imported once); the runs cycle through the
meshes of the runs that aborted in the issue. ``--write`` appends the figures to bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
MESHES = [{}, {"ep": 2}, {"cp": 4}, {"ep": 2, "emb": 2, "head": 4}]


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--ending", choices=("rank", "interpreter"), default="rank")
    ap.add_argument("--burners", type=int, default=2)
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import transformers

    from xpar_zoo.testing.exits import repeat_runs, summary, tiny_training

    t0 = time.perf_counter()
    statuses = []
    for i in range(args.runs):  # a rank leaving by SystemExit (--ending interpreter) unwinds from here to the top
        statuses += repeat_runs(tiny_training, 4, 1, MESHES[i % len(MESHES)], ending=args.ending,
                                burners=args.burners)
        print(f"run {i}: {statuses[-1]}", flush=True)
    result = {**summary(statuses), "ending": args.ending, "seconds": time.perf_counter() - t0}
    print(json.dumps(result))
    if not args.write:
        return
    load = os.getloadavg()[0]
    section = f"""
## Clean exits (issue 36)

- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; hardware: {cpu_model()}, {os.cpu_count()} cores (shared: load average {load:.0f} at the end); torch {torch.__version__}, transformers {transformers.__version__}
- {args.runs} runs of 4 gloo ranks (tiny qwen3_moe, 2 AdamW steps; meshes cycling {', '.join(str(m) for m in MESHES)}) beside {args.burners} CPU-burning processes; ranks ending through `--ending {args.ending}`: `python bench/clean_exits.py --runs {args.runs} --ending {args.ending}`
- runs with a nonzero exit status on some rank: **{result['unclean']} of {result['runs']}** (statuses seen: {result['statuses'] or 'none'}); {result['seconds'] / 60:.0f} min
"""
    with open(HERE / "RESULTS.md", "a") as f:
        f.write(section)


if __name__ == "__main__":
    main()
