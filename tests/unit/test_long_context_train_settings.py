"""``xpar-zoo train --mesh sp=…,cp=…`` (issue 30, item 5): a ``--seq-len`` the sequence group cannot split is one
line and exit 2 at parse time (nothing is read, no rank started, no model loaded), from flags and YAML alike; the
YAML mapping ``mesh: {sp: 2, ep: 2}`` is read as the flag ``--mesh sp=2,ep=2``; the step reads
``world/(sp·cp)`` data parts. The launched runs: ``tests/distributed/test_long_context_training.py``."""

import pytest

from xpar_zoo.commands import cli
from xpar_zoo.train import TrainConfig, read_config_file
from xpar_zoo.train.config import parse_mesh, validate
from xpar_zoo.train.loop import data_parts

BASE = ["--model", "missing-model-dir", "--data", "missing.jsonl", "--output", "o", "--steps", "5"]


def _one_line_error(argv, capsys) -> str:
    assert cli.main(["train", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("xpar-zoo: error: ") and err.count("\n") == 1, err
    return err


@pytest.mark.parametrize("mesh, seq_len, needed", [
    ("sp=4", "30", "sp=4"),
    ("sp=4,cp=2,ep=8", "131076", "2·cp·sp = 2·2·4 = 16"),
    ("cp=2", "6", "2·cp·sp = 2·2·1 = 4"),
])
def test_seq_len_the_sequence_group_cannot_split_is_one_line_at_parse_time(mesh, seq_len, needed, capsys):
    err = _one_line_error([*BASE, "--mesh", mesh, "--seq-len", seq_len], capsys)
    assert f"--seq-len {seq_len} with --mesh" in err and f"does not divide by {needed}" in err, err


def test_yaml_sequence_mesh_is_the_flags_and_checked_the_same(tmp_path, capsys):
    (tmp_path / "run.yaml").write_text("mesh: {sp: 2, ep: 2}\nseq_len: 32\n")
    values = read_config_file(tmp_path / "run.yaml")
    assert values["mesh"] == parse_mesh("sp=2,ep=2") == {"sp": 2, "ep": 2}
    validate(TrainConfig(model="m", data="d", output="o", steps=1, **values))  # 32 divides by sp=2
    (tmp_path / "odd.yaml").write_text("mesh: {sp: 2, cp: 2}\nseq_len: 36\n")
    err = _one_line_error([*BASE, "--config", str(tmp_path / "odd.yaml")], capsys)
    assert "--seq-len 36 with --mesh sp=2,cp=2: sequence length 36 does not divide by 2·cp·sp = 2·2·2 = 8" in err


@pytest.mark.parametrize("mesh, world, parts", [({}, 8, 8), ({"ep": 8}, 8, 8), ({"sp": 4, "cp": 2, "ep": 8}, 8, 1),
                                               ({"sp": 2, "ep": 2}, 4, 2), ({"cp": 2, "replicate": 2}, 8, 4)])
def test_a_step_reads_one_data_part_per_sequence_group(mesh, world, parts):
    assert data_parts(TrainConfig(model="m", data="d", output="o", steps=1, mesh=mesh), world) == parts
