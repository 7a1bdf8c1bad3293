"""flex_attention under cp on CPU (issue 30, not a test): does the sp/cp attention on flex avoid the dense
``[S/cp, S]`` mask that sdpa gets under cp on CPU? The per-rank peak of live CPU tensor bytes
(:func:`xpar_zoo.testing.parity.live_peak_bytes`) of one forward of bench/long_context.py's model on 4 gloo ranks,
``Mesh(cp=4)``, one row of ``S`` tokens (fp32), with the inner attention ``sdpa`` (CPU's default under cp: the
shared additive mask) and ``flex_attention`` (a ``BlockMask``). Forward only, without gradients: torch has no flex
backward on CPU. Also what autograd keeps for one sdpa forward with gradients (the mask among it), and the seconds
of the first flex forward (transformers ``torch.compile``s flex) and of a second one.

    python bench/flex_cp_memory.py [--seqs 4096,8192] [--no-write]
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

MB = 1024 * 1024


def _forward(model, ids) -> None:
    import torch

    with torch.no_grad():
        model(input_ids=ids, labels=ids)


def _forward_backward(model, ids) -> None:
    model(input_ids=ids, labels=ids).loss.backward()


def _rank(seqs: list[int], trace_dir: str) -> dict:
    import torch
    import torch.distributed as dist
    from long_context import CONFIG

    import xpar_zoo
    from xpar_zoo.testing import parity

    rank, out = dist.get_rank(), {}
    for inner in ("sdpa", "flex_attention"):
        config = parity.tiny_config("qwen3_moe", **CONFIG, attn_implementation=inner, use_cache=False)
        model = xpar_zoo.parallelize(parity.build_model(config), xpar_zoo.Mesh(cp=4))
        for seq in seqs:
            ids = torch.randint(0, CONFIG["vocab_size"], (1, seq), generator=torch.Generator().manual_seed(seq))
            t = time.perf_counter()
            _forward(model, ids)  # warm-up (flex: compiles)
            first = time.perf_counter() - t
            t = time.perf_counter()
            _forward(model, ids)
            second = time.perf_counter() - t
            trace = os.path.join(trace_dir, f"trace{rank}_{inner}_{seq}.json")
            peak = parity.live_peak_bytes(functools.partial(_forward, model, ids), trace)
            row = {"peak": peak, "first_s": first, "second_s": second}
            if inner == "sdpa":
                params = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
                row["saved"] = parity.saved_for_backward_bytes(
                    functools.partial(_forward_backward, model, ids), exclude=params)
                model.zero_grad(set_to_none=True)
            out[(inner, seq)] = row
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, out)
    return {k: {m: max(g[k][m] for g in gathered) for m in out[k]} for k in out}


def main() -> None:
    import torch
    import transformers

    from xpar_zoo.testing import launch

    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", default="4096,8192")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    seqs = [int(s) for s in args.seqs.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        res = launch.run(_rank, 4, seqs, tmp, timeout_s=3000)
    lines = ["| S | sdpa (dense mask) forward peak | flex forward peak | dense mask `[S/4, S]` fp32 | sdpa fwd+bwd "
             "saved for backward | flex first / second forward (s) | sdpa forward (s) |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for seq in seqs:
        s, f = res[("sdpa", seq)], res[("flex_attention", seq)]
        lines.append(f"| {seq} | {s['peak'] / MB:.1f} MiB | {f['peak'] / MB:.1f} MiB | {seq // 4 * seq * 4 / MB:.0f} MiB "
                     f"| {s['saved'] / MB:.1f} MiB | {f['first_s']:.1f} / {f['second_s']:.2f} | {s['second_s']:.2f} |")
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    text = "\n".join([
        "", f"## Long context: flex_attention under cp on CPU, without the dense mask (issue 30, {datetime.date.today()})",
        "", f"4 gloo ranks on {os.cpu_count()} cores ({cpu}), torch {torch.__version__}, transformers "
        f"{transformers.__version__}; bench/long_context.py's qwen3_moe (2 layers, 4 query / 2 key-value heads of 32), "
        "`Mesh(cp=4)`, one row, fp32, `OMP_NUM_THREADS=1`. Worst rank's peak of live tensor bytes during one forward "
        "without gradients (torch has no flex backward on CPU), above those live before it "
        "(`python bench/flex_cp_memory.py`).", "", *lines, ""])
    print(text)
    if not args.no_write:
        with open(HERE / "RESULTS.md", "a") as f:
            f.write(text)


if __name__ == "__main__":
    main()
