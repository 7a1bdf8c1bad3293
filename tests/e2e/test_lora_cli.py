"""``xpar-zoo plan --lora-rank`` counts the adapters."""

import pytest

from xpar_zoo.testing import parity


def _config():
    return parity.tiny_config("qwen3_moe")



@pytest.fixture(scope="module")
def base(tmp_path_factory) -> str:
    """A tiny qwen3_moe saved in the hub's own (per-expert) format."""
    directory = tmp_path_factory.mktemp("lora") / "base"
    parity.build_model(_config()).save_pretrained(directory)
    return str(directory)



def test_plan_cli_counts_lora(capsys):
    from xpar_zoo.commands import cli

    assert cli.main(["plan", "qwen3_moe", "--world", "8", "--ep", "4", "--lora-rank", "16"]) == 0
    out = capsys.readouterr().out
    assert "LoRA rank 16" in out and "frozen base (bf16 shards)" in out and "adapters (fp32 shards)" in out
