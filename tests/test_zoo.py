"""The zoo: every curated architecture, and the automatic plan on MoE types without one, trains under its plans +
FSDP2 exactly like single-process transformers (4 gloo ranks, fp32, one SGD step).

One 4-rank job runs every architecture on every mesh (processes and imports are shared)."""

import pytest

import xpar_zoo
from xpar_zoo import launch, parity

WORLD = 4
MOE_MESHES = {"fsdp": {}, "ep2": {"ep": 2}, "ep4": {"ep": 4}, "ep2_strided": {"ep": 2, "innermost": {"ep": False}},
              "ep2_emb2_head2": {"ep": 2, "emb": 2, "head": 2}}
DENSE_MESHES = {"fsdp": {}, "emb2": {"emb": 2}, "emb2_head2": {"emb": 2, "head": 2},
                "emb4_head2_strided": {"emb": 4, "head": 2, "innermost": {"head": False}}}
AUTO_MESHES = {"fsdp": {}, "ep2": {"ep": 2}, "ep2_emb2_head2": {"ep": 2, "emb": 2, "head": 2}}
# MoE types with no curated plan: the automatic plan (derived from transformers' base_model_ep_plan) and the
# config overrides of a tiny instance.
AUTO = {
    "dots1": dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=1,
                  first_k_dense_replace=1, n_group=1, topk_group=1, num_hidden_layers=3),
    "ernie4_5_moe": dict(moe_num_experts=8, moe_k=2, moe_intermediate_size=16, moe_layer_start_index=0),
}
CURATED = xpar_zoo.supported_architectures()


def _meshes(arch: str) -> dict:
    if arch in AUTO:
        return AUTO_MESHES
    return MOE_MESHES if "ep" in xpar_zoo.get_plan(arch).extra else DENSE_MESHES


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
    par, ref = row["loss"]
    assert abs(par - ref) < parity.LOSS_TOL, f"{arch} on {mesh}: loss {par} vs single-process {ref}"
    worst = max(row["errors"].items(), key=lambda kv: kv[1])
    assert worst[1] < parity.PARAM_REL_TOL, f"{arch} on {mesh}: {worst[0]} relative error {worst[1]:.2e}"
