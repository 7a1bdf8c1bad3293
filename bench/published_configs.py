"""The published hyperparameters of the models in the sizing matrix (issue 41), as data: each a transformers config
class's arguments, copied from the model's ``config.json`` on the hub (no hub access needed). ``config(name)`` builds
the config; ``write(name, directory)`` saves it as a local model directory that ``xpar-zoo size`` takes."""

from __future__ import annotations

from pathlib import Path

PUBLISHED = {
    "Qwen3-30B-A3B": ("qwen3_moe", {
        "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
        "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
        "vocab_size": 151936, "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
        "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "tie_word_embeddings": False}),
    "Qwen3-235B-A22B": ("qwen3_moe", {
        "hidden_size": 4096, "intermediate_size": 12288, "moe_intermediate_size": 1536, "num_hidden_layers": 94,
        "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
        "vocab_size": 151936, "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
        "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "tie_word_embeddings": False}),
    "DeepSeek-V3": ("deepseek_v3", {
        "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
        "first_k_dense_replace": 3, "num_attention_heads": 128, "num_key_value_heads": 128, "n_routed_experts": 256,
        "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5,
        "norm_topk_prob": True, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "vocab_size": 129280, "max_position_embeddings": 163840, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False}),
    "gpt-oss-120b": ("gpt_oss", {
        "hidden_size": 2880, "intermediate_size": 2880, "num_hidden_layers": 36, "num_attention_heads": 64,
        "num_key_value_heads": 8, "head_dim": 64, "num_local_experts": 128, "num_experts_per_tok": 4, "vocab_size": 201088,
        "sliding_window": 128, "layer_types": ["sliding_attention", "full_attention"] * 18, "swiglu_limit": 7.0,
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}),
}


def config(name: str, layers: int | None = None):
    """The transformers config of the published model ``name`` (a key of :data:`PUBLISHED`); with ``layers``, cut to
    that many decoder layers (the first of ``layer_types``; DeepSeek keeps up to its 3 dense first layers, at least
    one MoE layer after them)."""
    from transformers import AutoConfig

    model_type, kwargs = PUBLISHED[name]
    if layers:
        kwargs = {**kwargs, "num_hidden_layers": layers}
        if "layer_types" in kwargs:
            kwargs["layer_types"] = kwargs["layer_types"][:layers]
        if "first_k_dense_replace" in kwargs:
            kwargs["first_k_dense_replace"] = min(kwargs["first_k_dense_replace"], layers - 1)
    return AutoConfig.for_model(model_type, **kwargs)


def write(name: str, directory: str | Path, layers: int | None = None) -> Path:
    """``config(name, layers)`` saved as ``directory/config.json``; returns the directory."""
    path = Path(directory)
    config(name, layers).save_pretrained(path)
    return path
