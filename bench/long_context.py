"""Long-context memory bench (issue 30, not a test): the per-rank activation peak of one forward+backward on 4 gloo
CPU ranks under ``Mesh(sp=4)``, ``Mesh(cp=4)`` and ``Mesh(sp=2, cp=2, ep=2)`` against FSDP alone (``Mesh()``) on the
same full-length rows; and the longest sequence that trains within a fixed per-rank budget, ours beside transformers'
own ``DistributedConfig(fsdp_size=4, ep_size=2)`` path (as bench/cpu_suite.py drives it), in the same run.

    python bench/long_context.py [--seq 8192] [--budget-mib 160] [--ladder 1024,2048,...] [--long-mesh sp4]
                                 [--parts ratio,longest] [--attention sdpa] [--no-write]

**What is measured.** The peak of live CPU tensor bytes during one ``model(input_ids=…, labels=…).loss.backward()``
above those live when it starts (the parameters, FSDP's sharded state), from the torch profiler's allocator
accounting (:func:`xpar_zoo.testing.parity.live_peak_bytes`, ``profile_memory=True``: every tensor allocation and
free, so glibc's retention of freed heap does not blur it; the CPU analogue of ``torch.cuda.max_memory_allocated``).
It includes what autograd keeps, the transients of the step, the unsharded FSDP units and the gradients made by the
end of backward — the same for every mesh, since sp/cp place parameters as FSDP alone does. One warm-up step at a
short length first. Worst rank. Also the peak above that of a 64-token step (the length-independent part taken
out: an approximation, since the two peaks fall at different moments). Beside each figure: the sizer's prediction
of what a step adds (``xpar-zoo size`` less the sharded parameters and optimizer states: gathered units,
gradients, activations, the sp/cp mask, the fused loss's temporaries).

**The rows.** Every rank of a sequence group passes the same full-length rows, as the API asks (``model(**batch)``
keeps this rank's part); FSDP alone and transformers give every rank its own row of the same length. One row per
micro-batch, fp32, sdpa (``--attention eager``: eager). The step time is that of one more step of the same length
without the profiler (whose per-allocation records would weigh on paths with more allocations).

**Longest sequence.** Lengths from ``--ladder`` in order, per stack, until one's measured peak exceeds the budget;
a length whose sizer prediction exceeds twice the budget is not run (recorded as such): on a shared host a
quadratic term can take gigabytes per rank.

The model: a qwen3_moe, wide (hidden 256, 16 experts of 256, top-2) with narrow attention (4 query heads, 2 key/value
heads of 32; sp=4 repeats each key/value head once), 2 layers, vocab 2048: activations dominate, attention stays
cheap enough for a 2-core host.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gc
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

WORLD = 4
MB = 1024 * 1024
CONFIG = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=32, moe_intermediate_size=256,
              intermediate_size=512, num_experts=16, num_experts_per_tok=2, num_hidden_layers=2, vocab_size=2048,
              max_position_embeddings=131072)
MESHES = {"fsdp": {}, "sp4": {"sp": 4}, "cp4": {"cp": 4}, "sp2_cp2_ep2": {"sp": 2, "cp": 2, "ep": 2}}
LABELS = {"fsdp": "FSDP alone `Mesh()`", "sp4": "`Mesh(sp=4)`", "cp4": "`Mesh(cp=4)`",
          "sp2_cp2_ep2": "`Mesh(sp=2, cp=2, ep=2)`", "transformers": "transformers `DistributedConfig(fsdp_size=4, ep_size=2)`"}
WARMUP_SEQ = 256
BASE_SEQ = 64  # divides by 2·cp·sp for every mesh here


def cpu_model() -> str:
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def run_line(command: str, started: float, load: float) -> str:
    """The RESULTS.md line saying when, where and with what a bench ran: ``command`` took since ``started``
    (``time.time()``), the host's 1-minute load average ``load`` before and now after."""
    import torch
    import transformers

    return (f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; hardware: {cpu_model()}, "
            f"{os.cpu_count()} cores (a shared VM), load {load:.1f} before / {os.getloadavg()[0]:.1f} after; torch "
            f"{torch.__version__}, transformers {transformers.__version__}; `{command}` "
            f"({(time.time() - started) / 60:.1f} min)")


