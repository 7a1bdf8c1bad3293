"""What the zoo's parity tests prove: the meshes each architecture is trained on (4 ranks) and the tiny configs of
the MoE types proved through the automatic plan. One source of truth for tests/test_zoo.py and MODEL_CARDS.md."""

from __future__ import annotations

from ..registry import get_plan

PROOF_WORLD = 4

MOE_MESHES: dict[str, dict] = {
    "fsdp": {}, "ep2": {"ep": 2}, "ep4": {"ep": 4}, "ep2_strided": {"ep": 2, "innermost": {"ep": False}},
    "ep2_emb2_head2": {"ep": 2, "emb": 2, "head": 2},
}
DENSE_MESHES: dict[str, dict] = {
    "fsdp": {}, "emb2": {"emb": 2}, "emb2_head2": {"emb": 2, "head": 2},
    "emb4_head2_strided": {"emb": 4, "head": 2, "innermost": {"head": False}},
}
AUTO_MESHES: dict[str, dict] = {"fsdp": {}, "ep2": {"ep": 2}, "ep2_emb2_head2": {"ep": 2, "emb": 2, "head": 2}}

# MoE types without a curated plan, proved through the automatic plan: tiny config overrides.
AUTO_PROVED: dict[str, dict] = {
    "dots1": dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=1,
                  first_k_dense_replace=1, n_group=1, topk_group=1, num_hidden_layers=3),
    "ernie4_5_moe": dict(moe_num_experts=8, moe_k=2, moe_intermediate_size=16, moe_layer_start_index=0),
}


# The meshes above leave every planned slice divisible by its FSDP ranks (8 experts, 128 vocab rows), so FSDP2 shards
# it on dim 0. Each type is also proved with FSDP2 on dim 1 (tests/test_zoo_placement.py): its tiny config with 6
# experts and 126 vocab rows (slices of 3 experts and 63 rows over 2 FSDP ranks) on its plans of size 2.
DIM1_OVERRIDES: dict[str, int] = {"vocab_size": 126}
DIM1_EXPERTS = 6
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def dim1_proof(model_type: str) -> tuple[dict, dict]:
    """``(Mesh kwargs, tiny config overrides)`` under which FSDP2 shards every planned tensor of ``model_type`` on
    dim 1 (their slices' dim 0 does not divide by their 2 FSDP ranks)."""
    plan = get_plan(model_type)
    tiny = {**plan.tiny, **AUTO_PROVED.get(model_type, {})}
    overrides = {**tiny, **DIM1_OVERRIDES, **{k: DIM1_EXPERTS for k in EXPERT_COUNT_KEYS if k in tiny}}
    return {name: 2 for name in ("ep", "emb", "head") if name in plan.extra}, overrides


def proof_meshes(model_type: str) -> dict[str, dict]:
    """``{mesh name: Mesh kwargs}`` that tests/test_zoo.py proves for ``model_type``."""
    plan = get_plan(model_type)
    if plan.auto:
        return AUTO_MESHES
    return MOE_MESHES if "ep" in plan.extra else DENSE_MESHES


def describe_mesh(kwargs: dict) -> str:
    """``Mesh(ep=2, emb=2, innermost={'ep': False})`` → ``ep=2 emb=2 (ep strided)``."""
    sizes = {k: v for k, v in kwargs.items() if k not in ("innermost", "replicate")}
    text = " ".join(f"{k}={v}" for k, v in sizes.items()) or "FSDP only"
    strided = [k for k, v in kwargs.get("innermost", {}).items() if not v]
    if strided:
        text += f" ({', '.join(strided)} strided)"
    return text
