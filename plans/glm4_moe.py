"""GLM-4.5 (glm4_moe): first layers dense, routed experts fused ``[E, 2I, H]`` / ``[E, H, I]`` plus shared experts,
partial rotary embeddings."""

from xpar_zoo.zoo.plan import Plan, embedding, experts, fused_expert_layouts, lm_head

PLAN = Plan(
    model_type="glm4_moe",
    extra={"ep": experts("model.layers.*.mlp.experts"), "emb": embedding(), "head": lm_head()},
    layouts=fused_expert_layouts("model.layers.*.mlp.experts"),
    hub_ids=("zai-org/GLM-4.5-Air", "zai-org/GLM-4.5"),
    tiny=dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=1,
              first_k_dense_replace=1, num_hidden_layers=3, n_group=1, topk_group=1, partial_rotary_factor=0.5),
)
