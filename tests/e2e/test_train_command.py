"""``xpar-zoo train`` as a command: bad settings are one-line errors, an unknown config key names the file, the example
config and Slurm script run."""

import os
import subprocess

import pytest

from xpar_zoo.commands import cli
from xpar_zoo.train import TrainConfig, read_config_file


@pytest.mark.parametrize("argv, message", [
    (["--model", "m", "--data", "d", "--output", "o"], "missing setting(s): --steps"),
    (["--model", "m", "--data", "d", "--output", "o", "--steps", "5", "--mesh", "ep2"], "'ep2' is not NAME=SIZE"),
    (["--model", "m", "--data", "d", "--output", "o", "--steps", "5", "--stop-after", "9"], "stop_after must be"),
    (["--model", "m", "--data", "d", "--output", "o", "--steps", "5", "--warmup", "6"], "warmup (6) is longer"),
])
def test_bad_settings_are_one_line_errors(argv, message, capsys):
    assert cli.main(["train", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("xpar-zoo: error: ") and message in err and err.count("\n") == 1


def test_unknown_config_key_names_the_file(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text("model: m\nlearning_rate: 1\n")
    assert cli.main(["train", "--config", str(path)]) == 2
    assert f"{path}: unknown setting 'learning_rate'" in capsys.readouterr().err



def test_example_config_and_slurm_script():
    root = os.path.join(os.path.dirname(__file__), "..", "..", "examples")
    values = read_config_file(os.path.join(root, "qwen3_30b_a3b_8x8_h100.yaml"))
    cfg = TrainConfig(**values)
    from xpar_zoo.train.config import validate

    validate(cfg)
    assert cfg.mesh == {"ep": 64} and cfg.model == "Qwen/Qwen3-30B-A3B" and cfg.mixed_precision
    from xpar_zoo.parallel.mesh import validate_sizes

    validate_sizes(64, cfg.mesh, 1)  # 8 nodes x 8 GPUs; 128 experts split 64 ways
    assert 128 % cfg.mesh["ep"] == 0
    script = os.path.join(root, "train.slurm")
    assert subprocess.run(["bash", "-n", script]).returncode == 0
    assert "--rdzv-backend c10d" in open(script).read()
