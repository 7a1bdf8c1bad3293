"""The sizing matrix of issue 41: each published configuration (bench/published_configs.py) on its mesh, sized by the
estimate and simulated by ``xpar-zoo size --simulate --json`` (one process each), with whether it fits an 80 GB and
a 141 GB GPU and the longest sequence (estimate) that fits each. Prints markdown rows for bench/RESULTS.md and
writes the raw JSON to ``--out``.

    python bench/simulate_matrix.py [--only NAME ...] [--layers N] [--jobs 2] [--out bench_sizing.json]

``--layers N``: each model cut to its first ``N`` decoder layers, same mesh and sequence (bench/RESULTS.md's
"reduced depth" rows: two depths give the per-layer slope of the estimate and of the simulation).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from published_configs import config, write

# nvidia-smi's totals: H100 80GB 81559 MiB, H200 143771 MiB
GPUS = {"80 GB": 81559 * 2**20, "141 GB": 143771 * 2**20}
MATRIX = [
    # name, model, world, mesh arguments, marked (the configurations NVIDIA / torchtitan tables publish)
    ("qwen3-30b ep8", "Qwen3-30B-A3B", 8, ["--ep", "8"], "torchtitan / NVIDIA: 8 x H100"),
    ("qwen3-235b ep8", "Qwen3-235B-A22B", 64, ["--ep", "8"], ""),
    ("qwen3-235b ep16", "Qwen3-235B-A22B", 64, ["--ep", "16"], ""),
    ("qwen3-235b ep8 emb8 head8", "Qwen3-235B-A22B", 64, ["--ep", "8", "--emb", "8", "--head", "8"], ""),
    ("deepseek-v3 ep64", "DeepSeek-V3", 256, ["--ep", "64"], "torchtitan / NVIDIA: 256 x H100"),
    ("gpt-oss-120b ep8", "gpt-oss-120b", 64, ["--ep", "8", "--attention", "flex_attention"], ""),
    ("qwen3-30b 131072 sp4 cp2", "Qwen3-30B-A3B", 8, ["--ep", "8", "--sp", "4", "--cp", "2", "--seq", "131072"], ""),
    ("qwen3-30b LoRA r16", "Qwen3-30B-A3B", 8, ["--ep", "8", "--lora-rank", "16"], ""),
]


def simulate(entry, root: Path, layers: int | None = None) -> dict:
    name, model, world, mesh, marked = entry
    directory = write(model, root / name.replace(" ", "_"), layers)
    argv = [sys.executable, "-m", "xpar_zoo", "size", str(directory), "--world", str(world), *mesh, "--simulate",
            "--json"]
    start, before = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(argv, capture_output=True, text=True, check=False,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    row = {"name": name, "model": model, "world": world, "mesh": mesh, "marked": marked, "layers": layers,
           "wall_s": round(time.perf_counter() - start), "rc": done.returncode}
    if done.returncode:
        row["error"] = done.stderr.strip().splitlines()[-1:]
        return row
    row.update(json.loads(done.stdout))
    row["cpu_s"] = round(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)  # approximate with --jobs
    return row


def longest_sequence(entry, budget: float, layers: int | None = None) -> int:
    """The longest sequence (a multiple of 1024, at most 1M tokens) whose estimated peak fits ``budget``."""
    from xpar_zoo import sizing
    from xpar_zoo.sizing.simulate import gpu_path_options

    _, model, world, mesh, _ = entry
    args = dict(zip(mesh[::2], mesh[1::2]))
    sizes = {k: int(args[f"--{k}"]) for k in ("ep", "emb", "head") if f"--{k}" in args}
    kwargs = {"sp": int(args.get("--sp", 1)), "cp": int(args.get("--cp", 1)),
              "attention": args.get("--attention", "sdpa"), "options": gpu_path_options()}
    if "--lora-rank" in args:
        kwargs["lora_rank"] = int(args["--lora-rank"])
    cfg = config(model, layers)
    step = 1024 * kwargs["sp"] * kwargs["cp"]
    low, high = 0, 1 << 20
    while high - low > step:
        mid = (low + high) // 2 // step * step or step
        if sizing.estimate(cfg, world, sizes, seq=mid, **kwargs).peak_bytes <= budget:
            low = mid
        else:
            high = mid
    return low


def markdown(rows: list[dict]) -> str:
    gib = 2**30
    header = ("| configuration | world | estimate (GiB) | simulated peak (GiB) | estimate / simulated | simulated by kind "
              "(GiB: params, grads, optimizer, activations, temporaries) | fits 80 GB / 141 GB | longest seq 80 / 141 GB "
              "(estimate) | simulation CPU s | published |")
    lines = [header, "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["rc"]:
            lines.append(f"| {r['name']} | {r['world']} | | not run: {' '.join(r.get('error', []))} | | | | | | "
                         f"{r['marked']} |")
            continue
        est, sim = r["estimate"]["peak_bytes"], r["simulated"]["peak_bytes"]
        kinds = ", ".join(f"{v / gib:.1f}" for v in r["simulated"]["by_kind"].values())
        fits = " / ".join("yes" if sim <= b else "no" for b in GPUS.values())
        longest = " / ".join(str(r["longest"][g]) for g in GPUS)
        lines.append(f"| {r['name']} | {r['world']} | {est / gib:.1f} | {sim / gib:.1f} | {est / sim:.3f} | {kinds} | "
                     f"{fits} | {longest} | {r.get('cpu_s', '')} | {r['marked']} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", nargs="*")
    parser.add_argument("--layers", type=int)
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--out", default="bench_sizing.json")
    args = parser.parse_args()
    entries = [e for e in MATRIX if not args.only or e[0] in args.only]
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(args.jobs) as pool:
        rows = list(pool.map(lambda e: simulate(e, Path(tmp), args.layers), entries))
    for entry, row in zip(entries, rows):
        row["longest"] = {g: longest_sequence(entry, b, args.layers) for g, b in GPUS.items()}
    Path(args.out).write_text(json.dumps(rows, indent=1))
    print(markdown(rows))


if __name__ == "__main__":
    main()
