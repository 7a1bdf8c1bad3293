"""``xpar-zoo list``: prints every proved and refused architecture, and ``--markdown`` is the checked-in
MODEL_CARDS.md."""

import pathlib

import pytest

import xpar_zoo
from xpar_zoo.commands import cli
from xpar_zoo.commands.model_cards import render
from xpar_zoo.testing.proofs import proved_architectures
from xpar_zoo.zoo.registry import refused_architectures

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def markdown():
    return render()


def test_list_markdown_equals_the_checked_in_model_cards(capsys, markdown):
    assert cli.main(["list", "--markdown"]) == 0
    out = capsys.readouterr().out
    assert out == markdown
    assert (ROOT / "MODEL_CARDS.md").read_text() == out, (
        "MODEL_CARDS.md is stale: run `xpar-zoo list --markdown > MODEL_CARDS.md`")



def test_list_prints_every_proved_and_refused_architecture(capsys):
    assert cli.main(["list"]) == 0
    out = capsys.readouterr().out
    assert all(m in out for m in proved_architectures())
    assert all(f"{m}" in out and reason in out for m, reason in refused_architectures().items())
    assert all(m in out for m in xpar_zoo.supported_architectures())
