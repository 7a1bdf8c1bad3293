"""Qwen3-MoE: fused experts ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``; hub keys per expert."""

from xpar_zoo.plan import Plan, experts

PLAN = Plan(
    model_type="qwen3_moe",
    extra={"ep": experts("model.layers.*.mlp.experts")},
    layouts={
        "model.layers.*.mlp.experts.gate_up_proj": "[E, 2I, H]",
        "model.layers.*.mlp.experts.down_proj": "[E, H, I]",
    },
    hub_ids=("Qwen/Qwen3-30B-A3B", "Qwen/Qwen3-235B-A22B"),
)
