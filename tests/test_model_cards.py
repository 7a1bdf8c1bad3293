"""MODEL_CARDS.md is generated from the registry and the zoo's proofs, and the checked-in copy is current."""

import pathlib

import xpar_zoo
from xpar_zoo import cli
from xpar_zoo.model_cards import render
from xpar_zoo.testing.proofs import AUTO_PROVED, describe_mesh, proof_meshes

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_list_markdown_equals_the_checked_in_model_cards(capsys):
    assert cli.main(["list", "--markdown"]) == 0
    out = capsys.readouterr().out
    assert out == render()
    assert (ROOT / "MODEL_CARDS.md").read_text() == out, (
        "MODEL_CARDS.md is stale: run `xpar-zoo list --markdown > MODEL_CARDS.md`")


def test_every_architecture_has_a_card_with_its_plans_and_proved_meshes():
    text = render()
    for model_type in xpar_zoo.supported_architectures() + sorted(AUTO_PROVED):
        assert f"## {model_type} (" in text
        for mesh in proof_meshes(model_type).values():
            assert describe_mesh(mesh) in text
    assert "## dots1 (automatic plan)" in text


def test_list_prints_every_curated_architecture(capsys):
    assert cli.main(["list"]) == 0
    out = capsys.readouterr().out
    assert all(m in out for m in xpar_zoo.supported_architectures())
