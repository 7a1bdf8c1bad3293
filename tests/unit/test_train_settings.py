"""`xpar-zoo train` settings are checked exactly at parse time, from flags and YAML alike (issue 31, item 4): every
number finite and in its range, YAML types exact (2.7 is not 2, a quoted "1024" is not a number), a key given twice refused (``seq_len`` and
``seq-len`` too), YAML aliases refused (an alias bomb fails at once, in little memory), an unknown attention
implementation refused before the model loads. Each is one line ``xpar-zoo: error: …`` and exit status 2."""

import resource

import pytest

from xpar_zoo.commands import cli
from xpar_zoo.errors import TrainConfigError
from xpar_zoo.train import TrainConfig, read_config_file
from xpar_zoo.train.config import validate

BASE = ["--model", "m", "--data", "d.jsonl", "--output", "o", "--steps", "5"]


def _one_line_error(argv, capsys) -> str:
    assert cli.main(["train", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("xpar-zoo: error: ") and err.count("\n") == 1, err
    return err


@pytest.mark.parametrize("flag, value, message", [
    ("--lr", "nan", "lr must be a finite number"),
    ("--lr", "inf", "lr must be a finite number"),
    ("--lr", "5", "lr must be at most 1"),
    ("--lr", "-0.0001", "lr must be at least 0"),
    ("--max-grad-norm", "nan", "max_grad_norm must be a finite number"),
    ("--max-grad-norm", "inf", "max_grad_norm must be a finite number"),
    ("--weight-decay", "nan", "weight_decay must be a finite number"),
    ("--weight-decay", "-0.1", "weight_decay must be at least 0"),
    ("--timeout-minutes", "nan", "timeout_minutes must be a finite number"),
    ("--timeout-minutes", "1e300", "timeout_minutes must be at most"),
    ("--timeout-minutes", "0", "timeout_minutes must be at least"),
    ("--min-lr-ratio", "1.5", "min_lr_ratio must be at most 1"),
    ("--expert-bias-update-rate", "inf", "expert_bias_update_rate must be a finite number"),
    ("--router-aux-loss-coef", "nan", "router_aux_loss_coef must be a finite number"),
    ("--adam-betas", "0.9,nan", "adam_betas must be two numbers in [0, 1)"),
    ("--seed", str(2**63), "seed 9223372036854775808 does not fit a 64-bit integer"),
    ("--seed", "-1", "seed must be at least 0"),
    ("--seq-len", "1", "seq_len must be at least 2"),
    ("--micro-batch", "0", "micro_batch must be at least 1"),
    ("--log-every", "0", "log_every must be at least 1"),
    ("--max-line-bytes", "0", "max_line_bytes must be at least 1"),
])
def test_flag_out_of_range_or_not_finite_is_one_line(flag, value, message, capsys):
    assert message in _one_line_error([*BASE, flag, value], capsys)


@pytest.mark.parametrize("flag, value, message", [("--lora-alpha", "nan", "lora_alpha must be a finite number"),
                                                  ("--lora-dropout", "inf", "lora_dropout must be a finite number"),
                                                  ("--lora-rank", "0", "lora_rank must be at least 1")])
def test_lora_numbers_are_checked_like_the_others(flag, value, message, capsys):
    args = [*BASE, flag, value] + (["--lora-rank", "4"] if flag != "--lora-rank" else [])
    assert message in _one_line_error(args, capsys)


def test_yaml_epochs_must_be_whole(tmp_path):
    with pytest.raises(TrainConfigError, match=r"epochs must be a whole number, got 2\.5"):
        read_config_file(_yaml(tmp_path, "epochs: 2.5\n"))


def test_oversized_seed_is_refused_at_start_not_at_save(capsys):
    """An oversized seed used to train to the end and then fail to save (the data fingerprint packs it as int64)."""
    err = _one_line_error([*BASE, "--seed", str(2**70)], capsys)
    assert "seed" in err and ("at most" in err or "64-bit" in err)


def test_unknown_attention_implementation_is_refused_at_parse_time(capsys):
    err = _one_line_error([*BASE, "--attn-implementation", "flash_attention_9"], capsys)
    assert "--attn-implementation 'flash_attention_9' is not one transformers knows" in err
    assert "sdpa" in err and "eager" in err


@pytest.mark.parametrize("attn", ["eager", "sdpa", "flex_attention", "flash_attention_2"])
def test_known_attention_implementations_pass(attn):
    validate(TrainConfig(model="m", data="d", output="o", steps=1, attn_implementation=attn))


def _yaml(tmp_path, text):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


def test_yaml_float_for_a_whole_number_is_refused_not_truncated(tmp_path):
    with pytest.raises(TrainConfigError, match=r"size of 'ep' must be a whole number, got 2\.7"):
        read_config_file(_yaml(tmp_path, "mesh: {ep: 2.7}\n"))
    with pytest.raises(TrainConfigError, match=r"steps must be a whole number, got 10\.5"):
        read_config_file(_yaml(tmp_path, "steps: 10.5\n"))


def test_yaml_bool_is_not_a_number(tmp_path):
    with pytest.raises(TrainConfigError, match="steps must be a whole number, got True"):
        read_config_file(_yaml(tmp_path, "steps: true\n"))
    with pytest.raises(TrainConfigError, match="lr must be a number, got True"):
        read_config_file(_yaml(tmp_path, "lr: yes\n"))


@pytest.mark.parametrize("text, said", [('seq_len: "1024"\n', "seq_len: '1024' is quoted"),
                                        ("lr: '3e-4'\n", "lr: '3e-4' is quoted"),
                                        ('mesh: {ep: "2"}\n', "mesh: ep: '2' is quoted"),
                                        ('seq-len: "64"\n', "seq-len: '64' is quoted")])
def test_yaml_quoted_number_is_refused_naming_the_key(tmp_path, text, said):
    with pytest.raises(TrainConfigError, match=f"{said}: a number is written without quotes"):
        read_config_file(_yaml(tmp_path, text))


def test_yaml_plain_numbers_and_quoted_strings_stay_accepted(tmp_path):
    got = read_config_file(_yaml(tmp_path, 'lr: 1e-4\nmesh: "ep=2"\nadam_betas: "0.9,0.95"\nmodel: "m"\n'))
    assert got == {"lr": 1e-4, "mesh": {"ep": 2}, "adam_betas": (0.9, 0.95), "model": "m"}


def test_yaml_nan_is_refused(tmp_path):
    with pytest.raises(TrainConfigError, match="lr must be a finite number"):
        read_config_file(_yaml(tmp_path, "lr: .nan\n"))
    with pytest.raises(TrainConfigError, match="max_grad_norm must be a finite number"):
        read_config_file(_yaml(tmp_path, "max_grad_norm: .inf\n"))


def test_yaml_duplicate_key_is_refused(tmp_path):
    with pytest.raises(TrainConfigError, match=r"line 3: key 'lr' is given twice \(first on line 1\)"):
        read_config_file(_yaml(tmp_path, "lr: 1e-4\nsteps: 3\nlr: 1e-3\n"))


def test_yaml_seq_len_and_seq_dash_len_in_one_file_are_refused(tmp_path):
    with pytest.raises(TrainConfigError, match="'seq_len' and 'seq-len' are the same setting; give it once"):
        read_config_file(_yaml(tmp_path, "seq_len: 64\nseq-len: 128\n"))


def test_yaml_alias_bomb_fails_fast_in_little_memory(tmp_path):
    """The billion laughs: nine levels of nine aliases each. Refused at the first alias, before any expansion."""
    lines = ['a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for i in range(1, 10):
        lines.append(f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]")
    lines.append("steps: *a9")
    path = _yaml(tmp_path, "\n".join(lines) + "\n")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(TrainConfigError, match=r"line 2: YAML aliases \(\*a0\) are not accepted"):
        read_config_file(path)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 100 * 1024  # KiB: under 100 MiB


def test_yaml_alias_bomb_error_through_the_cli_is_one_short_line(tmp_path, capsys):
    lines = ['a0: &a0 ["lol","lol"]'] + [f"a{i}: &a{i} [*a{i - 1},*a{i - 1}]" for i in range(1, 40)]
    err = _one_line_error(["--config", str(_yaml(tmp_path, "\n".join(lines) + "\n"))], capsys)
    assert "YAML aliases" in err and len(err) < 300


def test_yaml_too_many_nodes_is_refused(tmp_path):
    with pytest.raises(TrainConfigError, match="more than 10000 YAML nodes"):
        read_config_file(_yaml(tmp_path, "mesh: [" + ",".join(["1"] * 20000) + "]\n"))


def test_yaml_not_utf8_is_one_line(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_bytes(b"lr: 1e-4\nmodel: \xff\xfe\n")
    with pytest.raises(TrainConfigError, match=r"not UTF-8 text \(byte offset 16\)"):
        read_config_file(path)


def test_yaml_huge_file_is_refused_without_reading_it_all(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_bytes(b"# " + b"x" * (2 << 20) + b"\n")
    with pytest.raises(TrainConfigError, match="larger than 1048576 bytes"):
        read_config_file(path)


def test_yaml_hostile_value_is_cut_short_in_the_error(tmp_path):
    with pytest.raises(TrainConfigError) as e:
        read_config_file(_yaml(tmp_path, "model: [" + ",".join(["1"] * 5000) + "]\n"))
    assert len(str(e.value)) < 200


def test_direct_config_is_validated_the_same(tmp_path):
    """The Python API (TrainConfig + validate) meets the same checks as the flags."""
    with pytest.raises(TrainConfigError, match="max_grad_norm must be a finite number"):
        validate(TrainConfig(model="m", data="d", output="o", steps=1, max_grad_norm=float("nan")))
    with pytest.raises(TrainConfigError, match="size of 'ep' must be a whole number"):
        validate(TrainConfig(model="m", data="d", output="o", steps=1, mesh={"ep": 2.0}))


@pytest.mark.parametrize("attn", ["flash_attention_2", "flash_attention_3"])
def test_flash_without_kernels_is_one_line_before_the_model_loads(monkeypatch, attn):
    """Parsing takes flash (a dry run may plan a GPU run here); each rank refuses it before loading any weight when
    its machine has no flash kernels (this CPU machine has none)."""
    from xpar_zoo import loader
    from xpar_zoo.train import load

    def loaded(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(loader, "from_pretrained", loaded)
    cfg = TrainConfig(model="m", data="d", output="o", steps=1, attn_implementation=attn)
    validate(cfg)
    with pytest.raises(TrainConfigError, match=rf"^--attn-implementation {attn}: no flash-attn kernels on this machine"):
        load.load_model(cfg, mesh=None, rank=0)
    load.check_attention_here("sdpa")  # the others are not checked here


def test_flex_cannot_train_on_the_cpu_one_line_before_the_model_loads():
    from xpar_zoo.train.load import check_attention_here

    with pytest.raises(TrainConfigError, match=r"^--attn-implementation flex_attention cannot train on the CPU"):
        check_attention_here("flex_attention", "cpu")
    check_attention_here("flex_attention", "cuda")
