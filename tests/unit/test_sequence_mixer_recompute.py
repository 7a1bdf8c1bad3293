"""A hybrid model's sequence mixer under sp/cp runs on the group's whole rows under activation checkpointing: the
same values and gradients as its own forward, and only this rank's input kept for backward (one process: a group of
one rank, where the whole rows are this rank's tokens)."""

import types

import pytest
import torch

from xpar_zoo.errors import PlanError
from xpar_zoo.styles.sequence_layout import token_layout
from xpar_zoo.styles.sequence_masks import _Forward
from xpar_zoo.styles.sequence_mixers import (
    MIXER_RECOMPUTE_ENV,
    _whole_rows_forward,
    mixer_recompute,
)
from xpar_zoo.testing import parity

SEQ = 64


def _gated_delta_net():
    torch.manual_seed(0)
    model = parity.build_model(parity.tiny_config("qwen3_next", attn_implementation="eager", use_cache=False))
    return model.model.layers[0].linear_attn  # a gated delta net (layer 0 is linear attention)


def _wrapped(module, layer=None):
    import inspect

    layout = token_layout(SEQ, 1, 1, 0, 0)
    state = types.SimpleNamespace(sp=1, cp=1, sp_group=None, cp_group=None, sp_rank=0, cp_rank=0,
                                  layout=lambda n: token_layout(n, 1, 1, 0, 0),
                                  current=_Forward(layout.queries, layout.keys, None, None))
    original = module.forward
    return original, _whole_rows_forward(module, state, original, inspect.signature(original), layer)


def _run(forward, hidden):
    out = forward(hidden_states=hidden)
    return out[0] if isinstance(out, tuple) else out


@pytest.mark.parametrize("recompute", ["1", "0"])
def test_the_whole_rows_mixer_equals_its_own_forward_in_values_and_gradients(monkeypatch, recompute):
    monkeypatch.setenv(MIXER_RECOMPUTE_ENV, recompute)
    module = _gated_delta_net()
    original, wrapped = _wrapped(module)
    hidden = torch.randn(2, SEQ, module.hidden_size, requires_grad=True)
    want, got = _run(original, hidden), _run(wrapped, hidden)
    torch.testing.assert_close(got, want)
    grad = torch.randn_like(want)
    params = [p for p in module.parameters() if p.requires_grad]
    for a, w in zip(torch.autograd.grad(got, [hidden, *params], grad), torch.autograd.grad(want, [hidden, *params], grad)):
        torch.testing.assert_close(a, w)


def test_the_whole_rows_mixer_keeps_only_its_input_for_backward(monkeypatch):
    """With the recompute (the default) autograd keeps nothing of the mixer's whole-row activations; without it
    (``XPAR_ZOO_MIXER_RECOMPUTE=0``) it keeps them all, several times the input."""
    module = _gated_delta_net()
    _, wrapped = _wrapped(module)
    hidden = torch.randn(2, SEQ, module.hidden_size, requires_grad=True)
    exclude = (hidden, *module.parameters())
    monkeypatch.delenv(MIXER_RECOMPUTE_ENV, raising=False)
    kept = parity.saved_for_backward_bytes(lambda: _run(wrapped, hidden), exclude=exclude)
    monkeypatch.setenv(MIXER_RECOMPUTE_ENV, "0")
    whole = parity.saved_for_backward_bytes(lambda: _run(wrapped, hidden), exclude=exclude)
    assert whole > 4 * hidden.numel() * 4, whole  # the gated delta net's own saved activations
    assert kept < hidden.numel() * 4 / 2, (kept, whole)  # bookkeeping only: the input itself is excluded


def test_no_second_recompute_inside_a_checkpointed_decoder_layer(monkeypatch):
    """Where the decoder layer is checkpointed (``activation_checkpointing_enable``), its recompute keeps nothing of
    the mixer already: the mixer's own checkpoint would only run it a third time."""
    monkeypatch.delenv(MIXER_RECOMPUTE_ENV, raising=False)
    module = _gated_delta_net()
    layer = types.SimpleNamespace(training=True, gradient_checkpointing=True)
    _, wrapped = _wrapped(module, layer)
    hidden = torch.randn(2, SEQ, module.hidden_size, requires_grad=True)
    kept = parity.saved_for_backward_bytes(lambda: _run(wrapped, hidden), exclude=(hidden, *module.parameters()))
    assert kept > 4 * hidden.numel() * 4, kept  # the mixer ran as is: the layer's checkpoint discards these


def test_the_recompute_switch_is_checked(monkeypatch):
    monkeypatch.setenv(MIXER_RECOMPUTE_ENV, "yes")
    with pytest.raises(PlanError, match="XPAR_ZOO_MIXER_RECOMPUTE='yes': expected 0 or 1"):
        mixer_recompute()
