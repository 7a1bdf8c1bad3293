"""Settings are options (docs/design.md, "Settings are options"): :class:`xpar_zoo.ParallelOptions` holds every switch
that changes what a parallelized model computes or which collectives it runs; environment variables are only its
defaults, read by ``ParallelOptions.from_env`` where a user's call enters the library, through one on/off parser.
Nothing below those entry points reads the environment: the package's source is walked for ``os.environ`` /
``getenv`` and for calls of ``from_env``."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
from pathlib import Path

import pytest

import xpar_zoo
from xpar_zoo.errors import PlanError, TrainConfigError
from xpar_zoo.parallel.options import ENV, ParallelOptions, parse_switch
from xpar_zoo.train import config as train_config

PACKAGE = Path(__file__).resolve().parents[2] / "xpar_zoo"
# Modules that may read the environment, and why (paths relative to the package; a folder: all of it).
ENV_READERS = {
    "environment.py": "facts others set about this process: the launcher's identity, Triton's interpreter, proxies",
    "parallel/options.py": "ParallelOptions.from_env: the XPAR_ZOO_* defaults of the options",
    "train/launcher.py": "starts the ranks of xpar-zoo train with their environment",
    "train/reporting.py": "wandb's own WANDB_PROJECT",
    "testing/": "the test harness: starts ranks and hands them their environment",
}
# Where ParallelOptions.from_env may be called: where a user's call enters the library.
FROM_ENV_CALLERS = ("parallelize.py", "train/config.py", "commands/", "parallel/options.py")


def _allowed(path: str, allowed) -> bool:
    return any(path == a or (a.endswith("/") and path.startswith(a)) for a in allowed)


def _reads_environment(tree: ast.AST) -> list[int]:
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "environb", "getenvb"):
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module == "os" and any(
                a.name in ("environ", "getenv") for a in node.names):
            lines.append(node.lineno)
    return lines


@functools.cache
def _modules() -> tuple[tuple[str, ast.AST], ...]:
    return tuple((str(path.relative_to(PACKAGE)), ast.parse(path.read_text())) for path in sorted(PACKAGE.rglob("*.py")))


def test_nothing_below_the_entry_points_reads_the_environment():
    found = [f"{name}:{line}" for name, tree in _modules() if not _allowed(name, ENV_READERS)
             for line in _reads_environment(tree)]
    assert not found, f"environment read below the entry points (make it a ParallelOptions field): {found}"


def test_from_env_is_called_only_where_a_users_call_enters_the_library():
    found = [f"{name}:{node.lineno}" for name, tree in _modules() if not _allowed(name, FROM_ENV_CALLERS)
             for node in ast.walk(tree) if isinstance(node, ast.Attribute) and node.attr == "from_env"]
    assert not found, found


def test_the_checks_catch_a_read_and_a_call():
    tree = ast.parse("import os\nfrom os import getenv\nx = os.environ.get('A')\ny = os.getenv('B')\n"
                     "z = ParallelOptions.from_env()")
    assert sorted(_reads_environment(tree)) == [2, 3, 4]
    assert [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr == "from_env"] == [5]


def test_the_options_are_public_and_default_to_what_runs_without_them():
    assert xpar_zoo.ParallelOptions is ParallelOptions and "ParallelOptions" in xpar_zoo.__all__
    options = ParallelOptions()
    assert (options.attention_block_mib, options.cp_attention, options.mixer_recompute,
            options.cpu_collectives) == (None, None, True, "in_place")
    assert ParallelOptions.from_env({}) == options
    with pytest.raises(dataclasses.FrozenInstanceError):  # options are values
        options.mixer_recompute = False


def test_every_variable_is_a_default_of_one_field():
    environ = {ENV["attention_block_mib"]: "0.5", ENV["cp_attention"]: "Dense", ENV["mixer_recompute"]: "off",
               ENV["cpu_collectives"]: "0"}
    assert ParallelOptions.from_env(environ) == ParallelOptions(0.5, "dense", False, "gloo")
    # a field given wins over its variable
    assert ParallelOptions.from_env(environ, mixer_recompute=True).mixer_recompute is True


@pytest.mark.parametrize("field, value, message", [
    ("attention_block_mib", "lots", "attention_block_mib must be a positive number of MiB, got 'lots'"),
    ("attention_block_mib", "0", "attention_block_mib must be a positive number of MiB, got 0.0"),
    ("attention_block_mib", "inf", "attention_block_mib must be a positive number of MiB, got inf"),
    ("cp_attention", "ring", "cp_attention must be one of lower_right, dense, got 'ring'"),
    ("mixer_recompute", "maybe", "expected an on/off value"),
    ("cpu_collectives", "maybe", "expected an on/off value"),
])
def test_a_bad_variable_is_one_line_naming_it(field, value, message):
    with pytest.raises(PlanError, match=rf"^{ENV[field]}='{value}': {message}"):
        ParallelOptions.from_env({ENV[field]: value})


def test_one_parser_for_every_on_off_value():
    for raw in ("1", "true", "Yes", " ON "):
        assert parse_switch(raw, "X") is True
    for raw in ("0", "False", "no", "off"):
        assert parse_switch(raw, "X") is False
    for field in ("mixer_recompute", "cpu_collectives"):  # both switches take the same words
        on, off = ParallelOptions.from_env({ENV[field]: "yes"}), ParallelOptions.from_env({ENV[field]: "off"})
        assert on != off and on == ParallelOptions()


@pytest.mark.parametrize("fields, message", [
    ({"attention_block_mib": 0}, "attention_block_mib must be a positive number of MiB, got 0"),
    ({"attention_block_mib": True}, "attention_block_mib must be a positive number of MiB, got True"),
    ({"cp_attention": "ring"}, "cp_attention must be one of"),
    ({"mixer_recompute": 0}, "mixer_recompute must be True or False, got 0"),
    ({"cpu_collectives": "nccl"}, "cpu_collectives must be one of"),
])
def test_a_bad_field_is_one_line(fields, message):
    with pytest.raises(PlanError, match=message):
        ParallelOptions(**fields)


def _train_config(tmp_path, *argv, yaml: str = ""):
    parser = argparse.ArgumentParser()
    train_config.add_arguments(parser)
    base = ["--model", "m", "--data", "d", "--output", str(tmp_path / "out"), "--steps", "1"]
    if yaml:
        (tmp_path / "c.yaml").write_text(yaml)
        base += ["--config", str(tmp_path / "c.yaml")]
    return train_config.config_from_args(parser.parse_args([*base, *argv]))


def test_train_takes_every_option_as_a_flag_and_a_yaml_key(tmp_path, monkeypatch):
    for name in ENV.values():
        monkeypatch.delenv(name, raising=False)
    cfg = _train_config(tmp_path, "--attention-block-mib", "2", "--cp-attention", "dense", "--no-mixer-recompute",
                        "--cpu-collectives", "gloo")
    assert train_config.parallel_options(cfg) == ParallelOptions(2.0, "dense", False, "gloo")
    cfg = _train_config(tmp_path, yaml="attention_block_mib: 2\ncp-attention: lower_right\nmixer_recompute: false\n")
    assert train_config.parallel_options(cfg) == ParallelOptions(2.0, "lower_right", False)
    monkeypatch.setenv(ENV["mixer_recompute"], "0")  # not given: the variable's value
    assert train_config.parallel_options(_train_config(tmp_path)) == ParallelOptions(mixer_recompute=False)
    assert train_config.parallel_options(_train_config(tmp_path, "--mixer-recompute")) == ParallelOptions()


@pytest.mark.parametrize("yaml, message", [
    ("mixer_recompute: 0\n", "mixer_recompute must be true or false, got 0"),
    ("attention_block_mib: 0\n", "attention_block_mib must be a positive number of MiB"),
    ("cp_attention: ring\n", "cp_attention must be one of lower_right, dense, got 'ring'"),
    ("cpu_collectives: nccl\n", "cpu_collectives must be one of in_place, gloo, got 'nccl'"),
    ("attention_block_mib: .inf\n", "attention_block_mib must be a finite number, got inf"),
    ("mixer_recompute: maybe\n", "mixer_recompute must be true or false, got 'maybe'"),
])
def test_a_bad_option_in_the_train_config_is_one_line(tmp_path, yaml, message):
    with pytest.raises(TrainConfigError, match=message) as e:
        _train_config(tmp_path, yaml=yaml)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("argv, message", [
    (("--attention-block-mib", "inf"), "^--attention-block-mib: attention_block_mib must be a finite number, got inf$"),
    (("--attention-block-mib", "-1"), "^--attention-block-mib: attention_block_mib must be a positive number of MiB"),
])
def test_a_bad_option_flag_is_one_line_naming_the_flag(tmp_path, argv, message):
    with pytest.raises(TrainConfigError, match=message):
        _train_config(tmp_path, *argv)


def test_options_given_after_parallelize_reach_the_models_parallel_state():
    """What ``XparTrainer(options=...)`` does: the styles read the new options from the next forward on;
    ``cpu_collectives`` stays what ``parallelize`` gave the FSDP units."""
    import types

    from torch import nn

    from xpar_zoo.errors import ModelStateError
    from xpar_zoo.parallel.state import parallel_state, set_parallel_state
    from xpar_zoo.parallelize import set_parallel_options

    model = nn.Linear(2, 2)
    set_parallel_state(model, types.SimpleNamespace(options=ParallelOptions()))
    set_parallel_options(model, ParallelOptions(mixer_recompute=False, attention_block_mib=1))
    assert parallel_state(model).options == ParallelOptions(mixer_recompute=False, attention_block_mib=1)
    with pytest.raises(PlanError, match="cpu_collectives='gloo': the model was parallelized with 'in_place'"):
        set_parallel_options(model, ParallelOptions(cpu_collectives="gloo"))
    with pytest.raises(ModelStateError, match="Linear is not parallelized"):
        set_parallel_options(nn.Linear(2, 2), ParallelOptions())
