"""Multimodal models in `xpar-zoo train`: their configs keep the language model's settings in a text config, which
every read of the training command honours."""

from pathlib import Path

from xpar_zoo.commands import cli
from xpar_zoo.testing.proofs import tiny_config, tiny_overrides
from xpar_zoo.train.tiny import tiny_tokenizer

SHIPPED = Path(__file__).parents[2] / "examples" / "data" / "tiny_chat.jsonl"


def _glm4v_moe_folder(directory: Path) -> Path:
    """A glm4v_moe config (no weights: a dry run reads none) with the tiny byte-level chat tokenizer."""
    tokenizer = tiny_tokenizer()
    overrides = tiny_overrides("glm4v_moe")
    overrides["text_config"] = {**overrides["text_config"], "vocab_size": len(tokenizer) + 4}
    overrides.update({k: len(tokenizer) + i for i, k in enumerate(
        ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"))})
    tiny_config("glm4v_moe", **overrides).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def test_dry_run_of_a_multimodal_model_reads_its_text_config(tmp_path, capsys):
    model = _glm4v_moe_folder(tmp_path / "glm4v")
    argv = ["train", "--model", str(model), "--data", str(SHIPPED), "--output", str(tmp_path / "never"),
            "--steps", "2", "--seq-len", "512", "--mesh", "none", "--dry-run"]
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    assert "model: glm4v_moe, 3 layers, vocabulary 263" in text
    assert "memory per rank:" in text
