"""The zoo with FSDP2 on dim 1: every architecture of tests/distributed/test_zoo.py (whose meshes leave planned slices
divisible by their FSDP ranks, so FSDP2 shards them on dim 0) also trains exactly like single-process transformers when
its planned slices do not divide and go on dim 1 (:func:`xpar_zoo.testing.proofs.dim1_proof`: 6 experts, 130 vocab rows,
its plans at size 2 on 4 gloo ranks, fp32, one SGD step). One 4-rank run holds them all (a job per architecture), with
the one of tests/distributed/test_zoo.py (``zoo_proofs`` in tests/conftest.py)."""

import pytest

from xpar_zoo.testing import modality, parity
from xpar_zoo.testing.proofs import (
    AUTO_PROVED,
    PROOF_WORLD,
    dim1_proof,
    proved_architectures,
)

ARCHS = proved_architectures()



def _job(arch: str) -> dict:
    import torch.distributed as dist

    rank = dist.get_rank()
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
    if rank != 0:
        return {}
    return {arch: {"loss": (rec.losses[0], ref.losses[0]), "norm": (rec.grad_norms, ref.grad_norms),
                   "errors": parity.param_errors(rec.params, ref.params, before)}}


def zoo_jobs(tmp_path_factory) -> dict:
    """This module's part of the zoo's 4-rank run (``zoo_proofs`` in tests/conftest.py): a job per architecture."""
    return {arch: (_job, (arch,)) for arch in ARCHS}


@pytest.fixture(scope="module")
def results(zoo_proofs):
    return zoo_proofs[__name__]


@pytest.mark.parametrize("arch", ARCHS)
def test_architecture_on_dim1_matches_single_process(results, arch):
    row = results[arch]
    parity.assert_losses_match([row["loss"][0]], [row["loss"][1]], what=f"{arch} on dim 1")
    parity.assert_norms_match(*row["norm"], what=f"{arch} on dim 1")
    parity.assert_params_match(row["errors"], what=f"{arch} on dim 1:")
