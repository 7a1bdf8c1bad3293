"""gpt-oss: experts stored *transposed* ``gate_up_proj [E, H, 2I]`` with gate/up *interleaved* on the last dim,
``down_proj [E, I, H]``, and per-expert biases ``[E, 2I]`` / ``[E, H]`` — all split on dim 0 by EP. The hub stores
them fused already (MXFP4 blocks/scales on the official checkpoints)."""

from xpar_zoo.zoo.plan import Plan, embedding, experts, lm_head

PLAN = Plan(
    model_type="gpt_oss",
    extra={"ep": experts("model.layers.*.mlp.experts", "gate_up_proj", "gate_up_proj_bias", "down_proj",
                         "down_proj_bias"), "emb": embedding(), "head": lm_head()},
    layouts={
        "model.layers.*.mlp.experts.gate_up_proj": "[E, H, 2I] interleaved",
        "model.layers.*.mlp.experts.gate_up_proj_bias": "[E, 2I] interleaved",
        "model.layers.*.mlp.experts.down_proj": "[E, I, H]",
        "model.layers.*.mlp.experts.down_proj_bias": "[E, H]",
    },
    hub_ids=("openai/gpt-oss-20b", "openai/gpt-oss-120b"),
    tiny=dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=16, sliding_window=8,
              layer_types=["sliding_attention", "full_attention"], output_router_logits=False),
)
