"""The Triton experts kernels (under Triton's interpreter on the CPU) on a 2-rank mesh train exactly like single-process
training."""

import pytest

pytest.importorskip("triton")  # conftest.py sets TRITON_INTERPRET=1: the kernels run on the CPU

# Triton's interpreter converts 1-element arrays to scalars, which NumPy deprecates (and 2.4 refuses: hence the pin).
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

from xpar_zoo.testing import launch, parity

MESHES = {"fsdp": {}, "ep2": {"ep": 2}}  # every expert local (the fused path), and split over 2 ranks


def _mesh_job(cfg, data):
    import torch.distributed as dist

    ref = parity.train_reference(cfg, data, "sgd", None) if dist.get_rank() == 0 else None
    before = parity.build_model(cfg).state_dict()
    out = {}
    for name, mesh in MESHES.items():
        rec = parity.train_parallel(cfg, data, mesh, "sgd", None, kernels="triton")
        if dist.get_rank() == 0:
            out[name] = rec.losses, ref.losses, parity.param_errors(rec.params, ref.params, before)
    return out


@pytest.fixture(scope="module")
def mesh_runs():
    cfg = parity.tiny_config("qwen3_moe")
    return launch.run(_mesh_job, 2, cfg, parity.make_batches(cfg.vocab_size, steps=1, world=2))


@pytest.mark.parametrize("mesh", list(MESHES))
def test_triton_kernels_on_a_mesh_match_single_process_training(mesh_runs, mesh):
    losses, ref_losses, errors = mesh_runs[mesh]
    parity.assert_losses_match(losses, ref_losses, what=f"{mesh}, triton")
    parity.assert_params_match(errors, what=f"{mesh}, triton, one SGD step:")
