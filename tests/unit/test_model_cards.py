"""MODEL_CARDS.md is generated from the registry and the zoo's proofs, the checked-in copy is current, and every MoE
family of the pinned transformers is either proved or refused (a transformers upgrade shows what is new)."""

import pytest

from xpar_zoo.commands.model_cards import family_status, render
from xpar_zoo.testing.proofs import (
    AUTO_PROVED,
    describe_mesh,
    proof_meshes,
    proved_architectures,
    transformers_moe_families,
)
from xpar_zoo.zoo.registry import refused_architectures


@pytest.fixture(scope="module")
def markdown():
    return render()



def test_every_moe_family_of_the_pinned_transformers_is_proved_or_refused():
    families = family_status()
    assert len(families) == len(transformers_moe_families()) >= 67
    neither = sorted(f for f, (status, _, _) in families.items() if status == "neither")
    assert not neither, f"MoE families of this transformers neither proved nor refused: {neither}"
    assert sum(status == "proved" for status, _, _ in families.values()) >= 55


def test_every_proved_and_refused_type_belongs_to_transformers():
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    assert set(proved_architectures()) | set(refused_architectures()) <= set(CONFIG_MAPPING_NAMES)


def test_every_architecture_has_a_card_with_its_plans_meshes_and_refusals(markdown):
    for model_type in proved_architectures():
        assert f"## {model_type} (" in markdown
        for mesh in proof_meshes(model_type).values():
            assert describe_mesh(mesh) in markdown
    for proof in AUTO_PROVED.values():
        for plan, fragment in proof.without.items():
            assert f"Plan `{plan}` refused: " in markdown and fragment in markdown
    for model_type, reason in refused_architectures().items():
        assert f"| {model_type} | {reason.replace('|', chr(92) + '|')} |" in markdown
    assert "## dots1 (automatic plan)" in markdown