def write_results(text: str, no_write: bool) -> None:
    """Print ``text`` and, unless ``no_write``, append it to bench/RESULTS.md as a section of its own."""
    print(text)
    if not no_write:
        with open(HERE / "RESULTS.md", "a") as f:
            f.write("\n" + text)


def worst_peak(step, trace: str) -> int:
    """The worst rank's :func:`~xpar_zoo.testing.parity.live_peak_bytes` of ``step`` (every rank calls it)."""
    import torch.distributed as dist

    from xpar_zoo.testing import parity

    gc.collect()
    dist.barrier()
    peak = parity.live_peak_bytes(step, trace)
    peaks = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, peak)
    return max(peaks)


def peak_and_time(step, trace: str) -> dict:
    """``{"peak": worst rank's live peak of step(), "seconds": this rank's time of one more step() unprofiled}``."""
    import torch.distributed as dist

    peak = worst_peak(step, trace)
    gc.collect()
    dist.barrier()
    t0 = time.perf_counter()
    step()
    return {"peak": peak, "seconds": time.perf_counter() - t0}


def _predicted(stack: str, seq: int, attention: str) -> float:
    """The sizer's activation peak of one forward+backward on a rank of ``stack`` (bytes)."""
    from xpar_zoo import sizing
    from xpar_zoo.testing import parity

    cfg = parity.tiny_config("qwen3_moe", **CONFIG)
    sizes = dict(MESHES.get(stack, {}))
    sp, cp = sizes.pop("sp", 1), sizes.pop("cp", 1)
    ours = stack != "transformers"
    est = sizing.estimate(cfg, WORLD, sizes, seq=seq, param_dtype="fp32", sp=sp, cp=cp, fused_loss=ours,
                          attention=attention)
    # what a step adds to the sharded parameters a rank holds when it starts (no optimizer step here)
    return sum(v for k, v in est.memory.items() if not k.startswith(("parameters", "optimizer states")))


def _load(stack: str, directory: str, attention: str):
    if stack == "transformers":
        from transformers import AutoModelForCausalLM
        from transformers.distributed import DistributedConfig

        return AutoModelForCausalLM.from_pretrained(directory, distributed_config=DistributedConfig(
            fsdp_size=WORLD, ep_size=2), attn_implementation=attention)
    import xpar_zoo
    from xpar_zoo.styles.sequence import set_inner_attention

    sizes = MESHES[stack]
    model = xpar_zoo.from_pretrained(directory, mesh=xpar_zoo.Mesh(**sizes), progress=False)
    if "sp" in sizes or "cp" in sizes:
        set_inner_attention(model, attention)
    else:
        model.set_attn_implementation(attention)
    return model


def _step(model, offset: int, seq: int):
    """One forward+backward of a row of ``seq`` random tokens (seeded ``seq + offset``), as a call for the profiler."""
    import torch

    ids = torch.randint(0, model.config.vocab_size, (1, seq), generator=torch.Generator().manual_seed(seq + offset))

    def run():
        model(input_ids=ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)
    return run


def _side(stack: str, directory: str, seqs: list[int], budget: float | None, trace: str, attention: str
          ) -> list[dict]:
    """On every rank: load ``stack``, then for each length the live peak of one forward+backward (with ``budget``:
    stop after the first length over it, and skip lengths the sizer puts over twice the budget)."""
    import torch.distributed as dist

    from xpar_zoo.testing import parity

    rank = dist.get_rank()
    rows: list[dict] = []
    try:
        model = _load(stack, directory, attention)
        model.train()
        # a sequence group's ranks pass the same full-length row; other ranks each their own
        sequence_group = stack in MESHES and ("sp" in MESHES[stack] or "cp" in MESHES[stack])
        step = functools.partial(_step, model, 0 if sequence_group else rank)
        step(WARMUP_SEQ)()
        gc.collect()
        dist.barrier()
        # the parts that do not grow with the length (FSDP's unsharded units, the gradients): a short step's peak
        base = parity.live_peak_bytes(step(BASE_SEQ), f"{trace}-{stack}-{rank}.json")
        bases = [None] * dist.get_world_size()
        dist.all_gather_object(bases, base)
        for seq in seqs:
            predicted = _predicted(stack, seq, attention)
            row = {"seq": seq, "predicted": predicted}
            if budget is not None and predicted > 2 * budget:
                row["skipped"] = True
                rows.append(row)
                break
            gc.collect()
            dist.barrier()
            row["peak"] = parity.live_peak_bytes(step(seq), f"{trace}-{stack}-{rank}.json")
            gc.collect()
            dist.barrier()
            t0 = time.perf_counter()
            step(seq)()  # the step time, without the profiler
            row["seconds"] = time.perf_counter() - t0
            peaks = [None] * dist.get_world_size()
            dist.all_gather_object(peaks, row["peak"])
            row["worst"] = max(peaks)
            row["worst_above_base"] = max(p - b for p, b in zip(peaks, bases))
            rows.append(row)
            if budget is not None and row["worst"] > budget:
                break
        del model, step
    except Exception:
        rows.append({"error": traceback.format_exc(limit=6)[-2000:]})
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, rows)
    failed = [rs for rs in gathered if any("error" in r for r in rs)]
    return failed[0] if failed else gathered[0]


