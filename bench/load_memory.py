"""Peak memory and time of loading a ≈400 MB fp32 qwen3_moe hub checkpoint on 4 CPU (gloo) ranks:
``xpar_zoo.from_pretrained(Mesh(ep=2))`` versus transformers' own
``AutoModelForCausalLM.from_pretrained(dir, distributed_config=DistributedConfig(fsdp_size=4, ep_size=2))``.

Per rank: RSS just before the load (after ``init_process_group``, imports and a ``gc``), the peak RSS during the load
(``VmHWM`` after resetting it through ``/proc/self/clear_refs``), and the wall time between two barriers. The worst
rank is reported. Goal: peak growth ≤ 1.25 × checkpoint / world + 40 MB, and no slower than transformers.

    python bench/load_memory.py [--keep DIR] [--repeat N]

transformers' distributed loading needs ``accelerate`` (not an xpar_zoo dependency); without it the transformers
row records the error. To measure it without touching the project's environment:
``pip install --target /tmp/accel --no-deps accelerate psutil pyyaml`` and run with ``PYTHONPATH=/tmp/accel``.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

WORLD = 4
MB = 1024 * 1024
CONFIG = dict(vocab_size=8000, hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
              head_dim=64, num_experts=32, num_experts_per_tok=4, moe_intermediate_size=448, intermediate_size=1024,
              max_position_embeddings=256)
SHARD = "50MB"


def _status(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS


def make_checkpoint(directory: Path) -> int:
    """Save a random qwen3_moe with ``CONFIG`` in hub format (per-expert keys, ``SHARD`` files); return its bytes."""
    from xpar_zoo.testing import parity

    model = parity.build_model(parity.tiny_config("qwen3_moe", **CONFIG))
    model.save_pretrained(directory, max_shard_size=SHARD)
    del model
    gc.collect()
    return sum(p.stat().st_size for p in directory.glob("*.safetensors"))


def _load(which: str, directory: str):
    if which == "xpar_zoo":
        import xpar_zoo

        # the mesh is built inside the timed load, as transformers builds its own there
        return lambda: xpar_zoo.from_pretrained(directory, mesh=xpar_zoo.Mesh(ep=2), progress=False)
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    return lambda: AutoModelForCausalLM.from_pretrained(
        directory, distributed_config=DistributedConfig(fsdp_size=WORLD, ep_size=2))


def measure(which: str, directory: str) -> dict:
    """On every rank: RSS growth and time of one load; rank 0 gets every rank's numbers."""
    import torch.distributed as dist
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM  # noqa: F401 — both loaders start with these imported
    from transformers.utils import logging

    logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    load = _load(which, directory)
    gc.collect()
    dist.barrier()
    _reset_peak()
    before = _status("VmRSS")
    start = time.perf_counter()
    error = None
    try:
        model = load()
        local = sum(p.to_local().numel() * p.element_size() if hasattr(p, "to_local") else p.numel() * p.element_size()
                    for p in model.parameters())
    except Exception as e:  # noqa: BLE001 — a failed baseline is a result too
        error, local = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=6)}", 0
    elapsed = time.perf_counter() - start
    peak = _status("VmHWM")
    done = torch.tensor([elapsed])
    dist.all_reduce(done, op=dist.ReduceOp.MAX)
    row = {"rank": dist.get_rank(), "rss_before": before, "peak": peak, "growth": peak - before, "seconds": elapsed,
           "local_param_bytes": local, "error": error}
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    return {"rows": rows, "seconds": done.item()}


def _warm_page_cache(directory: Path) -> None:
    for p in sorted(directory.glob("*.safetensors")):
        with open(p, "rb") as f:
            while f.read(64 * MB):
                pass


def _hardware() -> str:
    try:
        model = re.search(r"Model name:\s+(.*)", subprocess.run(["lscpu"], capture_output=True, text=True).stdout)
        name = model.group(1).strip() if model else platform.processor()
    except OSError:
        name = platform.processor()
    return f"{name}, {os.cpu_count()} cores"


