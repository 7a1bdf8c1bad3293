"""``xpar-zoo train --mesh sp=…,cp=…`` (issue 30, item 5): a ``--seq-len`` the sequence group cannot split is one
line and exit 2 at parse time (nothing is read, no rank started, no model loaded), from flags and YAML alike; the
YAML mapping ``mesh: {sp: 2, ep: 2}`` is read as the flag ``--mesh sp=2,ep=2``; the step reads
``world/(sp·cp)`` data parts. The launched runs: ``tests/distributed/test_long_context_training.py``."""

import re

import pytest

from xpar_zoo.commands import cli
from xpar_zoo.train import TrainConfig, read_config_file
from xpar_zoo.train.config import parse_mesh, validate
from xpar_zoo.train.inputs import data_parts

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


def _tiny_config(**overrides):
    from xpar_zoo.testing import parity

    return parity.tiny_config("qwen3_moe", **overrides)


def test_sequence_sizes_are_checked_with_the_sizers_rules_before_the_model_loads():
    from xpar_zoo.errors import MeshError, PlanError
    from xpar_zoo.train.inputs import check_mesh

    def cfg(mesh, **kw):
        return TrainConfig(model="m", data="d", output="o", steps=1, seq_len=64, mesh=mesh, **kw)

    config = _tiny_config()
    check_mesh(cfg({"sp": 2, "ep": 2}), config, 4)  # sp and cp are not plan names: accepted beside the plans
    check_mesh(cfg({"cp": 2, "sp": 2}, attn_implementation="eager"), config, 8)
    heads = config.num_attention_heads
    with pytest.raises(PlanError, match=f"sp={2 * heads} does not divide the {heads} query heads"):
        check_mesh(cfg({"sp": 2 * heads}), config, 2 * heads)
    with pytest.raises(MeshError, match="sp=2 does not divide the ranks of a replica"):
        check_mesh(cfg({"sp": 2}), config, 3)
    with pytest.raises(MeshError, match="needs several ranks, and this is one process"):
        check_mesh(cfg({"sp": 2}), config, 1)
    check_mesh(cfg({"sp": 2}, attn_implementation="flex_attention"), config, 2)  # served under sp/cp, sized
    with pytest.raises(PlanError, match=re.escape("attention 'paged|sdpa' is not one of")):
        check_mesh(cfg({"sp": 2}, attn_implementation="paged|sdpa"), config, 2)


def test_dry_run_reads_one_data_part_per_sequence_group(tmp_path, capsys, monkeypatch):
    data = tmp_path / "tokens.jsonl"
    data.write_text("".join(f'{{"input_ids": {list(range(1, 60))}}}\n' for _ in range(40)))
    monkeypatch.setenv("WORLD_SIZE", "8")
    argv = ["train", "--model", "tiny-qwen3-moe", "--data", str(data), "--output", str(tmp_path / "never"),
            "--steps", "2", "--seq-len", "64", "--micro-batch", "2", "--mesh", "sp=2,cp=2,ep=2", "--dry-run"]
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    assert "mesh: sp=2, cp=2, ep=2 over 8 ranks" in text
    assert "rows of 64 per epoch; 4 rows per step" in text  # 8 ranks / (sp·cp) = 2 parts x 2 rows


def _listed_after(text: str, phrase: str) -> tuple[str, ...]:
    """The backticked names listed right after ``phrase`` (``a``, ``b`` (note), ``c`` or ``d``)."""
    rest = " ".join(text.split(phrase, 1)[1].split())
    return tuple(re.findall(r"`([a-z0-9_]+)`", re.match(r"(?:\s*(?:,|or|\(transformers' default\),?)?\s*`[a-z0-9_]+`)+",
                                                         rest).group(0)))


def test_both_docs_list_the_inner_attentions_the_sp_cp_wrapper_serves():
    from pathlib import Path

    from xpar_zoo.styles.sequence import INNER_IMPLEMENTATIONS

    docs = Path(__file__).resolve().parents[2] / "docs"
    assert _listed_after((docs / "training.md").read_text(), "the sp/cp attention wraps (") == INNER_IMPLEMENTATIONS
    assert _listed_after((docs / "long_context.md").read_text(), "one the wrapper serves:") == INNER_IMPLEMENTATIONS