def _sides(jobs: list[tuple], directory: str, trace: str, attention: str) -> dict[str, list[dict]]:
    """Several :func:`_side` runs one after another in one launched run: ``[(name, stack, seqs, budget)]``."""
    return {name: _side(stack, directory, seqs, budget, trace, attention) for name, stack, seqs, budget in jobs}


def _make_checkpoint(directory: Path) -> None:
    from xpar_zoo.testing import parity

    model = parity.build_model(parity.tiny_config("qwen3_moe", **CONFIG))
    model.save_pretrained(directory)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=8192, help="the length of the ratio rows (goal: ≤ 0.35× FSDP alone)")
    ap.add_argument("--budget-mib", type=float, default=160.0, help="per-rank activation budget of the longest run")
    ap.add_argument("--ladder", default="1024,2048,3072,4096,6144,8192,12288,16384,24576,32768")
    ap.add_argument("--long-mesh", default="sp4", choices=[m for m in MESHES if m != "fsdp"],
                    help="our mesh for the longest sequence")
    ap.add_argument("--meshes", default=",".join(MESHES), help="meshes of the ratio rows (fsdp first)")
    ap.add_argument("--parts", default="ratio,longest")
    ap.add_argument("--attention", default="sdpa", choices=["sdpa", "eager"])
    ap.add_argument("--no-write", action="store_true", help="print, do not append to bench/RESULTS.md")
    args = ap.parse_args()
    parts = args.parts.split(",")
    from xpar_zoo.testing import launch

    work = Path(tempfile.mkdtemp(prefix="xpar-long-context-"))
    ckpt = work / "hub"
    ckpt.mkdir()
    _make_checkpoint(ckpt)
    trace = str(work / "trace")
    load = [os.getloadavg()[0]]
    started = time.perf_counter()
    ladder = [int(x) for x in args.ladder.split(",")]
    budget = args.budget_mib * MB
    ours = [(mesh, mesh, [args.seq], None) for mesh in args.meshes.split(",")] if "ratio" in parts else []
    if "longest" in parts:
        ours.append(("longest", args.long_mesh, ladder, budget))
    results = launch.run(_sides, WORLD, ours, str(ckpt), trace, args.attention, timeout_s=1800,
                         start_method="forkserver")
    load.append(os.getloadavg()[0])
    if "longest" in parts:  # transformers in a run of its own (its loading sets process-wide state)
        results.update(launch.run(_sides, WORLD, [("transformers", "transformers", ladder, budget)], str(ckpt),
                                  trace, args.attention, timeout_s=1800, start_method="forkserver"))
        load.append(os.getloadavg()[0])
    print(json.dumps(results, default=str), flush=True)
    ratio = {name: rows for name, rows in results.items() if name in MESHES}
    longest = {args.long_mesh: results["longest"], "transformers": results["transformers"]} if "longest" in parts else {}
    minutes = (time.perf_counter() - started) / 60

    import torch
    import transformers

    import xpar_zoo
    from xpar_zoo.parallel.options import ENV, ParallelOptions

    lines = ["", "## Long context: activation peak per rank, sp / cp against FSDP alone (issue 30)", "",
             f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; hardware: {cpu_model()}, "
             f"{os.cpu_count()} cores (a shared VM); torch {torch.__version__}, transformers {transformers.__version__}, "
             f"xpar_zoo {xpar_zoo.__version__}; `python bench/long_context.py` ({minutes:.1f} min)",
             f"- model: qwen3_moe fp32, {CONFIG['num_hidden_layers']} layers, hidden {CONFIG['hidden_size']}, "
             f"{CONFIG['num_experts']} experts of {CONFIG['moe_intermediate_size']} (top-{CONFIG['num_experts_per_tok']}), "
             f"{CONFIG['num_attention_heads']} query / {CONFIG['num_key_value_heads']} key-value heads of "
             f"{CONFIG['head_dim']}, vocab {CONFIG['vocab_size']}; {args.attention}; 4 gloo ranks; one row per micro-batch",
             "- measured: peak live CPU tensor bytes of one forward+backward above its start (torch profiler, "
             "`profile_memory=True`, `xpar_zoo.testing.parity.live_peak_bytes`), worst rank; sizer: `xpar-zoo size` "
             "(gathered units, gradients, activations, sp/cp mask, fused-loss temporaries)",
             "- host load average (1 min) before and after each launched run: " + ", ".join(f"{a:.1f}" for a in load),
             f"- sp/cp masked attention: blocks of queries within {ParallelOptions.from_env().block_budget('cpu') / MB:g}"
             f" MiB (`{ENV['attention_block_mib']}`), the whole mask once per forward where it fits; step: one more step without "
             "the profiler"]
    fmt = (lambda v: f"{v / MB:.1f}")
    if ratio:
        base = next((r[0].get("worst") for m, r in ratio.items() if m == "fsdp" and r and "worst" in r[0]), None)
        above = next((r[0].get("worst_above_base") for m, r in ratio.items() if m == "fsdp" and r and "worst" in r[0]),
                     None)
        lines += ["", f"Per-rank activation peak at {args.seq} tokens per row (goal: sp/cp ≤ 0.35× FSDP alone):", "",
                  "| mesh | measured peak (MiB) | × FSDP alone | above a 64-token step (MiB) | × FSDP alone | "
                  "sizer (MiB) | sizer / measured | step (s) |",
                  "|---|---|---|---|---|---|---|---|"]
        for mesh, rows in ratio.items():
            r = rows[0] if rows else {}
            if "worst" not in r:
                err = (r.get("error") or "no result").strip().splitlines()[-1][:200]
                lines.append(f"| {LABELS[mesh]} | failed: `{err}` | | | | | | |")
                continue
            a = r["worst_above_base"]
            lines.append(f"| {LABELS[mesh]} | {fmt(r['worst'])} | " + (f"{r['worst'] / base:.2f}×" if base else "—")
                         + f" | {fmt(a)} | " + (f"{a / above:.2f}×" if above else "—")
                         + f" | {fmt(r['predicted'])} | {r['predicted'] / r['worst']:.2f} | {r['seconds']:.1f} |")
    if longest:
        budget = args.budget_mib * MB
        lines += ["", f"Longest sequence that trains within {args.budget_mib:g} MiB of activation peak per rank "
                  f"(lengths tried: {args.ladder}; goal: ours ≥ 3.5× transformers'):", "",
                  "| stack | longest within budget | its peak (MiB) | next length: peak (MiB) |", "|---|---|---|---|"]
        best = {}
        for stack, rows in longest.items():
            ok = [r for r in rows if "worst" in r and r["worst"] <= budget]
            over = next((r for r in rows if r.get("skipped") or ("worst" in r and r["worst"] > budget)), None)
            errs = [r["error"] for r in rows if "error" in r]
            best[stack] = ok[-1]["seq"] if ok else 0
            nxt = ("—" if over is None else f"{over['seq']}: sizer {fmt(over['predicted'])}, not run" if
                   over.get("skipped") else f"{over['seq']}: {fmt(over['worst'])}")
            if errs:
                nxt += f" (failed: `{errs[0].strip().splitlines()[-1][:200]}`)"
            lines.append(f"| {LABELS[stack]} | {best[stack] or 'none'} | "
                         f"{fmt(ok[-1]['worst']) if ok else '—'} | {nxt} |")
        ours, peer = best.get(args.long_mesh, 0), best.get("transformers", 0)
        if ours and peer:
            lines.append(f"- ours / transformers: {ours / peer:.2f}× longer")
    lines.append("")
    text = "\n".join(lines)
    print(text)
    if not args.no_write:
        with open(HERE / "RESULTS.md", "a") as f:
            f.write(text)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
