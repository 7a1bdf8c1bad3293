"""The zoo under long context: every proved architecture trains under Ulysses with EP (``sp=2, ep=2``; ``sp=2`` for
a plan without ``ep``) and under context parallelism (``cp=2``) exactly like single-process transformers on the whole
global batch (4 gloo ranks, fp32, one SGD step: loss within 1e-5, every parameter within 1e-4 of its update), every
rank of a sequence group passing the same full-length rows (its ``xpar_zoo.data_shard``); or ``parallelize`` refuses
sp/cp for it with the reason MODEL_CARDS.md quotes. Part of the zoo's shared 4-rank run (``zoo_proofs``)."""

import pytest

import xpar_zoo
from xpar_zoo.commands import model_cards
from xpar_zoo.testing import parity
from xpar_zoo.testing.proofs import PROOF_WORLD as WORLD
from xpar_zoo.testing.proofs import (
    describe_mesh,
    long_context_meshes,
    proved_architectures,
)

PROVED = proved_architectures()


def _arch_job(arch: str) -> dict:
    import torch.distributed as dist
    from transformers.utils import logging

    logging.set_verbosity_error()
    rank = dist.get_rank()
    cfg = parity.tiny_config(arch)
    refusal = model_cards.long_context_refusal(parity.build_model(cfg))
    if refusal is not None:  # then parallelize must refuse it, with that message, on a real mesh
        try:
            xpar_zoo.parallelize(parity.build_model(cfg), xpar_zoo.Mesh(sp=2))
            return {(arch, "refusal"): "no error"}
        except xpar_zoo.XparError as e:
            return {(arch, "refusal"): f"{type(e).__name__}: {e}"}
    out = {}
    data = parity.make_batches(cfg.get_text_config().vocab_size, 1, WORLD, seed=5)
    before = parity.build_model(cfg).state_dict() if rank == 0 else None
    ref = parity.train_reference(cfg, data, "sgd", None) if rank == 0 else None
    for name, mesh_kwargs in long_context_meshes(arch).items():
        rec = parity.train_parallel(cfg, data, mesh_kwargs, "sgd", None)
        if rank == 0:
            out[arch, name] = {"loss": (rec.losses[0], ref.losses[0]),
                               "errors": parity.param_errors(rec.params, ref.params, before)}
    return out


def zoo_jobs(tmp_path_factory) -> dict:
    """This module's part of the zoo's 4-rank run (``zoo_proofs`` in tests/conftest.py): a job per architecture
    (its results keyed ``(arch, …)``), so that one failing fails only its own test."""
    return {arch: (_arch_job, (arch,)) for arch in PROVED}


@pytest.fixture(scope="module")
def results(zoo_proofs):
    return zoo_proofs[__name__]


@pytest.mark.parametrize("arch", PROVED)
def test_long_context_is_proved_or_refused_as_the_card_says(results, arch):
    card = model_cards.card(arch)
    if (arch, "refusal") in results:
        assert results[arch, "refusal"] == f"PlanError: {card.long_context_refused}"
        assert card.long_context == ()
        return
    meshes = long_context_meshes(arch)
    assert card.long_context == tuple(describe_mesh(m) for m in meshes.values()) and card.long_context_refused is None
    for name in meshes:
        row = results[arch, name]
        parity.assert_losses_match([row["loss"][0]], [row["loss"][1]], what=f"{arch} on {name}")
        parity.assert_params_match(row["errors"], what=f"{arch} on {name}:")
