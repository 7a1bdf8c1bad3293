"""Core: qwen3_moe trains under EP + FSDP2 (dim 1) exactly like single-process transformers (4 gloo ranks, fp32)."""

import pytest

from xpar_zoo import launch, parity

WORLD = 4
MESHES = {
    "fsdp": {},
    "ep2": {"ep": 2},
    "ep4": {"ep": 4},
    "ep2_strided": {"ep": 2, "innermost": {"ep": False}},
    "ep2_replicate2": {"ep": 2, "replicate": 2},
}
ADAMW_MESHES = ("ep2", "ep4", "ep2_replicate2")
EXPERTS = "model.layers.0.mlp.experts"


def _job(meshes: dict, adamw_meshes: tuple) -> dict:
    """Every rank: SGD(lr=1) one step on each mesh, then 3 clipped AdamW steps; rank 0 compares with the reference."""
    return parity.compare_meshes(parity.tiny_config("qwen3_moe"), WORLD, meshes, adamw_meshes)


@pytest.fixture(scope="module")
def results():
    return launch.run(_job, WORLD, MESHES, ADAMW_MESHES)


@pytest.mark.parametrize("mesh", list(MESHES))
def test_sgd_step_matches_single_process(results, mesh):
    row = results[mesh]
    parity.assert_losses_match(*row["loss"], what=mesh)
    parity.assert_params_match(row["errors"], what=f"{mesh}, one SGD step:")


@pytest.mark.parametrize("mesh", list(MESHES))
def test_grad_norm_matches_single_process(results, mesh):
    parity.assert_norms_match(*results[mesh]["norm"], what=mesh)


@pytest.mark.parametrize("mesh", ADAMW_MESHES)
def test_three_clipped_adamw_steps_match_single_process(results, mesh):
    row = results[mesh]
    parity.assert_losses_match(*row["adamw_loss"], what=mesh)
    parity.assert_norms_match(*row["adamw_norm"], what=mesh)
    parity.assert_params_match(row["adamw_errors"], what=f"{mesh}, 3 AdamW steps:")


@pytest.mark.parametrize("mesh,experts_dim0,fsdp_dim1", [
    ("ep2", 4, 2), ("ep4", 2, 1), ("ep2_strided", 4, 2), ("ep2_replicate2", 4, 1)])
def test_expert_shards_hold_E_over_ep_on_dim0_and_fsdp_on_dim1(results, mesh, experts_dim0, fsdp_dim1):
    cfg = parity.tiny_config("qwen3_moe")
    local = results[mesh]["local"]
    assert local[f"{EXPERTS}.gate_up_proj"] == (experts_dim0, 2 * cfg.moe_intermediate_size // fsdp_dim1,
                                                cfg.hidden_size)
    assert local[f"{EXPERTS}.down_proj"] == (experts_dim0, cfg.hidden_size // fsdp_dim1, cfg.moe_intermediate_size)


def _mixed_precision_job() -> dict:
    """Mesh(ep=2) with bf16 parameters and fp32 reduction: one step's loss against the fp32 reference."""
    import torch.distributed as dist

    import xpar_zoo

    cfg = parity.tiny_config("qwen3_moe")
    data = parity.make_batches(cfg.vocab_size, 1, WORLD, seed=1)
    model = xpar_zoo.parallelize(parity.build_model(cfg), xpar_zoo.Mesh(ep=2), mixed_precision=True)
    ids = data[0, dist.get_rank()]
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grad = model.model.layers[0].mlp.experts.gate_up_proj.grad
    dist.all_reduce(loss := loss.detach().float())
    ref = parity.train_reference(cfg, data, "sgd", None).losses[0] if dist.get_rank() == 0 else None
    return {"loss": loss.item() / WORLD, "ref": ref, "grad_dtype": str(grad.dtype),
            "param_dtype": str(model.model.layers[0].mlp.experts.gate_up_proj.dtype)}


def test_mixed_precision_bf16_params_fp32_reduce_trains_close_to_fp32():
    row = launch.run(_mixed_precision_job, WORLD)
    assert row["param_dtype"] == "torch.float32" and row["grad_dtype"] == "torch.float32"  # sharded fp32 masters
    assert abs(row["loss"] - row["ref"]) < 2e-2, row
