"""Qwen2-MoE: routed experts fused ``[E, 2I, H]`` / ``[E, H, I]``, plus a dense shared expert and its sigmoid gate
(both stay plain FSDP)."""

from xpar_zoo.zoo.plan import Plan, embedding, experts, fused_expert_layouts, lm_head

PLAN = Plan(
    model_type="qwen2_moe",
    extra={"ep": experts("model.layers.*.mlp.experts"), "emb": embedding(), "head": lm_head()},
    layouts=fused_expert_layouts("model.layers.*.mlp.experts"),
    hub_ids=("Qwen/Qwen1.5-MoE-A2.7B", "Qwen/Qwen2-57B-A14B"),
    tiny=dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24,
              decoder_sparse_step=1, mlp_only_layers=[], output_router_logits=False),
)
