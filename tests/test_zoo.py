"""The zoo: every curated architecture, and the automatic plan on MoE types without one, trains under its plans +
FSDP2 exactly like single-process transformers (4 gloo ranks, fp32, one SGD step).

One 4-rank job runs every architecture on every mesh (processes and imports are shared)."""

import pytest

import xpar_zoo
from xpar_zoo.testing import launch, parity

from xpar_zoo.testing.proofs import AUTO_PROVED as AUTO
from xpar_zoo.testing.proofs import PROOF_WORLD as WORLD
from xpar_zoo.testing.proofs import proof_meshes as _meshes

CURATED = xpar_zoo.supported_architectures()


CASES = [(a, m) for a in CURATED + list(AUTO) for m in _meshes(a)]


def _job(archs: list) -> dict:
    import torch.distributed as dist

    rank = dist.get_rank()
    out = {}
    for arch in archs:
        cfg = parity.tiny_config(arch, **AUTO.get(arch, {}))
        data = parity.make_batches(cfg.vocab_size, 1, WORLD, seed=5)
        before = parity.build_model(cfg).state_dict() if rank == 0 else None
        ref = parity.train_reference(cfg, data, "sgd", None) if rank == 0 else None
        for name, mesh_kwargs in _meshes(arch).items():
            rec = parity.train_parallel(cfg, data, mesh_kwargs, "sgd", None)
            if rank == 0:
                out[arch, name] = {"loss": (rec.losses[0], ref.losses[0]),
                                   "errors": parity.param_errors(rec.params, ref.params, before)}
    return out


@pytest.fixture(scope="module")
def results():
    return launch.run(_job, WORLD, CURATED + list(AUTO), timeout_s=900)


def test_the_zoo_has_at_least_12_curated_architectures():
    assert len(CURATED) >= 12
    assert all(not xpar_zoo.get_plan(a).auto for a in CURATED)
    assert all(xpar_zoo.get_plan(a).auto for a in AUTO)


@pytest.mark.parametrize("arch,mesh", CASES)
def test_architecture_matches_single_process(results, arch, mesh):
    row = results[arch, mesh]
    parity.assert_losses_match([row["loss"][0]], [row["loss"][1]], what=f"{arch} on {mesh}")
    parity.assert_params_match(row["errors"], what=f"{arch} on {mesh}:")
