"""DeepSeek-V2: MLA attention, routed experts fused ``[E, 2I, H]`` / ``[E, H, I]`` plus shared experts (plain
FSDP), group-limited greedy routing."""

from xpar_zoo.zoo.plan import Plan, embedding, experts, fused_expert_layouts, lm_head

PLAN = Plan(
    model_type="deepseek_v2",
    extra={"ep": experts("model.layers.*.mlp.experts"), "emb": embedding(), "head": lm_head()},
    layouts=fused_expert_layouts("model.layers.*.mlp.experts"),
    hub_ids=("deepseek-ai/DeepSeek-V2-Lite", "deepseek-ai/DeepSeek-V2"),
    tiny=dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=1,
              first_k_dense_replace=1, num_hidden_layers=3, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
              qk_nope_head_dim=8, v_head_dim=8, n_group=2, topk_group=1, num_key_value_heads=4),
)
