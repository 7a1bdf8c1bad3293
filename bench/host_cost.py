"""Host cost per training step (issue 29, not a test): a many-layer qwen3_moe on 2 gloo ranks (CPU, ``Mesh(ep=2)``,
AdamW, clipping at 1.0), each step timed both ways in turn in one run: as before issue 29 (the readiness check walks the
model before every forward; clipping one tensor at a time, :func:`xpar_zoo.testing.parity.clip_grad_norm_per_tensor`)
and now (the walk once; batched clipping). Also alone: the check as the forward hook calls it, and each clip. Prints one
JSON line (medians; the slowest rank); the figures go to bench/RESULTS.md ("Host cost per step").

    python bench/host_cost.py [--layers 32] [--steps 16] [--repeat 20]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time


def _interleaved_ms(fns: dict, repeat: int) -> dict:
    """``{name: median ms}`` of the calls ``fns`` (``{name: fn}``), called in turn ``repeat`` times."""
    times: dict = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def _job(layers: int, steps: int, repeat: int) -> dict:
    import torch
    import torch.distributed as dist

    import xpar_zoo
    from xpar_zoo.parallel.state import parallel_state
    from xpar_zoo.parallelize import check_ready
    from xpar_zoo.testing import parity

    cfg = parity.tiny_config("qwen3_moe", num_hidden_layers=layers)
    model = xpar_zoo.parallelize(parity.build_model(cfg), xpar_zoo.Mesh(ep=2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rank = dist.get_rank()
    ids = parity.make_batches(cfg.vocab_size, steps, dist.get_world_size(), batch=2, seq=16)
    before = {"on": False}

    def forget(module, args):  # before issue 29: the check walked the model at every forward
        if before["on"]:
            parallel_state(module).ready_at = None

    model.register_forward_pre_hook(forget, prepend=True)

    def step(i: int, old: bool) -> float:
        before["on"] = old
        dist.barrier()
        start = time.perf_counter()
        model(input_ids=ids[i, rank], labels=ids[i, rank]).loss.backward()
        (parity.clip_grad_norm_per_tensor if old else xpar_zoo.clip_grad_norm_)(model, 1.0)
        opt.step()
        opt.zero_grad()
        return time.perf_counter() - start

    step(0, False)  # warm-up: lazy FSDP init, the first check
    times = {True: [], False: []}
    for i in range(1, steps):
        for old in ((True, False) if i % 2 else (False, True)):  # in turn, each first every other step
            times[old].append(step(i, old))
    model(input_ids=ids[0, rank], labels=ids[0, rank]).loss.backward()  # gradients to clip

    def walk():
        parallel_state(model).ready_at = None
        check_ready(model)

    huge = 1e9  # clipping then scales by 1: the gradients stay as they are between calls
    out = {"step_ms_before": statistics.median(times[True]) * 1e3,
           "step_ms_after": statistics.median(times[False]) * 1e3,
           **_interleaved_ms({"check_ms_before": walk, "check_ms_after": lambda: check_ready(model),
                              "clip_ms_before": lambda: parity.clip_grad_norm_per_tensor(model, huge),
                              "clip_ms_after": lambda: xpar_zoo.clip_grad_norm_(model, huge)}, repeat)}
    norms = (parity.clip_grad_norm_per_tensor(model, huge).item(), xpar_zoo.clip_grad_norm_(model, huge).item())
    worst = torch.tensor(list(out.values()), dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
    out = dict(zip(out, worst.tolist()))
    out["norm_rel_diff"] = abs(norms[0] - norms[1]) / norms[0]
    out["parameters"] = sum(1 for _ in model.parameters())
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=20, help="calls of the check and of each clip alone (median)")
    args = ap.parse_args()

    import torch
    import transformers

    from xpar_zoo.testing import launch

    result = launch.run(_job, 2, args.layers, args.steps, args.repeat, timeout_s=1800)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(json.dumps({"commit": commit, "layers": args.layers, "world": 2, "mesh": "ep=2", "torch": torch.__version__,
                      "transformers": transformers.__version__,
                      "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                      **{k: float(f"{v:.4g}") if isinstance(v, float) else v for k, v in result.items()}}))


if __name__ == "__main__":
    main()
