"""What the zoo's parity tests prove: the meshes each architecture is trained on (4 ranks), the tiny configs of the
types proved through the automatic plan, and which transformers MoE families exist at all. One source of truth for
tests/distributed/test_zoo*.py and MODEL_CARDS.md.

An automatic-plan type is proved on FSDP, ``ep=2`` and ``ep=2, emb=2, head=2``; a plan that ``parallelize`` refuses
for the type (its :attr:`Proof.without`, e.g. ``head`` for a model that softcaps its logits) is left out of the
meshes, and the test proves the refusal and its message instead.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from types import MappingProxyType

import torch
from torch import nn

from ..compat import from_config
from ..zoo.registry import curated_plans, model_class, supported_architectures

# Special token ids of the tiny multimodal configs (inside their 128-token vocab; the text tokens stay below them).
IMAGE_TOKENS = dict(image_token_id=120, video_token_id=121, vision_start_token_id=122, vision_end_token_id=123)
_IMAGE = IMAGE_TOKENS

PROOF_WORLD = 4

MOE_MESHES: dict[str, dict] = {
    "fsdp": {}, "ep2": {"ep": 2}, "ep4": {"ep": 4}, "ep2_strided": {"ep": 2, "innermost": {"ep": False}},
    "ep2_emb2_head2": {"ep": 2, "emb": 2, "head": 2},
}
DENSE_MESHES: dict[str, dict] = {
    "fsdp": {}, "emb2": {"emb": 2}, "emb2_head2": {"emb": 2, "head": 2},
    "emb4_head2_strided": {"emb": 4, "head": 2, "innermost": {"head": False}},
}
AUTO_MESHES: dict[str, dict] = {"fsdp": {}, "ep2": {"ep": 2}, "ep2_emb2_head2": {"ep": 2, "emb": 2, "head": 2}}
# Long context (tests/distributed/test_zoo_long_context.py): Ulysses with EP drawing from the same ranks, and context
# parallelism; a type without an ``ep`` plan proves sp alone.
LONG_CONTEXT_MESHES: dict[str, dict] = {"sp2_ep2": {"sp": 2, "ep": 2}, "cp2": {"cp": 2}}
LONG_CONTEXT_DENSE_MESHES: dict[str, dict] = {"sp2": {"sp": 2}, "cp2": {"cp": 2}}


@dataclass(frozen=True)
class Proof:
    """How the zoo proves one automatic-plan type: ``tiny`` config overrides (sub-config dicts for a composite
    config), the plans ``parallelize`` refuses for it (``without``: plan name → a fragment of the refusal's message),
    the inputs it trains on (``text``: token ids; a key of :data:`xpar_zoo.testing.modality.INPUTS`: token ids
    with image placeholders and the pixel inputs of the tiny vision tower) and a note for its card."""

    tiny: Mapping[str, object]
    without: Mapping[str, str] = field(default_factory=dict)
    inputs: str = "text"
    note: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "tiny", MappingProxyType(dict(self.tiny)))
        object.__setattr__(self, "without", MappingProxyType(dict(self.without)))


# Shared fragments of tiny configs: 8 experts, top-2; MLA attention; DeepSeek-style routing.
_MLA = dict(q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
            num_key_value_heads=4)
_DS = dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=1,
           num_hidden_layers=3, n_group=1, topk_group=1)
_DENSE_FIRST = dict(mlp_layer_types=["dense", "sparse", "sparse"])
_INDEXER = dict(index_head_dim=8, index_n_heads=2)
_GATED_DELTA = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16,
                    num_hidden_layers=3, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
                    linear_num_value_heads=4, layer_types=["linear_attention", "full_attention", "linear_attention"])
_QWEN_VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=4, out_hidden_size=32,
                    num_position_embeddings=16)
_MROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]}
_INKLING = dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, num_hidden_layers=3,
                swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=8, sliding_window_size=4,
                layer_types=None)
_INKLING2 = dict(_INKLING, unpadded_vocab_size=128, n_layers_per_attn_res_block=1)
_INKLING2_LOOP = dict(_INKLING2, loop_layer_index_start=1, loop_layer_index_end=2, loop_num_passes=2, loop_gate_rank=4)
_INKLING2_VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, patch_size=4,
                        posemb_grid_size=4, projection_hidden_dim=32, text_hidden_size=32)
_DOTS3 = dict(_DS, **_MLA, **_INDEXER, **_DENSE_FIRST, pad_token_id=0, head_dim=16, shared_experts_intermediate_size=16,
              swa_num_attention_heads=4, swa_num_key_value_heads=4, swa_q_lora_rank=16, swa_kv_lora_rank=16,
              swa_head_dim=16, swa_qk_nope_head_dim=8, swa_v_head_dim=8, sliding_window=4)
_GEMMA4 = dict(enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=16, sliding_window=4,
               layer_types=None, hidden_size_per_layer_input=8, vocab_size_per_layer_input=128)
_MINIMAX_M3 = dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=16, dense_intermediate_size=32,
                   shared_intermediate_size=16, rotary_dim=4, index_n_heads=2, index_head_dim=8, index_block_size=4,
                   index_topk_blocks=2, layer_types=["minimax_m3_sparse", "full_attention"], mlp_layer_types=None)
_QWEN4 = dict(_GATED_DELTA, hc_lowrank=4, indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=8,
              indexer_budget=4, indexer_compress_ratio=2)
_SAM = dict(hidden_size=16, mlp_dim=32, num_hidden_layers=2, num_attention_heads=2, image_size=32, patch_size=4,
            global_attn_indexes=[1], window_size=2, output_channels=8, downsample_channels=[8, 16])

_SOFTCAP = "final_logit_softcapping"
_EMBED_READ = "outside the embedding's forward"

# MoE types without a curated plan, proved through the automatic plan.
AUTO_PROVED: dict[str, Proof] = {
    "afmoe": Proof(dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, num_shared_experts=1,
                        num_dense_layers=1, num_hidden_layers=3, global_attn_every_n_layers=2, sliding_window=4,
                        layer_types=None)),
    "aria": Proof(dict(text_config=dict(moe_num_experts=8, moe_topk=2, moe_num_shared_experts=1, intermediate_size=16),
                       vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                          num_attention_heads=2, image_size=16, patch_size=4),
                       projector_patch_to_query_dict={4: 2, 16: 2}), inputs="pixels_2"),
    "aria_text": Proof(dict(moe_num_experts=8, moe_topk=2, moe_num_shared_experts=1, intermediate_size=16)),
    "axk1": Proof(dict(_DS, **_MLA, **_DENSE_FIRST)),
    "axk2": Proof(dict(_DS, **_MLA, **_DENSE_FIRST, **_INDEXER, gated_norm_rank=4, layer_types=None)),
    "bailing_hybrid": Proof(dict(num_experts=8, num_experts_per_token=2, moe_intermediate_size=16, num_shared_experts=1,
                                 num_hidden_layers=3, num_expert_group=1, topk_group=1, **_MLA, first_k_dense_replace=1,
                                 layer_group_size=3, layer_types=None, mlp_layer_types=None, linear_head_dim=8,
                                 linear_num_heads=4, num_nextn_predict_layers=0, pad_token_id=0)),
    "beam": Proof(dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, num_hidden_layers=3, n_group=1,
                       topk_group=1, sliding_window=4, layer_types=None, **_DENSE_FIRST), without={"head": _SOFTCAP}),
    "cohere2_moe": Proof(dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, num_hidden_layers=3,
                              sliding_window=4, layer_types=None, mlp_layer_types=None),
                         without={"head": "logits * self.logit_scale"}),
    "deepseek_ocr2": Proof(dict(
        text_config=dict(_DS, **_DENSE_FIRST),
        vision_config=dict(sam_config=_SAM, encoder_config=dict(hidden_size=16, intermediate_size=32,
                                                                num_hidden_layers=1, num_attention_heads=2,
                                                                num_key_value_heads=2, vocab_size=8)))),
    "deepseek_v32": Proof(dict(_DS, **_MLA, **_INDEXER, first_k_dense_replace=1, layer_types=None,
                               mlp_layer_types=None)),
    "deepseek_v4": Proof(dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=1,
                              num_hidden_layers=3, q_lora_rank=16, head_dim=16, qk_rope_head_dim=8,
                              num_key_value_heads=1, o_groups=2, o_lora_rank=16, index_n_heads=2, index_head_dim=8,
                              num_nextn_predict_layers=0, sliding_window=4, layer_types=None, mlp_layer_types=None),
                         note="hash-routed layers: a token-to-expert table (an integer buffer) instead of a router"),
    "dots1": Proof(dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=1,
                        first_k_dense_replace=1, n_group=1, topk_group=1, num_hidden_layers=3)),
    "dots3_note": Proof(dict(
        **_IMAGE,
        text_config=_DOTS3,
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                           patch_size=4, moe_intermediate_size=16, mlp_layer_types=["dense"], num_local_experts=8,
                           adapter_in_dim=16, adapter_out_dim=32),
        audio_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                          num_key_value_heads=2, head_dim=8, downsample_hidden_size=8, adapter_input_size=16,
                          adapter_out_dim=32, conv_output_size=16, feature_size=16)), inputs="image"),
    "dots3_note_text": Proof(_DOTS3),
    "ernie4_5_moe": Proof(dict(moe_num_experts=8, moe_k=2, moe_intermediate_size=16, moe_layer_start_index=0)),
    "ernie4_5_vl_moe": Proof(dict(
        **_IMAGE,
        text_config=dict(moe_num_experts=8, moe_k=2, moe_intermediate_size=[16, 8], moe_num_shared_experts=1,
                         num_hidden_layers=3, tie_word_embeddings=False, **_DENSE_FIRST,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]}),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=4),
        tie_word_embeddings=False), inputs="image", note="text and vision experts of their own in every MoE layer"),
    "exaone_moe": Proof(dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, num_shared_experts=1,
                             num_hidden_layers=3, first_k_dense_replace=1, sliding_window=4, layer_types=None,
                             mlp_layer_types=None)),
    "flex_olmo": Proof(dict(num_experts=8, num_experts_per_tok=2, intermediate_size=16, pad_token_id=0)),
    "flint": Proof(dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                        shared_expert_intermediate_size=24, num_hidden_layers=3, mlp_only_layers=[0], sliding_window=4,
                        layer_types=None)),
    "gemma4": Proof(dict(text_config=_GEMMA4, tie_word_embeddings=False, image_token_id=_IMAGE["image_token_id"],
                         vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                            num_attention_heads=2, num_key_value_heads=2, head_dim=8, patch_size=4,
                                            position_embedding_size=16)),
                    without={"head": _SOFTCAP, "emb": _EMBED_READ}, inputs="patches"),
    "gemma4_text": Proof(_GEMMA4, without={"head": _SOFTCAP}),
    "glm4_moe_lite": Proof(dict(_DS, **_MLA, **_DENSE_FIRST)),
    "glm4v_moe": Proof(dict(
        **_IMAGE,
        text_config=dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=1,
                         first_k_dense_replace=1, num_hidden_layers=3, head_dim=16,
                         rope_parameters=dict(_MROPE, partial_rotary_factor=0.5)),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=4, image_size=16,
                           out_hidden_size=32)), inputs="image"),
    "glm5_next": Proof(dict(
        **_IMAGE,
        text_config=dict(_DS, **dict(_MLA, qk_rope_head_dim=0), **_INDEXER, **_DENSE_FIRST, pad_token_id=0,
                         head_dim=0, linear_head_dim=8, linear_num_heads=4,
                         layer_types=["linear_attention", "full_attention", "linear_attention"]),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=4, image_size=16,
                           out_hidden_size=32, projection_intermediate_size=32)), inputs="image"),
    "glm_moe_dsa": Proof(dict(_DS, **_MLA, **_INDEXER, first_k_dense_replace=1, layer_types=None,
                              mlp_layer_types=None)),
    "granitemoe": Proof(dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=16),
                        without={"head": "logits_scaling"}),
    "granitemoe_swa": Proof(dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=16, sliding_window=4,
                                 layer_types=None, layer_rope_theta=None), without={"head": "logits_scaling"}),
    "granitemoehybrid": Proof(dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=16,
                                   shared_intermediate_size=24, num_hidden_layers=3,
                                   layer_types=["mamba", "attention", "mamba"], mamba_n_heads=4, mamba_d_state=8,
                                   mamba_d_head=16, mamba_chunk_size=4, time_step_limit=(0.0, 1e4)),
                              without={"head": "logits_scaling"}),
    "granitemoeshared": Proof(dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=16,
                                   shared_intermediate_size=24), without={"head": "logits_scaling"}),
    "hunyuan_v1_moe": Proof(dict(num_experts=8, moe_topk=2, intermediate_size=16)),
    "hy_v3": Proof(dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, num_shared_experts=1,
                        num_hidden_layers=3, **_DENSE_FIRST)),
    "hy_v4": Proof(dict(_DS, **_MLA, **_INDEXER, **_DENSE_FIRST, layer_types=None, pad_token_id=0)),
    "hy_v4_vl": Proof(dict(
        **_IMAGE,
        text_config=dict(_DS, **_MLA, **_INDEXER, **_DENSE_FIRST, layer_types=None, pad_token_id=0,
                         rope_parameters=_MROPE),
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                           num_key_value_heads=2, patch_size=4, out_hidden_size=32, max_image_size=32)),
        inputs="image_row_newline"),
    "inkling_mm_model": Proof(dict(
        text_config=dict(_INKLING, n_shared_experts=1, mlp_layer_types=None),
        vision_config=dict(text_hidden_size=32, patch_size=4, hidden_size=16, n_layers=1, num_attention_heads=2),
        audio_config=dict(n_mel_bins=8, mel_vocab_size=16, text_hidden_size=32)),
        without={"head": "unpadded_vocab_size"}),
    "inkling_text": Proof(dict(_INKLING, n_shared_experts=1, mlp_layer_types=None),
                          without={"head": "unpadded_vocab_size"}),
    "inkling2": Proof(dict(text_config=_INKLING2, vision_config=_INKLING2_VISION), without={"head": "logit_softcap"}),
    "inkling2_text": Proof(_INKLING2, without={"head": _SOFTCAP}),
    "inkling2_loop": Proof(dict(text_config=_INKLING2_LOOP, vision_config=_INKLING2_VISION),
                           without={"head": "logit_softcap"}),
    "inkling2_loop_text": Proof(_INKLING2_LOOP, without={"head": _SOFTCAP}),
    "jamba": Proof(dict(num_experts=8, num_experts_per_tok=2, intermediate_size=16, num_hidden_layers=4,
                        expert_layer_period=2, expert_layer_offset=1, attn_layer_period=2, attn_layer_offset=0,
                        mamba_d_state=4, mamba_dt_rank=4)),
    "kimi_linear": Proof(dict(num_experts=8, num_experts_per_token=2, moe_intermediate_size=16, num_shared_experts=1,
                              num_hidden_layers=3, **_MLA, num_expert_group=1, topk_group=1, pad_token_id=0,
                              **_DENSE_FIRST, layer_types=["linear_attention", "full_attention", "linear_attention"],
                              linear_head_dim=8, linear_num_heads=4)),
    "kolibri1": Proof(dict(num_local_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                           shared_expert_intermediate_size=16, sliding_window=4, layer_types=None)),
    "laguna": Proof(dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                         shared_expert_intermediate_size=16, num_hidden_layers=3, sliding_window=4, layer_types=None,
                         num_attention_heads_per_layer=None, **_DENSE_FIRST)),
    "lara_mini": Proof(dict(_GATED_DELTA, sliding_window=4,
                            layer_types=["linear_attention", "sliding_attention", "full_attention"])),
    "lfm2_moe": Proof(dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, num_hidden_layers=3,
                           num_dense_layers=1, layer_types=["conv", "full_attention", "conv"])),
    "mellum": Proof(dict(num_local_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, sliding_window=4,
                         layer_types=None, mlp_layer_types=None)),
    "mimo_v2_flash": Proof(dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                                num_hidden_layers=3, v_head_dim=8, sliding_window=4, layer_types=None,
                                **_DENSE_FIRST)),
    "minimax": Proof(dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=16,
                          layer_types=["linear_attention", "full_attention"], block_size=4)),
    "minimax_m2": Proof(dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=16)),
    "minimax_m3_vl": Proof(dict(
        **_IMAGE,
        text_config=_MINIMAX_M3,
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                           image_size=16, patch_size=4),
        projector_hidden_size=32, merged_hidden_size=64), inputs="image"),
    "minimax_m3_vl_text": Proof(_MINIMAX_M3),
    "mistral4": Proof(dict(_DS, **_MLA, head_dim=16)),
    "mistral_large4": Proof(dict(
        text_config=dict(_DS, **_MLA, **_INDEXER, head_dim=16, first_k_dense_replace=1, layer_types=None,
                         mlp_layer_types=None, no_rope_layers=None, kv_source_layers=None),
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                           image_size=16, patch_size=4, head_dim=8)), without={"head": _SOFTCAP},
        inputs="pixels_sized_4"),
    "muse_spark": Proof(dict(
        text_config=dict(num_local_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, moe_hidden_size=16,
                         sliding_window=4, layer_types=None, layer_rope_theta=None, mlp_layer_types=None),
        vision_config=dict(patch_size=4, pos_emb_height=4, pos_emb_width=4, num_attention_heads=2,
                           num_hidden_layers=1, hidden_size=16, intermediate_size=32, layer_types=None),
        audio_config=dict(hidden_sizes=(8, 8, 8, 16), depths=(1, 1, 1, 1), out_hidden_size=32),
        out_hidden_size=32, projector_hidden_size=32), without={"head": "output_multiplier"},
        note="a norm after every expert (`post_expert_norm`, plain FSDP inside the EP-split experts)"),
    "nemotron_h": Proof(dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                             moe_shared_expert_intermediate_size=16, num_hidden_layers=4,
                             layers_block_type=["mamba", "moe", "attention", "moe"], ssm_state_size=8,
                             mamba_num_heads=4, mamba_head_dim=8, n_groups=1, chunk_size=4,
                             time_step_limit=(0.0, 1e4)),
                        note="ungated experts (`up_proj`, relu²)"),
    "phimoe": Proof(dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=16, router_jitter_noise=0.0)),
    "qwen3_5_moe": Proof(dict(**_IMAGE, text_config=_GATED_DELTA, vision_config=_QWEN_VISION), inputs="image"),
    "qwen3_5_moe_text": Proof(_GATED_DELTA),
    "qwen3_next": Proof(_GATED_DELTA),
    "qwen3_omni_moe_thinker": Proof(dict(
        **_IMAGE,
        text_config=dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, rope_parameters=_MROPE),
        vision_config=dict(_QWEN_VISION, deepstack_visual_indexes=[0]),
        audio_config=dict(d_model=16, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=32, num_mel_bins=8,
                          output_dim=32, downsample_hidden_size=8)),
        inputs="image", note="the thinker of Qwen3-Omni, its language model (the whole qwen3_omni_moe is refused)"),
    "qwen3_vl_moe": Proof(dict(**_IMAGE, text_config=dict(num_experts=8, num_experts_per_tok=2,
                                                         moe_intermediate_size=16, rope_parameters=_MROPE),
                               vision_config=dict(_QWEN_VISION, deepstack_visual_indexes=[0])), inputs="image"),
    "qwen4_exp": Proof(dict(**_IMAGE, text_config=_QWEN4, vision_config=_QWEN_VISION), inputs="image"),
    "qwen4_exp_text": Proof(_QWEN4),
    "solar_open": Proof(dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=1)),
    "unlimited_ocr": Proof(dict(
        text_config=dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=1,
                         num_hidden_layers=3, layer_types=None, sliding_window=4, **_DENSE_FIRST),
        vision_config=dict(sam_config=_SAM, encoder_config=dict(hidden_size=16, intermediate_size=32,
                                                                num_hidden_layers=1, num_attention_heads=2,
                                                                image_size=16, patch_size=4)))),
    "zaya": Proof(dict(num_experts=8, num_experts_per_tok=1, moe_intermediate_size=16, layer_types=None,
                       router_hidden_size=16), note="top-1 routing (the only one ZAYA supports)"),
}


def tiny_overrides(model_type: str) -> dict:
    """The tiny-config overrides of ``model_type``: its curated plan's ``tiny``, else its :data:`AUTO_PROVED` entry
    (a deep copy: the caller may change it), else none."""
    curated = curated_plans().get(model_type)
    tiny = curated.tiny if curated is not None else AUTO_PROVED[model_type].tiny if model_type in AUTO_PROVED else {}
    return copy.deepcopy(dict(tiny))


def _mesh_name(kwargs: dict) -> str:
    return "_".join(f"{k}{v}" for k, v in kwargs.items() if k not in ("innermost", "replicate")) or "fsdp"


def proof_meshes(model_type: str) -> dict[str, dict]:
    """``{mesh name: Mesh kwargs}`` that tests/distributed/test_zoo.py proves for ``model_type``."""
    plan = curated_plans().get(model_type)
    if plan is not None:
        return MOE_MESHES if "ep" in plan.extra else DENSE_MESHES
    without = AUTO_PROVED[model_type].without
    meshes = [{k: v for k, v in m.items() if k not in without} for m in AUTO_MESHES.values()]
    return {_mesh_name(m): m for m in meshes}


def long_context_meshes(model_type: str) -> dict[str, dict]:
    """``{mesh name: Mesh kwargs}`` of the long-context proof of ``model_type`` (unless ``parallelize`` refuses sp
    and cp for it: then the proof is the refusal)."""
    plan = curated_plans().get(model_type)
    return LONG_CONTEXT_MESHES if plan is None or "ep" in plan.extra else LONG_CONTEXT_DENSE_MESHES


# The meshes above leave every planned slice divisible by its FSDP ranks (8 experts, 128 vocab rows), so FSDP2 shards it
# on dim 0. Each type is also proved with FSDP2 on dim 1 (tests/distributed/test_zoo_placement.py): its tiny config with
# 6 experts and 130 vocab rows (slices of 3 experts and 65 rows over 2 FSDP ranks) on its plans of size 2.
DIM1_VOCAB = 130
# Other sizes that must follow the vocab: gemma4's per-layer embedding is indexed by the same ids, inkling2's head
# has unpadded_vocab_size rows.
VOCAB_ALIASES = ("vocab_size_per_layer_input", "unpadded_vocab_size")
DIM1_EXPERTS = 6
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def _with_experts(tiny: dict, count: int) -> dict:
    return {k: count if k in EXPERT_COUNT_KEYS and v == 8 else _with_experts(v, count) if isinstance(v, dict) else v
            for k, v in tiny.items()}


def dim1_proof(model_type: str) -> tuple[dict, dict]:
    """``(Mesh kwargs, tiny config overrides)`` under which FSDP2 shards every planned tensor of ``model_type`` on
    dim 1: each plan of its proof meshes at size 2, over 6 experts and 130 vocab rows (in the text config of a
    composite one), whose slices do not divide by the 2 FSDP ranks."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    tiny = _with_experts(tiny_overrides(model_type), DIM1_EXPERTS)
    text = "text_config" in getattr(CONFIG_MAPPING[model_type], "sub_configs", {})
    if text:
        tiny["text_config"] = dict(tiny.get("text_config", {}))
    target = tiny["text_config"] if text else tiny
    target["vocab_size"] = DIM1_VOCAB
    for key in VOCAB_ALIASES:
        if key in target:
            target[key] = DIM1_VOCAB
    used = {k for mesh in proof_meshes(model_type).values() for k in mesh if k not in ("innermost", "replicate")}
    return {name: 2 for name in ("ep", "emb", "head") if name in used}, tiny


def proved_architectures() -> list[str]:
    """Every ``model_type`` with a parity proof: the curated plans, then the automatic ones, each sorted."""
    return supported_architectures() + sorted(AUTO_PROVED)


def describe_mesh(kwargs: dict) -> str:
    """``Mesh(ep=2, emb=2, innermost={'ep': False})`` → ``ep=2 emb=2 (ep strided)``."""
    sizes = {k: v for k, v in kwargs.items() if k not in ("innermost", "replicate")}
    text = " ".join(f"{k}={v}" for k, v in sizes.items()) or "FSDP only"
    strided = [k for k, v in kwargs.get("innermost", {}).items() if not v]
    if strided:
        text += f" ({', '.join(strided)} strided)"
    return text


@lru_cache(maxsize=1)
def transformers_moe_families() -> dict[str, tuple[str, ...]]:
    """The pinned transformers' MoE families: ``{models/ directory: its model types}`` for every directory whose
    modeling code declares fused experts (``@use_experts_implementation``), read from the installed package."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    root = Path(transformers.__file__).parent / "models"
    families = sorted(p.parent.name for p in root.glob("*/modeling_*.py")
                      if re.search(r"^@use_experts_implementation", p.read_text(), re.M))
    by_dir: dict[str, list[str]] = {d: [] for d in families}
    for model_type in CONFIG_MAPPING_NAMES:
        if family_of(model_type) in by_dir:
            by_dir[family_of(model_type)].append(model_type)
    return {d: tuple(sorted(types)) for d, types in by_dir.items()}


def family_of(model_type: str) -> str:
    """The transformers ``models/`` directory that defines ``model_type``."""
    from transformers.models.auto.configuration_auto import model_type_to_module_name

    return model_type_to_module_name(model_type)


# ---- the tiny proof models -----------------------------------------------------------------------------
def tiny_config(model_type: str = "qwen3_moe", **overrides):
    """A tiny transformers config of ``model_type``: shared small dims plus the type's tiny overrides (its curated
    plan's ``tiny``, else its entry in :data:`AUTO_PROVED`) (≥ 2 layers; 8 experts, top-2
    for MoE types). A composite config (vision/audio + text) gets the small dims in its ``text_config``; its other
    sub-configs come from the overrides as dicts."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    base = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, max_position_embeddings=64, tie_word_embeddings=False,
                rms_norm_eps=1e-6)
    tiny = {**tiny_overrides(model_type), **overrides}
    if "text_config" in getattr(CONFIG_MAPPING[model_type], "sub_configs", {}):
        text = {**base, **tiny.pop("text_config", {})}
        return AutoConfig.for_model(model_type, text_config=text, **tiny)
    return AutoConfig.for_model(model_type, **{**base, **tiny})


def build_model(config, seed: int = 0, experts_implementation: str | None = None) -> nn.Module:
    """The transformers language model for ``config`` (:func:`~xpar_zoo.zoo.registry.model_class`: causal LM, or the
    config's own multimodal class) with weights drawn from ``seed`` (identical on every rank)."""
    torch.manual_seed(seed)
    kwargs = {"experts_implementation": experts_implementation} if experts_implementation else {}
    model = from_config(model_class(config), config, dtype=torch.float32, **kwargs)
    return model.train()
