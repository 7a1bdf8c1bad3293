"""Mixtral: fused experts ``[E, 2I, H]`` / ``[E, H, I]`` in memory; the hub stores
``block_sparse_moe.experts.{j}.w1/w3/w2`` per expert (transformers' conversion rules map them)."""

from xpar_zoo.zoo.plan import Plan, embedding, experts, fused_expert_layouts, lm_head

PLAN = Plan(
    model_type="mixtral",
    extra={"ep": experts("model.layers.*.mlp.experts"), "emb": embedding(), "head": lm_head()},
    layouts=fused_expert_layouts("model.layers.*.mlp.experts"),
    hub_ids=("mistralai/Mixtral-8x7B-v0.1", "mistralai/Mixtral-8x22B-v0.1"),
    tiny=dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=16, output_router_logits=False),
)