def main() -> None:
    from transformers import __version__ as tf_version

    from xpar_zoo.testing import launch

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keep", type=Path, help="build (or reuse) the checkpoint here instead of a temp dir")
    parser.add_argument("--repeat", type=int, default=2, help="loads per loader (the best time and worst memory)")
    parser.add_argument("--results", type=Path, default=Path(__file__).with_name("RESULTS.md"))
    parser.add_argument("--no-write", action="store_true", help="print only; do not append to RESULTS.md")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        directory = args.keep or Path(tmp) / "qwen3_moe_400mb"
        if not (directory / "config.json").is_file():
            t = time.perf_counter()
            make_checkpoint(directory)
            print(f"built {directory} in {time.perf_counter() - t:.1f}s", file=sys.stderr)
        ckpt = sum(p.stat().st_size for p in directory.glob("*.safetensors"))
        files = len(list(directory.glob("*.safetensors")))
        goal = 1.25 * ckpt / WORLD + 40 * MB
        _warm_page_cache(directory)
        results = {}
        for which in ("xpar_zoo", "transformers"):
            runs = [launch.run(measure, WORLD, which, str(directory), timeout_s=900) for _ in range(args.repeat)]
            errors = [r["error"] for run in runs for r in run["rows"] if r["error"]]
            times = sorted(run["seconds"] for run in runs)
            results[which] = {
                "seconds": times[0],
                "median": times[len(times) // 2],
                "growth": max(r["growth"] for run in runs for r in run["rows"]),
                "local": max(r["local_param_bytes"] for run in runs for r in run["rows"]),
                "error": errors[0] if errors else None,
            }
            print(which, results[which], file=sys.stderr)

    x, t = results["xpar_zoo"], results["transformers"]
    lines = [
        "",
        "## Load memory (issue 3)",
        "",
        f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; hardware: {_hardware()}; "
        f"torch {torch.__version__}, transformers {tf_version}, Python {platform.python_version()}",
        f"- checkpoint: qwen3_moe fp32, hidden {CONFIG['hidden_size']}, {CONFIG['num_experts']} experts × "
        f"moe_intermediate {CONFIG['moe_intermediate_size']}, {CONFIG['num_hidden_layers']} layers, vocab "
        f"{CONFIG['vocab_size']}: {ckpt / MB:.1f} MiB in {files} hub-format files (per-expert keys); "
        f"{WORLD} gloo ranks on CPU, page cache warm; worst rank of {args.repeat} loads each (fresh processes)",
        f"- goal: peak RSS growth ≤ 1.25 × {ckpt / WORLD / MB:.1f} MiB + 40 MiB = {goal / MB:.1f} MiB per rank; "
        "time ≤ transformers'",
        "",
        "| loader | worst per-rank peak RSS growth | ÷ (checkpoint / world) | local params per rank | load time (best / median) |",
        "|---|---|---|---|---|",
        f"| `xpar_zoo.from_pretrained(dir, mesh=Mesh(ep=2))` | {x['growth'] / MB:.1f} MiB | "
        f"{x['growth'] / (ckpt / WORLD):.2f} | {x['local'] / MB:.1f} MiB | {x['seconds']:.2f} s / {x['median']:.2f} s |",
    ]
    if t["error"] is None:
        lines.append(
            f"| `AutoModelForCausalLM.from_pretrained(dir, distributed_config=DistributedConfig(fsdp_size=4, "
            f"ep_size=2))` | {t['growth'] / MB:.1f} MiB | {t['growth'] / (ckpt / WORLD):.2f} | "
            f"{t['local'] / MB:.1f} MiB | {t['seconds']:.2f} s / {t['median']:.2f} s |")
        lines += ["", f"- xpar_zoo / transformers: memory {x['growth'] / max(t['growth'], 1):.2f}×, "
                      f"time {x['seconds'] / t['seconds']:.2f}× (best), {x['median'] / t['median']:.2f}× (median)"]
    else:
        lines += ["", "- transformers' `DistributedConfig(fsdp_size=4, ep_size=2)` load did not run on CPU/gloo:",
                  "", "```", t["error"].strip()[:3000], "```"]
    try:
        import accelerate

        lines.append(f"- transformers ran with accelerate {accelerate.__version__} (from PYTHONPATH, not a project dependency)")
    except ImportError:
        pass
    lines.append(f"- goal met: memory {'yes' if x['growth'] <= goal else 'NO'} "
                 f"({x['growth'] / MB:.1f} ≤ {goal / MB:.1f} MiB)"
                 + ("" if t["error"] else f", time {'yes' if x['median'] <= t['median'] else 'NO'} (median)"))
    text = "\n".join(lines) + "\n"
    print(text)
    if not args.no_write:
        with open(args.results, "a") as f:
            f.write(text)


if __name__ == "__main__":
    main()
