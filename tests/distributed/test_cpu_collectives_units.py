"""``parallelize``'s switch for the CPU's in-place gloo collectives, on 2 gloo ranks: by default every FSDP unit gets
them; ``cpu_collectives="gloo"`` (``ParallelOptions.cpu_collectives``) or, without options,
``XPAR_ZOO_GLOO_IN_PLACE=0`` leaves every unit with FSDP2's own, and the module
that holds them is then never imported."""

from __future__ import annotations

import os
import sys

from xpar_zoo.testing import launch, parity


def _units_given_in_place(how: str) -> tuple[int, int, bool]:
    """(FSDP units, units given the in-place collectives, whether gloo_comms was imported before parallelize)."""
    from torch.distributed.fsdp import FSDPModule

    import xpar_zoo

    imported_before = "xpar_zoo.parallel.gloo_comms" in sys.modules
    kwargs = {}
    if how == "env":
        os.environ["XPAR_ZOO_GLOO_IN_PLACE"] = "0"
    elif how != "default":
        kwargs["cpu_collectives"] = how
    given = []
    if how in ("default", "in_place"):
        from xpar_zoo.parallel import gloo_comms

        real = gloo_comms.use_in_place_collectives
        gloo_comms.use_in_place_collectives = lambda module: given.append(module) or real(module)
    model = xpar_zoo.parallelize(parity.build_model(parity.tiny_config("qwen3_moe")), xpar_zoo.Mesh(ep=2), **kwargs)
    units = sum(isinstance(m, FSDPModule) for m in model.modules())
    return units, len(given), imported_before or (how in ("gloo", "env") and "xpar_zoo.parallel.gloo_comms" in sys.modules)


def test_every_cpu_unit_gets_the_in_place_collectives_by_default():
    for how in ("default", "in_place"):
        units, given, _ = launch.run(_units_given_in_place, 2, how)
        assert units > 1 and given == units, (how, units, given)


def test_the_switch_keeps_fsdp2s_own_collectives_without_importing_ours():
    for how in ("gloo", "env"):
        units, given, imported = launch.run(_units_given_in_place, 2, how)
        assert units > 1 and given == 0 and not imported, (how, units, given, imported)
