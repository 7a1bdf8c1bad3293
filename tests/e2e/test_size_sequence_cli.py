"""``xpar-zoo size MODEL --world N --sp S --cp C --seq L``: the activation memory per rank of a sequence group, and
impossible sizes as one line (exit 2, no traceback) before any model is built."""

import json

import pytest

from xpar_zoo.commands import cli


def _run(capsys, *argv):
    rc = cli.main(["size", "qwen3_moe", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_size_reports_tokens_per_rank_and_the_eager_scores(capsys, monkeypatch):
    """eager keeps its ``seq²`` scores where they fit the block budget (raised here by ``--attention-block-mib``,
    which wins over ``XPAR_ZOO_ATTENTION_BLOCK_MIB``), and none beyond it, where the sp/cp attention runs a block of
    queries at a time (the default budget at this length)."""
    argv = ("--world", "8", "--sp", "2", "--cp", "2", "--ep", "2", "--seq", "32768", "--attention", "eager")
    monkeypatch.setenv("XPAR_ZOO_ATTENTION_BLOCK_MIB", "1")
    rc, out, _ = _run(capsys, *argv, "--attention-block-mib", "1000000")
    assert rc == 0
    assert "mesh {'world': 8, 'replicate': 1, 'ep': 2, 'sp': 2, 'cp': 2}" in out
    assert "8192 tokens per rank outside attention" in out
    for row in ("activations (estimate)", "attention scores (eager, seq²)", "all_to_all (sp: sequence <-> heads)",
                "all_to_all (cp: keys/values gathered)"):
        assert row in out, row
    monkeypatch.delenv("XPAR_ZOO_ATTENTION_BLOCK_MIB")
    rc, blocked, _ = _run(capsys, *argv)
    assert rc == 0 and "attention scores (eager, seq²)" not in blocked and "activations (estimate)" in blocked


def test_size_takes_the_parallel_option_flags_of_train():
    """``xpar-zoo size`` and ``xpar-zoo train`` take the same ParallelOptions flags, to the same settings."""
    from xpar_zoo.train.config import given_options

    flags = ["--attention-block-mib", "8", "--cp-attention", "dense", "--no-mixer-recompute", "--cpu-collectives",
             "gloo"]
    size = cli.build_parser().parse_args(["size", "qwen3_moe", "--world", "2", *flags])
    train = cli.build_parser().parse_args(["train", *flags])
    want = dict(attention_block_mib=8.0, cp_attention="dense", mixer_recompute=False, cpu_collectives="gloo")
    assert given_options(size) == given_options(train) == want


def test_size_json_has_the_tokens_per_rank(capsys):
    rc, out, _ = _run(capsys, "--world", "4", "--cp", "4", "--seq", "8192", "--json")
    assert rc == 0
    (est,) = json.loads(out)
    assert est["mesh"]["cp"] == 4 and est["tokens_per_rank"] == 2048
    assert "attention scores (eager, seq²)" not in est["memory"]  # sdpa keeps no scores


@pytest.mark.parametrize("argv,message", [
    (["--world", "8", "--sp", "64"], "sp=64 does not divide the ranks of a replica (8"),
    (["--world", "64", "--sp", "64"], "sp=64 does not divide the 32 query heads of qwen3_moe; use sp=32, cp=2"),
    (["--world", "8", "--sp", "3"], "sp=3 does not divide the ranks of a replica (8"),
    (["--world", "8", "--sp", "4", "--cp", "2", "--seq", "1000"], "sequence length 1000 does not divide by 2·cp·sp"),
])
def test_impossible_sizes_are_one_line(capsys, argv, message):
    rc, out, err = _run(capsys, *argv)
    assert rc == 2 and message in err and err.count("\n") == 1 and "Traceback" not in err, err
    assert out == ""
