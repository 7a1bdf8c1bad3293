"""Every mesh trains qwen3_moe exactly like single-process transformers (4 gloo ranks, fp32): one SGD(lr=1) step on
each mesh and three clipped AdamW steps on some, on labels whose valid targets differ per rank (one rank has none in
the first step); the planned shards hold E/ep experts or V/size vocab rows on dim 0, which FSDP splits again on dim 0.

Meshes: FSDP, EP (consecutive and strided groups, HSDP), vocab plans (emb, head, both, with EP, mixed placements)
and user-named ``gathered`` plans. One spawned 4-rank job runs them all."""

import pytest

from xpar_zoo.testing import parity

WORLD = 4
MESHES = {
    "fsdp": {},
    "ep2": {"ep": 2},
    "ep4": {"ep": 4},
    "ep2_strided": {"ep": 2, "innermost": {"ep": False}},
    "ep2_replicate2": {"ep": 2, "replicate": 2},
    "emb2": {"emb": 2},
    "emb4": {"emb": 4},
    "head2": {"head": 2},
    "ep2_emb2": {"ep": 2, "emb": 2},
    "ep2_emb2_head2": {"ep": 2, "emb": 2, "head": 2},
    "emb4_head4": {"emb": 4, "head": 4},
    "mixed_placement": {"ep": 2, "emb": 2, "head": 2, "innermost": {"ep": True, "emb": False, "head": False}},
    "user_plans": {"extra": {"ep": 2, "extra_parallel_1": 2, "extra_parallel_2": 4},
                   "innermost": {"extra_parallel_1": False}},
}
ADAMW_MESHES = ("ep2", "ep4", "ep2_replicate2", "ep2_emb2_head2", "user_plans")
EXPERTS = "model.layers.0.mlp.experts"
EMB, HEAD = "model.embed_tokens.weight", "lm_head.weight"
O_PROJ, Q_PROJ = "model.layers.0.self_attn.o_proj.weight", "model.layers.0.self_attn.q_proj.weight"


def _user_plan():
    from xpar_zoo import ExtraPlan, get_plan

    return (get_plan("qwen3_moe")
            .with_extra("extra_parallel_1", ExtraPlan(params=("model.layers.*.self_attn.o_proj.weight",),
                                                      style="gathered"))
            .with_extra("extra_parallel_2", ExtraPlan(("model.layers.*.self_attn.q_proj.weight",), "gathered")))


def _job() -> dict:
    return parity.compare_meshes(parity.tiny_config("qwen3_moe"), WORLD, MESHES, ADAMW_MESHES,
                                 plans={"user_plans": _user_plan()})


def zoo_job(tmp_path_factory) -> tuple:
    """This module's job in the zoo's one 4-rank run (``zoo_proofs`` in tests/conftest.py), which runs beside the
    other tests."""
    return _job, ()


@pytest.fixture(scope="module")
def results(zoo_proofs):
    return zoo_proofs[__name__]


@pytest.mark.parametrize("mesh", list(MESHES))
def test_sgd_step_matches_single_process(results, mesh):
    row = results[mesh]
    parity.assert_losses_match(*row["loss"], what=mesh)
    parity.assert_params_match(row["errors"], what=f"{mesh}, one SGD step:")


@pytest.mark.parametrize("mesh", list(MESHES))
def test_grad_norm_over_all_plans_matches_single_process(results, mesh):
    parity.assert_norms_match(*results[mesh]["norm"], what=mesh)


@pytest.mark.parametrize("mesh", ADAMW_MESHES)
def test_three_clipped_adamw_steps_match_single_process(results, mesh):
    row = results[mesh]
    parity.assert_losses_match(*row["adamw_loss"], what=mesh)
    parity.assert_norms_match(*row["adamw_norm"], what=mesh)
    parity.assert_params_match(row["adamw_errors"], what=f"{mesh}, 3 AdamW steps:")


@pytest.mark.parametrize("mesh,experts", [("ep2", 2), ("ep4", 2), ("ep2_strided", 2), ("ep2_replicate2", 4)])
def test_expert_shards_hold_E_over_ep_split_again_on_dim0_by_fsdp(results, mesh, experts):
    """8 experts: ep=2 keeps 4 per rank, which FSDP splits over its 2 ranks on dim 0 (1 rank with ep=4 or HSDP);
    tests/distributed/test_fsdp_placement.py proves dim 1 where they do not divide."""
    cfg = parity.tiny_config("qwen3_moe")
    local = results[mesh]["local"]
    assert local[f"{EXPERTS}.gate_up_proj"] == (experts, 2 * cfg.moe_intermediate_size, cfg.hidden_size)
    assert local[f"{EXPERTS}.down_proj"] == (experts, cfg.hidden_size, cfg.moe_intermediate_size)


@pytest.mark.parametrize("mesh,param,rows", [
    ("emb2", EMB, 32), ("emb4", EMB, 32), ("ep2_emb2", EMB, 32), ("head2", HEAD, 32),
    ("ep2_emb2_head2", HEAD, 32), ("emb4_head4", HEAD, 32), ("mixed_placement", EMB, 32),
    ("user_plans", O_PROJ, 8), ("user_plans", Q_PROJ, 8)])
def test_planned_vocab_and_user_shards_hold_rows_over_size_split_again_on_dim0_by_fsdp(results, mesh, param, rows):
    cfg = parity.tiny_config("qwen3_moe")
    assert results[mesh]["local"][param] == (rows, cfg.hidden_size)
