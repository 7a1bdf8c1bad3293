"""The earlier reliability rounds' hostile inputs, tried again on the command line (issue 37, item 7): the cases
that still gave a wrong answer or a misleading line, each one clear line before any work."""

import json

import pytest

from xpar_zoo.commands import cli
from xpar_zoo.errors import DataError
from xpar_zoo.zoo.configs import check_sizes


@pytest.mark.parametrize("key, value", [("num_hidden_layers", -4), ("hidden_size", 0), ("vocab_size", True),
                                        ("num_attention_heads", 2.5)])
def test_size_refuses_a_config_whose_model_sizes_are_not_positive_whole_numbers(tmp_path, capsys, key, value):
    """`size` printed "-4 layers" and negative activation bytes for such a config, exit 0."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", key: value}))
    assert cli.main(["size", str(tmp_path), "--world", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"xpar-zoo: error: {tmp_path / 'config.json'}: {key} is {json.dumps(value)}: a model size must "
                   "be a whole number of at least 1"]


def test_size_refuses_a_nested_text_config_size(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe",
                                                       "text_config": {"num_hidden_layers": 0}}))
    assert cli.main(["size", str(tmp_path), "--world", "2"]) == 2
    assert "text_config.num_hidden_layers is 0" in capsys.readouterr().err


def test_a_list_of_sizes_per_modality_is_a_size_and_a_bad_entry_is_not():
    """ernie4_5_vl_moe gives one expert width per modality (`moe_intermediate_size: [16, 8]`): the size check took it
    for a bad size and refused the zoo's own round trip."""
    check_sizes({"text_config": {"moe_intermediate_size": [16, 8]}}, "config.json", DataError)
    for bad in ([16, 0], [], [16, [8]], [16, 2.5]):
        with pytest.raises(DataError, match="moe_intermediate_size"):
            check_sizes({"moe_intermediate_size": bad}, "config.json", DataError)


def test_a_missing_local_tokenizer_path_is_said_missing_without_asking_the_hub(monkeypatch):
    """`--tokenizer ./nope` passed huggingface_hub's repo-id validation message through; a two-part missing path
    (`toks/mine`) went to the hub first."""
    import huggingface_hub

    from xpar_zoo.train.data import load_tokenizer

    def no_hub(*a, **k):
        raise AssertionError("the hub was asked")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", no_hub)
    for name in ("./nope_tok", "~/nope_tok/"):
        with pytest.raises(DataError, match=r"^no tokenizer: .*nope_tok/? does not exist \(no such local directory"):
            load_tokenizer(name)


def test_resume_takes_another_spelling_of_the_same_data_path(tmp_path, monkeypatch):
    """A run started with `--data data.jsonl` and resumed with its absolute path was refused as changed data (the
    rows are checked by the data fingerprint in any case); a different file is still refused."""
    from xpar_zoo.errors import TrainConfigError
    from xpar_zoo.train.agreement import resume_changes
    from xpar_zoo.train.config import TrainConfig

    monkeypatch.chdir(tmp_path)
    (tmp_path / "data.jsonl").write_text('{"text": "a"}\n')
    (tmp_path / "other.jsonl").write_text('{"text": "a"}\n')
    saved = TrainConfig(model="m", data="data.jsonl", steps=8).to_json()
    assert resume_changes(saved, TrainConfig(model="m", data=str(tmp_path / "data.jsonl"), steps=8), 4) == []
    assert resume_changes(saved, TrainConfig(model="m", data="./data.jsonl", steps=8), 4) == []
    with pytest.raises(TrainConfigError, match="--resume: data was data.jsonl at step 4, now other.jsonl"):
        resume_changes(saved, TrainConfig(model="m", data="other.jsonl", steps=8), 4)


@pytest.mark.parametrize("flag, value", [("--route-imbalance", "nan"), ("--memory-gib", "nan"),
                                         ("--memory-gib", "-2"), ("--route-imbalance", "inf")])
def test_size_refuses_a_number_that_is_not_finite_and_positive(tmp_path, capsys, flag, value):
    """`size --simulate --route-imbalance nan` ended in a ValueError traceback; `--memory-gib nan` ranked meshes
    against no budget, exit 0."""
    with pytest.raises(SystemExit) as e:
        cli.main(["size", str(tmp_path), "--world", "2", "--simulate", flag, value])
    assert e.value.code == 2
    assert f"argument {flag}: must be a finite number above 0, got {value}" in capsys.readouterr().err


def test_a_config_whose_architectures_and_model_type_disagree_is_refused_in_one_line():
    """A qwen3_moe checkpoint whose config.json says model_type llama built Qwen3MoeForCausalLM from a LlamaConfig:
    `convert to-dcp` and `train` ended in `AttributeError: 'LlamaConfig' object has no attribute 'num_experts'`."""
    import torch
    from transformers import LlamaConfig

    from xpar_zoo.errors import UnknownArchitectureError
    from xpar_zoo.zoo.registry import build_meta

    def config(arch):
        return LlamaConfig(architectures=[arch], num_hidden_layers=1, hidden_size=16, intermediate_size=32,
                           num_attention_heads=2, vocab_size=64)

    with pytest.raises(UnknownArchitectureError, match=r"architectures name Qwen3MoeForCausalLM \(a 'qwen3_moe' "
                                                       r"model\) but its model_type is 'llama' \("):
        build_meta(config("Qwen3MoeForCausalLM"), torch.float32)
    assert type(build_meta(config("LlamaForCausalLM"), torch.float32)).__name__ == "LlamaForCausalLM"
