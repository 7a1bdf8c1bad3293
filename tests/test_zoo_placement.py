"""The zoo with FSDP2 on dim 1: every architecture of tests/test_zoo.py (whose meshes leave planned slices divisible
by their FSDP ranks, so FSDP2 shards them on dim 0) also trains exactly like single-process transformers when its
planned slices do not divide and go on dim 1 (:func:`xpar_zoo.zoo.proofs.dim1_proof`: 6 experts, 130 vocab
rows, its plans at size 2 on 4 gloo ranks, fp32, one SGD step). One 4-rank job runs them all, the
one of tests/test_zoo.py (``zoo_proofs`` in tests/conftest.py)."""

import pytest

from xpar_zoo.parallel.fsdp_layout import fsdp_layout
from xpar_zoo.parallelize import match_plan
from xpar_zoo.zoo.registry import plan_for
from xpar_zoo.testing import modality, parity
from xpar_zoo.zoo.proofs import AUTO_PROVED, PROOF_WORLD, dim1_proof, proof_meshes, proved_architectures

ARCHS = proved_architectures()


def _placements(arch: str, mesh: dict, overrides: dict) -> set[tuple[int, int]]:
    """``(dim, FSDP ranks)`` of every planned tensor of ``arch`` under ``mesh`` (the layout on a meta model)."""
    from xpar_zoo.commands import sizing

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


def _job(archs: list) -> dict:
    import torch.distributed as dist

    rank = dist.get_rank()
    out = {}
    for arch in archs:
        mesh, overrides = dim1_proof(arch)
        cfg = parity.tiny_config(arch, **overrides)
        inputs = AUTO_PROVED[arch].inputs if arch in AUTO_PROVED else "text"
        if inputs != "text":
            ids, images = modality.batches(inputs, cfg, PROOF_WORLD)
            data, extra = ids[None], [images]
        else:
            data, extra = parity.make_batches(cfg.get_text_config().vocab_size, 1, PROOF_WORLD, seed=5), None
        before = parity.build_model(cfg).state_dict() if rank == 0 else None
        ref = parity.train_reference(cfg, data, "sgd", None, extra=extra) if rank == 0 else None
        rec = parity.train_parallel(cfg, data, mesh, "sgd", None, extra=extra)
        if rank == 0:
            out[arch] = {"loss": (rec.losses[0], ref.losses[0]), "norm": (rec.grad_norms, ref.grad_norms),
                         "errors": parity.param_errors(rec.params, ref.params, before)}
    return out


def zoo_job(tmp_path_factory) -> tuple:
    """This module's part of the zoo's 4-rank job (``zoo_proofs`` in tests/conftest.py): ``(fn, args)``."""
    return _job, (ARCHS,)


@pytest.fixture(scope="module")
def results(zoo_proofs):
    return zoo_proofs[__name__]


@pytest.mark.parametrize("arch", ARCHS)
def test_architecture_on_dim1_matches_single_process(results, arch):
    row = results[arch]
    parity.assert_losses_match([row["loss"][0]], [row["loss"][1]], what=f"{arch} on dim 1")
    parity.assert_norms_match(*row["norm"], what=f"{arch} on dim 1")
    parity.assert_params_match(row["errors"], what=f"{arch} on dim 1:")
