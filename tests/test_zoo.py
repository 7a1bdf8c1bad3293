"""The zoo: every curated MoE architecture trains under EP + FSDP2 exactly like single-process transformers.

One 4-rank job runs every architecture on every mesh (processes and imports are shared)."""

import pytest

import xpar_zoo
from xpar_zoo import launch, parity

WORLD = 4
MESHES = {"fsdp": {}, "ep2": {"ep": 2}, "ep4": {"ep": 4}, "ep2_strided": {"ep": 2, "innermost": {"ep": False}}}
MOE = [m for m in xpar_zoo.supported_architectures() if "ep" in xpar_zoo.get_plan(m).extra]


def _job(archs: list, meshes: dict) -> dict:
    import torch.distributed as dist

    rank = dist.get_rank()
    out = {}
    for arch in archs:
        cfg = parity.tiny_config(arch)
        data = parity.make_batches(cfg.vocab_size, 1, WORLD, seed=5)
        before = parity.build_model(cfg).state_dict() if rank == 0 else None
        ref = parity.train_reference(cfg, data, "sgd", None) if rank == 0 else None
        for name, mesh_kwargs in meshes.items():
            rec = parity.train_parallel(cfg, data, mesh_kwargs, "sgd", None)
            if rank == 0:
                out[arch, name] = {"loss": (rec.losses[0], ref.losses[0]),
                                   "errors": parity.param_errors(rec.params, ref.params, before)}
    return out


@pytest.fixture(scope="module")
def results():
    return launch.run(_job, WORLD, MOE, MESHES, timeout_s=600)


@pytest.mark.parametrize("mesh", list(MESHES))
@pytest.mark.parametrize("arch", MOE)
def test_architecture_matches_single_process(results, arch, mesh):
    row = results[arch, mesh]
    par, ref = row["loss"]
    assert abs(par - ref) < parity.LOSS_TOL, f"{arch} on {mesh}: loss {par} vs single-process {ref}"
    worst = max(row["errors"].items(), key=lambda kv: kv[1])
    assert worst[1] < parity.PARAM_REL_TOL, f"{arch} on {mesh}: {worst[0]} relative error {worst[1]:.2e}"
