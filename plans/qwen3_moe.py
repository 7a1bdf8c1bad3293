"""Qwen3-MoE: fused experts ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``; hub keys per expert."""

from xpar_zoo.zoo.plan import Plan, embedding, experts, fused_expert_layouts, lm_head

PLAN = Plan(
    model_type="qwen3_moe",
    extra={"ep": experts("model.layers.*.mlp.experts"), "emb": embedding(), "head": lm_head()},
    layouts=fused_expert_layouts("model.layers.*.mlp.experts"),
    hub_ids=("Qwen/Qwen3-30B-A3B", "Qwen/Qwen3-235B-A22B"),
    tiny=dict(moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1,
              mlp_only_layers=[], norm_topk_prob=True, output_router_logits=False),
)
