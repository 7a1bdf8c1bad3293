"""OLMoE: fused experts ``[E, 2I, H]`` / ``[E, H, I]``; q/k norms in attention."""

from xpar_zoo.zoo.plan import Plan, embedding, experts, fused_expert_layouts, lm_head

PLAN = Plan(
    model_type="olmoe",
    extra={"ep": experts("model.layers.*.mlp.experts"), "emb": embedding(), "head": lm_head()},
    layouts=fused_expert_layouts("model.layers.*.mlp.experts"),
    hub_ids=("allenai/OLMoE-1B-7B-0924",),
    tiny=dict(num_experts=8, num_experts_per_tok=2, intermediate_size=16, eos_token_id=1, pad_token_id=0,
              output_router_logits=False),
)
