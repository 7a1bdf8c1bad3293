"""Run in a process of its own (the simulation makes torch's fake process group): ``argv[1]`` is a JSON object with
``"cli"``, a list of ``xpar-zoo`` argument lists (each run, its output kept), and ``"cases"``, a list of
``[model_type, config overrides, estimate arguments]`` (each sized by the estimate and simulated); prints one JSON
object ``{"cli": [stdout, …], "cases": [{"estimate": peak bytes, "memory": …, "simulated": …}, …]}``."""

import contextlib
import io
import json
import sys

from xpar_zoo import sizing
from xpar_zoo.commands import cli
from xpar_zoo.sizing.simulate import gpu_path_options, simulate
from xpar_zoo.testing import parity


def run_case(model_type: str, overrides: dict, kwargs: dict) -> dict:
    cfg = parity.tiny_config(model_type, **overrides)
    kwargs = dict(kwargs)
    world, sizes = kwargs.pop("world"), kwargs.pop("sizes", {})
    imbalance = kwargs.pop("route_imbalance", 1.0)
    est = sizing.estimate(cfg, world, sizes, options=gpu_path_options(), **kwargs)
    sim = simulate(cfg, world, sizes, route_imbalance=imbalance, **kwargs)
    return {"estimate": est.peak_bytes, "memory": est.memory, "simulated": sim.as_dict()}


def run_cli(argv: list[str]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli.main(argv)
    return out.getvalue() + ("" if code == 0 else f"\nexit {code}")


if __name__ == "__main__":
    request = json.loads(sys.argv[1])
    print(json.dumps({"cli": [run_cli(a) for a in request.get("cli", [])],
                      "cases": [run_case(*c) for c in request.get("cases", [])]}))


def measured_peak(overrides: dict, sizes: dict, seq: int) -> list[int]:
    """On launched gloo ranks: a tiny qwen3_moe on ``Mesh(**sizes)`` in bf16 mixed precision with FSDP2's own
    collectives (what the simulation runs); after a first step has made the optimizer's states, every rank's peak
    of live tensor bytes during a second step (forward, backward, clip, AdamW, zero_grad) above those live before it
    (sharded parameters and optimizer states)."""
    import os
    import tempfile

    import torch
    import torch.distributed as dist

    import xpar_zoo
    from xpar_zoo.parallel.options import ParallelOptions

    cfg = parity.tiny_config("qwen3_moe", **overrides)
    model = xpar_zoo.parallelize(parity.build_model(cfg), xpar_zoo.Mesh(**sizes), mixed_precision=True,
                                 options=ParallelOptions(cpu_collectives="gloo"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    ids = torch.randint(0, cfg.vocab_size, (1, seq), generator=torch.Generator().manual_seed(dist.get_rank()))

    def step() -> None:
        model(input_ids=ids, labels=ids).loss.backward()
        xpar_zoo.clip_grad_norm_(model, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    with tempfile.TemporaryDirectory() as tmp:
        peak = parity.live_peak_bytes(step, os.path.join(tmp, "trace.json"))
    peaks = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, peak)
    return peaks
