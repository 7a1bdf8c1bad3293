"""``tiny-qwen3-moe``: a tiny qwen3_moe with a byte-level chat tokenizer, built in code (nothing is downloaded), so
that ``xpar-zoo train --model tiny-qwen3-moe`` (``examples/sft_qwen3_moe_lora.yaml``) runs a chat SFT on CPU ranks
in a minute or two.

- :func:`tiny_tokenizer`: every UTF-8 byte is a token (no merges, so any text encodes), plus ``<|endoftext|>``
  (padding), ``<|im_start|>`` and ``<|im_end|>`` (end of turn = EOS), and a ChatML chat template with
  ``{% generation %}`` markers around each assistant turn (system, user, assistant, tool roles; tool calls as JSON).
- :func:`save_tiny_model`: the model (fixed seed, the hub's per-expert layout), the tokenizer and a generation
  config in a directory; ``python -m xpar_zoo.train.tiny DIR`` does the same from the shell.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

TINY_MODEL = "tiny-qwen3-moe"
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def chatml_template(content: str = "{{- content -}}") -> str:
    """A ChatML chat template with ``{% generation %}`` markers around each assistant turn (system, user, assistant,
    tool roles; tool calls as JSON): the assistant's content and its end-of-turn token are what the model learns to
    generate. ``content`` is the Jinja that writes a message's ``content`` (a string here)."""
    return (
        "{%- for message in messages -%}"
        "{%- set content = message.content if message.content is not none else '' -%}"
        "{%- if message.role == 'assistant' -%}"
        "{{- '<|im_start|>assistant\\n' -}}"
        "{%- generation -%}" + content +
        "{%- for call in message.tool_calls or [] -%}"
        "{{- '<tool_call>' ~ ((call.function if call.function is defined else call) | tojson) ~ '</tool_call>' -}}"
        "{%- endfor -%}"
        "{{- '<|im_end|>' -}}"
        "{%- endgeneration -%}"
        "{{- '\\n' -}}"
        "{%- else -%}"
        "{{- '<|im_start|>' ~ message.role ~ '\\n' -}}" + content + "{{- '<|im_end|>\\n' -}}"
        "{%- endif -%}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
    )


CHAT_TEMPLATE = chatml_template()


def tiny_tokenizer(extra_special: tuple[str, ...] = (), chat_template: str = CHAT_TEMPLATE):
    """The byte-level chat tokenizer of ``tiny-qwen3-moe`` (a ``PreTrainedTokenizerFast``, 259 tokens; more with
    ``extra_special`` tokens)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS) + list(extra_special))
    out = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    out.chat_template = chat_template
    return out


def tiny_config(vocab_size: int):
    """The transformers config of ``tiny-qwen3-moe``: 2 layers of hidden size 64, 8 experts, top-2."""
    from transformers import Qwen3MoeConfig

    from ..zoo.registry import get_plan

    dims = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                tie_word_embeddings=False, rms_norm_eps=1e-6)
    tiny = {**get_plan("qwen3_moe").tiny, "moe_intermediate_size": 32}
    return Qwen3MoeConfig(**{**dims, **tiny})


def save_tiny_model(directory: str | os.PathLike, seed: int = 0) -> Path:
    """Write ``tiny-qwen3-moe`` (weights drawn from ``seed``, the hub's own format), its tokenizer and generation
    config to ``directory``. Returns the directory."""
    from transformers import AutoModelForCausalLM

    tokenizer = tiny_tokenizer()
    directory = save_seeded_model(directory, AutoModelForCausalLM, tiny_config(len(tokenizer)), tokenizer, seed)
    tokenizer.save_pretrained(directory)
    return directory


def save_seeded_model(directory: str | os.PathLike, auto_class, config, tokenizer, seed: int) -> Path:
    """Build ``auto_class.from_config(config)`` in fp32 with weights drawn from ``seed`` (the caller's random state
    untouched), its end-of-turn and padding tokens those of ``tokenizer`` (in a multimodal config's text config too),
    and save it to ``directory`` in the hub's own format. Returns the directory."""
    import torch
    from transformers import GenerationConfig

    directory = Path(directory)
    for c in {id(c): c for c in (config, config.get_text_config())}.values():
        c.eos_token_id = tokenizer.eos_token_id
        c.pad_token_id = tokenizer.pad_token_id
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = auto_class.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(directory)
    return directory


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(f"usage: python -m xpar_zoo.train.tiny DIR   (writes {TINY_MODEL} there)")
    print(save_tiny_model(sys.argv[1]))
