"""FSDP2's placement of planned tensors, computed on meta models: dim 0 where the planned slice divides by the FSDP
ranks, else dim 1 (which must divide only where it is used); one module may hold tensors on both dims."""

import pytest

import xpar_zoo
from support.placement_models import DIM1, EMB, EXPERTS, LOW_RANK_PLAN, O_PROJ, WORLD, with_low_rank
from xpar_zoo import get_plan, sizing
from xpar_zoo.parallel.fsdp_layout import fsdp_layout, planned_shard_dim
from xpar_zoo.styles.planned import match_plan
from xpar_zoo.testing import parity


def _layout(cfg, sizes: dict, shard_size: int, plan=None, model=None) -> dict:
    model = model if model is not None else sizing.meta_model(cfg)
    plan = plan or get_plan(cfg.model_type)
    units = fsdp_layout(model, plan, match_plan(model, plan, sizes, shard_size), sizes=sizes, shard_size=shard_size)
    return {u.fqn: u for u in units}


# ---- the decision (no process group) -----------------------------------------------------------------------------
def test_the_rule_is_dim0_where_the_slice_divides():
    assert [planned_shard_dim(rows, fsdp) for rows, fsdp in [(4, 2), (3, 2), (2, 1), (6, 3), (4, 3), (1, 1)]] == \
        [0, 1, 0, 0, 1, 0]


@pytest.mark.parametrize("overrides,sizes,shard_size,experts_dim,vocab_dim", [
    ({}, {"ep": 2, "emb": 2, "head": 2}, 4, 0, 0),         # 4 experts, 64 rows over 2 FSDP ranks
    (DIM1, {"ep": 2, "emb": 2, "head": 2}, 4, 1, 1),       # 3 experts, 63 rows over 2
    (dict(num_experts=6), {"ep": 2}, 6, 0, None),          # 3 experts over 3 FSDP ranks (world 6)
    (dict(num_experts=8), {"ep": 2}, 8, 0, None),          # 4 over 4
    (dict(num_experts=12), {"ep": 2}, 8, 1, None),         # 6 over 4
    ({}, {"ep": 4, "emb": 4}, 4, 0, 0),                    # one FSDP rank: always dim 0
])
def test_each_planned_tensor_is_sharded_on_dim0_where_its_slice_divides(overrides, sizes, shard_size, experts_dim,
                                                                        vocab_dim):
    units = _layout(parity.tiny_config("qwen3_moe", **overrides), sizes, shard_size)
    experts = units[EXPERTS]
    assert experts.kind == "planned" and experts.shard_dims == (experts_dim, experts_dim)
    if vocab_dim is not None:
        assert units["model.embed_tokens"].shard_dim(EMB) == vocab_dim
    assert all(u.shard_dims == () for u in units.values() if u.kind != "planned")  # dense: FSDP2's dim 0


def test_one_module_holds_tensors_on_both_dims():
    cfg = parity.tiny_config("qwen3_moe")
    model = with_low_rank(sizing.meta_model(cfg))
    unit = _layout(cfg, {"lowrank": 2}, WORLD, LOW_RANK_PLAN, model)[O_PROJ]
    assert {p.rpartition(".")[2]: unit.shard_dim(p) for p in unit.params} == {"weight": 0, "down": 1, "up": 0}


def test_dim1_must_divide_only_where_it_is_used():
    """World 6, ep=2: 3 FSDP ranks. 12 experts (6 per slice) go on dim 0, so their dim 1 (2I = 32) need not divide
    by 3; 8 experts (4 per slice) go on dim 1, which must."""
    match_plan(sizing.meta_model(parity.tiny_config("qwen3_moe", num_experts=12)), get_plan("qwen3_moe"),
               {"ep": 2}, 6)
    with pytest.raises(xpar_zoo.PlanError, match=r"has 32 on dim 1 .* not divisible by ep_fsdp=3 .* 4 rows"):
        match_plan(sizing.meta_model(parity.tiny_config("qwen3_moe", num_experts=8)), get_plan("qwen3_moe"),
                   {"ep": 2}, 6)
