"""The registry: an unknown architecture is refused listing the supported ones; qwen3_moe is listed with its ep plan."""

import pytest

import xpar_zoo


def test_unknown_architecture_lists_the_supported_ones():
    with pytest.raises(xpar_zoo.UnknownArchitectureError, match="no xpar_zoo plan for model_type 'nope'.*qwen3_moe"):
        xpar_zoo.get_plan("nope")



def test_registry_lists_qwen3_moe_with_its_ep_plan():
    assert "qwen3_moe" in xpar_zoo.supported_architectures()
    plan = xpar_zoo.get_plan("qwen3_moe")
    assert plan.extra["ep"].style == "experts"
    with pytest.raises(TypeError):
        plan.extra["x"] = plan.extra["ep"]  # plans are immutable values
