"""The zoo proves both FSDP2 placements of planned slices: its own meshes shard them on dim 0, the dim-1 proof on dim 1
(computed on meta models)."""

import pytest

from xpar_zoo.parallel.fsdp_layout import fsdp_layout
from xpar_zoo.styles.planned import match_plan
from xpar_zoo.testing import parity
from xpar_zoo.testing.proofs import (
    PROOF_WORLD,
    dim1_proof,
    proof_meshes,
    proved_architectures,
)
from xpar_zoo.zoo.registry import plan_for

ARCHS = proved_architectures()


def _placements(arch: str, mesh: dict, overrides: dict) -> set[tuple[int, int]]:
    """``(dim, FSDP ranks)`` of every planned tensor of ``arch`` under ``mesh`` (the layout on a meta model)."""
    from xpar_zoo import sizing

    model = sizing.meta_model(parity.tiny_config(arch, **overrides))
    plan = plan_for(model)
    sizes = {k: v for k, v in mesh.items() if k not in ("innermost", "replicate") and v > 1}
    units = fsdp_layout(model, plan, match_plan(model, plan, sizes, PROOF_WORLD), sizes=sizes, shard_size=PROOF_WORLD)
    return {(d, PROOF_WORLD // sizes[u.plan_name]) for u in units if u.kind == "planned" for d in u.shard_dims}


@pytest.mark.parametrize("arch", ARCHS)
def test_the_zoo_proves_both_placements(arch):
    """The zoo's own meshes shard planned slices on dim 0 (over 2 FSDP ranks on some), the dim-1 proof on dim 1."""
    zoo = set().union(*(_placements(arch, mesh, {}) for mesh in proof_meshes(arch).values()))
    assert {d for d, _ in zoo} == {0} and (0, 2) in zoo, zoo
    assert _placements(arch, *dim1_proof(arch)) == {(1, 2)}
