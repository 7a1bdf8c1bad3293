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
