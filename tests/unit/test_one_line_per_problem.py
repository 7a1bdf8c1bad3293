"""One line per problem, and only true ones (issue 37, item 3): counts said in the right number, the
packed-documents note only where the attention does not mask them (never under sp/cp, whose attention masks them
from the whole rows' positions)."""

import pytest

from xpar_zoo.errors import counted
from xpar_zoo.train.loop import packed_documents_note


def test_counts_are_said_in_the_right_number():
    assert counted(1, "rank") == "1 rank" and counted(4, "rank") == "4 ranks" and counted(0, "file") == "0 files"
    assert counted(1, "sequence group") == "1 sequence group" and counted(2, "replica") == "2 replicas"


@pytest.mark.parametrize("attn", ["xpar_seq_sdpa", "xpar_seq_eager", "xpar_seq_flex_attention", "xpar_seq_fa2",
                                  "sdpa", "eager", "flex_attention"])
def test_no_packed_documents_note_where_the_attention_masks_them(attn):
    assert packed_documents_note(attn, flatten=False) is None


def test_packed_documents_note_where_it_is_true():
    assert packed_documents_note("flash_attention_2", flatten=True) is None  # rows flattened: varlen per document
    note = packed_documents_note("my_kernel", flatten=False)
    assert note.startswith("note: attention implementation 'my_kernel': packed documents are not masked")


def test_size_suggest_says_what_it_ranks_by_and_shows_an_ep_mesh_for_an_moe_model(tmp_path, capsys):
    from xpar_zoo import sizing
    from xpar_zoo.commands import cli
    from xpar_zoo.train.tiny import tiny_config, tiny_tokenizer

    config = tiny_config(len(tiny_tokenizer()))
    shown = sizing.suggest(config, 4)
    assert any(e.mesh.get("ep", 1) > 1 for e in shown)  # the tiny model's ep meshes send more: still one is shown
    config.save_pretrained(tmp_path)
    assert cli.main(["size", str(tmp_path), "--world", "4", "--suggest"]) == 0
    out = capsys.readouterr().out
    assert "meshes ranked by bytes sent per rank per step, then peak memory per rank" in out
    assert "'ep': 2" in out or "'ep': 4" in out


def test_applying_lora_raises_neither_peft_rename_nor_gradient_checkpointing_warnings():
    """Every LoRA run printed PEFT's `base_model_name_or_path was renamed` and transformers'
    `is_gradient_checkpointing is deprecated` (read by PEFT's constructor): the first is fixed at the cause (the
    model's name_or_path is its config's), the second filtered where PEFT reads it."""
    import warnings

    import torch
    from peft import LoraConfig

    from xpar_zoo.hub.adapter_files import attach_adapter
    from xpar_zoo.testing import parity
    from xpar_zoo.zoo.registry import build_meta

    model = build_meta(parity.tiny_config("qwen3_moe"), torch.float32)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=r".*base_model_name_or_path.*was renamed")
        warnings.filterwarnings("error", message=r".*is_gradient_checkpointing.*deprecated")
        peft_model, _ = attach_adapter(model, peft_config=LoraConfig(r=2, target_modules=["q_proj"]),
                                       name_or_path="org/base")
    assert peft_model.peft_config["default"].base_model_name_or_path == "org/base"
