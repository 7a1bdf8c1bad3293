"""Qwen2 (dense): vocab-parallel input embedding (``emb``) and output head with vocab-parallel cross-entropy
(``head``), both ``[V, H]`` split on dim 0; everything else plain FSDP2."""

from xpar_zoo.zoo.plan import Plan, embedding, lm_head

PLAN = Plan(
    model_type="qwen2",
    extra={"emb": embedding(), "head": lm_head()},
    layouts={"model.embed_tokens.weight": "[V, H]", "lm_head.weight": "[V, H]"},
    hub_ids=("Qwen/Qwen2.5-7B", "Qwen/Qwen2-7B"),
)
