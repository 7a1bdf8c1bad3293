"""Export benchmark (issue 6, not a test): a ≈ 1 GB xpar_zoo DCP checkpoint exported to the hub format with
`xpar-zoo convert to-hf`; peak RSS growth against 2 × the output shard size, and throughput against a plain copy of
the same bytes, side by side in one run. Appends a section to bench/RESULTS.md.

    python bench/export.py [--shard 200MB] [--keep DIR]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def cpu_model() -> str:
    """The CPU's model name (lscpu's), for RESULTS.md."""
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def _make_checkpoint(root: str) -> None:

    import xpar_zoo
    from xpar_zoo.testing import parity

    cfg = parity.tiny_config("qwen3_moe", hidden_size=1024, moe_intermediate_size=1024, num_experts=16,
                             num_hidden_layers=4, vocab_size=32000, num_attention_heads=8, num_key_value_heads=4,
                             head_dim=128, intermediate_size=2048)
    model = parity.build_model(cfg)
    model = xpar_zoo.parallelize(model, xpar_zoo.Mesh())
    xpar_zoo.save_checkpoint(root, model, step=1)
    return sum(p.numel() for p in model.parameters()) * 4


def _measure(code: str) -> tuple[float, float]:
    """Run ``code`` in a fresh interpreter; return (seconds of the timed part, peak RSS MiB)."""
    wrapper = ("import resource, time, sys\n" + code.replace("\n", "\n") +
               "\nprint('RESULT', T, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)\n")
    out = subprocess.run([sys.executable, "-c", wrapper], capture_output=True, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"}, check=True).stdout
    line = [x for x in out.splitlines() if x.startswith("RESULT")][-1].split()
    return float(line[1]), float(line[2])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shard", default="200MB")
    ap.add_argument("--keep", help="work directory to keep (default: a temporary one)")
    args = ap.parse_args()
    from xpar_zoo.converters.export import parse_size

    from xpar_zoo.testing import launch

    parse_size(args.shard)  # a bad --shard fails here, before the checkpoint is made
    work = Path(args.keep or tempfile.mkdtemp(prefix="xpar-export-bench-"))
    ckpt = work / "ckpt"
    if not ckpt.exists():
        launch.run(_make_checkpoint, 1, str(ckpt))
    step = sorted(ckpt.iterdir())[-1]
    nbytes = sum(f.stat().st_size for f in step.rglob("*") if f.is_file())

    imports = ("import xpar_zoo, xpar_zoo.checkpoint, transformers, safetensors.torch, tqdm\n"
               "from xpar_zoo.converters import export\nfrom transformers.core_model_loading import "
               "revert_weight_conversion\nfrom transformers import AutoModelForCausalLM\n")
    _, base_rss = _measure(imports + "T = 0.0")
    copy_s, copy_rss = _measure(f"import shutil\nt0 = time.perf_counter()\nshutil.copytree({str(step)!r}, "
                                f"{str(work / 'copy')!r}, dirs_exist_ok=True)\nT = time.perf_counter() - t0")
    shutil.rmtree(work / "copy", ignore_errors=True)
    export_s, export_rss = _measure(
        imports + f"from xpar_zoo.commands import cli\nt0 = time.perf_counter()\nrc = cli.main(['convert', 'to-hf', "
        f"{str(ckpt)!r}, {str(work / 'out')!r}, '--force', '--max-shard-size', {args.shard!r}])\n"
        f"assert rc == 0\nT = time.perf_counter() - t0")
    out_bytes = sum(f.stat().st_size for f in (work / "out").glob("*.safetensors"))
    largest = max(f.stat().st_size for f in (work / "out").glob("*.safetensors"))
    growth = export_rss - base_rss
    result = {
        "checkpoint_MiB": nbytes / 2**20, "output_MiB": out_bytes / 2**20, "largest_shard_MiB": largest / 2**20,
        "baseline_rss_MiB": base_rss, "export_peak_rss_MiB": export_rss, "growth_MiB": growth,
        "bound_MiB": 2 * largest / 2**20, "export_s": export_s, "copy_s": copy_s,
        "export_MiB_s": nbytes / 2**20 / export_s, "copy_MiB_s": nbytes / 2**20 / copy_s,
    }
    print(json.dumps(result, indent=1))
    import torch
    import transformers

    section = f"""
## Export (issue 6)

- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; hardware: {cpu_model()}, {os.cpu_count()} cores; torch {torch.__version__}, transformers {transformers.__version__}
- checkpoint: qwen3_moe fp32 (hidden 1024, 16 experts × 1024, 4 layers, vocab 32000), {result['checkpoint_MiB']:.0f} MiB of DCP; `xpar-zoo convert to-hf --max-shard-size {args.shard}` → {result['output_MiB']:.0f} MiB of per-expert hub safetensors; page cache warm; fresh processes

| | time | throughput | peak RSS growth over the imports |
|---|---|---|---|
| `xpar-zoo convert to-hf` | {export_s:.2f} s | {result['export_MiB_s']:.0f} MiB/s | {growth:.0f} MiB (bound 2 × largest shard = {result['bound_MiB']:.0f} MiB) |
| plain copy of the same DCP files (`shutil.copytree`) | {copy_s:.2f} s | {result['copy_MiB_s']:.0f} MiB/s | {copy_rss - base_rss:.0f} MiB |

- export / copy time: {export_s / copy_s:.2f}×; memory bound {'met' if growth <= result['bound_MiB'] else 'NOT met'}
"""
    with open(HERE / "RESULTS.md", "a") as f:
        f.write(section)
    print(section)
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
