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
