"""A hybrid model's sequence mixer under sp/cp runs on the group's whole rows under activation checkpointing: the
same values and gradients as its own forward, and only this rank's input kept for backward (one process: a group of
one rank, where the whole rows are this rank's tokens)."""

import types

import pytest
import torch

from xpar_zoo.parallel.options import ParallelOptions
from xpar_zoo.styles.sequence_layout import token_layout
from xpar_zoo.styles.sequence_masks import SequenceForward
from xpar_zoo.styles.sequence_mixers import _whole_rows_forward
from xpar_zoo.testing import parity

SEQ = 64


def _gated_delta_net():
    torch.manual_seed(0)
    model = parity.build_model(parity.tiny_config("qwen3_next", attn_implementation="eager", use_cache=False))
    return model.model.layers[0].linear_attn  # a gated delta net (layer 0 is linear attention)


def _wrapped(module, layer=None, recompute=True):
    import inspect

    layout = token_layout(SEQ, 1, 1, 0, 0)
    state = types.SimpleNamespace(sp=1, cp=1, sp_group=None, cp_group=None, sp_rank=0, cp_rank=0,
                                  layout=lambda n: token_layout(n, 1, 1, 0, 0),
                                  current=SequenceForward(layout.queries, layout.keys, None, None, layout.local),
                                  options=ParallelOptions(mixer_recompute=recompute))
    original = module.forward
    return original, _whole_rows_forward(module, state, original, inspect.signature(original), layer)


def _run(forward, hidden):
    out = forward(hidden_states=hidden)
    return out[0] if isinstance(out, tuple) else out


@pytest.mark.parametrize("recompute", [True, False])
def test_the_whole_rows_mixer_equals_its_own_forward_in_values_and_gradients(recompute):
    module = _gated_delta_net()
    original, wrapped = _wrapped(module, recompute=recompute)
    hidden = torch.randn(2, SEQ, module.hidden_size, requires_grad=True)
    want, got = _run(original, hidden), _run(wrapped, hidden)
    torch.testing.assert_close(got, want)
    grad = torch.randn_like(want)
    params = [p for p in module.parameters() if p.requires_grad]
    for a, w in zip(torch.autograd.grad(got, [hidden, *params], grad), torch.autograd.grad(want, [hidden, *params], grad)):
        torch.testing.assert_close(a, w)


def test_the_whole_rows_mixer_keeps_only_its_input_for_backward():
    """With the recompute (the default) autograd keeps nothing of the mixer's whole-row activations; without it
    (``ParallelOptions(mixer_recompute=False)``) it keeps them all, several times the input."""
    module = _gated_delta_net()
    (_, wrapped), (_, keeping) = _wrapped(module), _wrapped(module, recompute=False)
    hidden = torch.randn(2, SEQ, module.hidden_size, requires_grad=True)
    exclude = (hidden, *module.parameters())
    kept = parity.saved_for_backward_bytes(lambda: _run(wrapped, hidden), exclude=exclude)
    whole = parity.saved_for_backward_bytes(lambda: _run(keeping, hidden), exclude=exclude)
    assert whole > 4 * hidden.numel() * 4, whole  # the gated delta net's own saved activations
    assert kept < hidden.numel() * 4 / 2, (kept, whole)  # bookkeeping only: the input itself is excluded


def test_no_second_recompute_inside_a_checkpointed_decoder_layer():
    """Where the decoder layer is checkpointed (``activation_checkpointing_enable``), its recompute keeps nothing of
    the mixer already: the mixer's own checkpoint would only run it a third time."""
    module = _gated_delta_net()
    layer = types.SimpleNamespace(training=True, gradient_checkpointing=True)
    _, wrapped = _wrapped(module, layer)
    hidden = torch.randn(2, SEQ, module.hidden_size, requires_grad=True)
    kept = parity.saved_for_backward_bytes(lambda: _run(wrapped, hidden), exclude=(hidden, *module.parameters()))
    assert kept > 4 * hidden.numel() * 4, kept  # the mixer ran as is: the layer's checkpoint discards these
