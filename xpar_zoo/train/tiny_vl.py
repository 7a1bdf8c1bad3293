"""``tiny-qwen3-vl-moe``: a tiny qwen3_vl_moe (a vision tower, an MoE language model with multimodal RoPE) with its
processor files, built in code (nothing is downloaded), so that ``xpar-zoo train --model tiny-qwen3-vl-moe`` runs an
image–text SFT on CPU ranks in a minute or two (``examples/sft_qwen3_vl_moe.yaml``, ``examples/data/tiny_vl.jsonl``).

- the tokenizer: ``tiny-qwen3-moe``'s byte-level one with Qwen-VL's vision tokens (``<|vision_start|>``,
  ``<|vision_end|>``, ``<|image_pad|>``, ``<|video_pad|>``) and a ChatML template that renders image and video parts
  as Qwen-VL does, with ``{% generation %}`` markers around each assistant turn;
- the processor files: Qwen2-VL's image processor (4-pixel patches, merged by 2 x 2: an image of 32 by 32 pixels is 16 tokens), the
  tokenizer, the chat template, and ``processor_config.json`` / ``video_preprocessor_config.json`` naming
  ``Qwen3VLProcessor`` (loaded whole where torchvision is, without its video processor elsewhere);
- :func:`save_tiny_vl_model`: the model (fixed seed, the hub's layout) and those files in a directory;
  ``python -m xpar_zoo.train.tiny_vl DIR`` does the same from the shell.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from .tiny import TINY_MODEL, chatml_template, save_seeded_model, save_tiny_model, tiny_config, tiny_tokenizer

TINY_VL_MODEL = "tiny-qwen3-vl-moe"
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
PATCH, TEMPORAL, MERGE = 4, 2, 2
MIN_PIXELS, MAX_PIXELS = 8 * 8, 32 * 32
_TEXT = ("{{- content if content is string else '' -}}"
         "{%- if content is not string -%}{%- for part in content -%}"
         "{%- if part.type == 'image' -%}{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
         "{%- elif part.type == 'video' -%}{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
         "{%- else -%}{{- part.text -}}{%- endif -%}"
         "{%- endfor -%}{%- endif -%}")
CHAT_TEMPLATE = chatml_template(_TEXT)


def tiny_vl_tokenizer():
    """The tokenizer of ``tiny-qwen3-vl-moe`` (263 tokens)."""
    return tiny_tokenizer(VISION_TOKENS, CHAT_TEMPLATE)


def tiny_vl_config(tokenizer):
    """The transformers config of ``tiny-qwen3-vl-moe``: ``tiny-qwen3-moe``'s language model (with multimodal
    RoPE) and a one-block vision tower of width 16 with deepstack features."""
    from transformers import Qwen3VLMoeConfig

    text = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                rms_norm_eps=1e-6, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2]})
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=PATCH,
                  temporal_patch_size=TEMPORAL, spatial_merge_size=MERGE, out_hidden_size=64,
                  num_position_embeddings=16, deepstack_visual_indexes=[0])
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in zip(
        ("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id"), VISION_TOKENS)}
    return Qwen3VLMoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=False, **ids)


def save_processor_files(directory: str | os.PathLike, tokenizer) -> None:
    """The processor's files: image processor, tokenizer, chat template, and the processor's and video
    processor's configs (written as JSON: building a video processor needs torchvision)."""
    from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

    directory = Path(directory)
    image = Qwen2VLImageProcessorPil(patch_size=PATCH, temporal_patch_size=TEMPORAL, merge_size=MERGE,
                                     min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    image.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    (directory / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    (directory / "processor_config.json").write_text(json.dumps({"processor_class": "Qwen3VLProcessor"}, indent=2))
    video = {"video_processor_type": "Qwen3VLVideoProcessor", "processor_class": "Qwen3VLProcessor",
             "patch_size": PATCH, "temporal_patch_size": TEMPORAL, "merge_size": MERGE,
             "size": {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS * 4}}
    (directory / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2))


def save_tiny_vl_model(directory: str | os.PathLike, seed: int = 0) -> Path:
    """Write ``tiny-qwen3-vl-moe`` (weights drawn from ``seed``, the hub's own format) and its processor files to
    ``directory``. Returns the directory."""
    from transformers import AutoModelForImageTextToText

    tokenizer = tiny_vl_tokenizer()
    directory = save_seeded_model(directory, AutoModelForImageTextToText, tiny_vl_config(tokenizer), tokenizer, seed)
    save_processor_files(directory, tokenizer)
    return directory


def tiny_model_config(name: str):
    """The config of a tiny model built in code (:data:`TINY_MODELS`), without building it; ``None`` for others."""
    if name == TINY_MODEL:
        return tiny_config(len(tiny_tokenizer()))
    if name == TINY_VL_MODEL:
        return tiny_vl_config(tiny_vl_tokenizer())
    return None


def save_tiny_files(name: str, directory: str | os.PathLike) -> None:
    """What a tiny model's data needs, without its weights: the tokenizer (and the VL model's config and processor
    files)."""
    if name == TINY_VL_MODEL:
        tokenizer = tiny_vl_tokenizer()
        tiny_vl_config(tokenizer).save_pretrained(directory)
        save_processor_files(directory, tokenizer)
    else:
        tiny_tokenizer().save_pretrained(directory)


def _without_progress_bars(fn, *args):
    """``fn(*args)`` with transformers' progress bars off (a model of a few KiB needs no "Writing model shards" bar
    in the run's log), as they were after."""
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        return fn(*args)
    finally:
        if shown:
            hf_logging.enable_progress_bar()


def resolve_model(name: str, output: str | os.PathLike) -> str:
    """``name``, or for a tiny model built in code (:data:`TINY_MODELS`) the directory ``OUTPUT/<name>`` it is
    saved in (written by the caller's rank 0 when missing, whole or not at all: an interrupted start leaves no
    half-written model)."""
    save = {TINY_MODEL: save_tiny_model, TINY_VL_MODEL: save_tiny_vl_model}.get(name)
    if save is None:
        return name
    directory = Path(output) / name
    if not (directory / "config.json").is_file():  # written into a staging directory, then moved in place
        import shutil
        import tempfile

        directory.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=directory.parent))
        try:
            _without_progress_bars(save, staging)
            shutil.rmtree(directory, ignore_errors=True)  # an older, incomplete one
            os.replace(staging, directory)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return str(directory)


TINY_MODELS = (TINY_MODEL, TINY_VL_MODEL)

if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(f"usage: python -m xpar_zoo.train.tiny_vl DIR   (writes {TINY_VL_MODEL} there)")
    print(save_tiny_vl_model(sys.argv[1]))
