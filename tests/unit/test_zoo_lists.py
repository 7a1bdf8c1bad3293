"""The zoo's lists: curated architectures (hand-written plans) and automatic ones (proved through the automatic plan) do
not overlap, and no proved type is refused."""

import xpar_zoo
from xpar_zoo.testing.proofs import AUTO_PROVED, proved_architectures
from xpar_zoo.zoo.registry import refused_architectures

CURATED = xpar_zoo.supported_architectures()
PROVED = proved_architectures()
REFUSED = refused_architectures()



def test_the_zoo_has_its_curated_and_automatic_architectures():
    assert len(CURATED) >= 12
    assert all(not xpar_zoo.get_plan(a).auto for a in CURATED)
    assert not set(CURATED) & set(AUTO_PROVED)
    assert not set(PROVED) & set(REFUSED)
