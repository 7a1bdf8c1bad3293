"""Short-range sequence mixing inside attention under sp/cp: projections whose output at a position depends on the
few tokens before it (zaya's CCA projection: causal convolutions over the query and key projections, and a value
half taken from the previous token; inkling's short convolutions; inkling2's dynamic ones, whose taps are projected
per token from a second input), with the real transformers module.

**How it runs.** The module's ``forward`` is wrapped (:func:`install_halo_projections`): the hidden states of the
sequence group are all-gathered in row order (as for the whole-row mixers of
:mod:`xpar_zoo.styles.sequence_mixers`), and the module runs once per run of this rank's consecutive positions (cp's
head and tail chunks) on that run preceded by a *halo* of the tokens before it, as many as its receptive field
(its convolutions' ``conv_kernel_size`` and the one delayed token); the halo's outputs are dropped. Every
sequence input of the module (the parameters before ``cache``: ``hidden_states``, and inkling2's ``dynamic_input``)
is gathered and cut the same way. Each output of
this rank's tokens then sees exactly the inputs it sees in one process (the row's first tokens see the module's own
zero padding), and the module's compute is not repeated over the group: a rank computes its tokens and the halo.
The padding mask the module zeroes padded inputs with is the whole rows' (kept by the sp/cp forward). Packed rows:
single-process transformers' convolution does not see documents packed by ``position_ids`` (it runs over the whole
row), and neither does this one. The gather's backward sums each token's gradient over the group, so the halo's
contributions reach their owners.
"""

from __future__ import annotations

import functools
import inspect

import torch
from torch import nn

from ..errors import ModelStateError
from .sequence_mixers import MODULE_REASONS, decoder_layers, gather_rows_in_order

# The forward parameters of a halo projection (zaya's ZayaCCAProjection contract): its sequence inputs, the first
# ``hidden_states``, then these two.
HALO_PARAMETERS = ("cache", "conv_mask")
# Layer types whose layers' attention holds a halo projection (zaya).
HALO_LAYER_TYPES = frozenset({"hybrid", "hybrid_sliding"})


# Halo modules by class-name suffix: how many tokens before a position its output there reads, from its kernel.
HALO_CLASSES = {
    "CCAProjection": lambda kernel: kernel + 1,  # zaya: convolutions of conv_kernel_size taps, a value delayed a token
    "ShortConvolution": lambda kernel: kernel - 1,  # inkling(2): a causal convolution of conv_kernel_size taps
}


def sequence_inputs(cls: type) -> tuple[str, ...]:
    """The sequence inputs of a halo projection class: the parameters of its ``forward`` before
    :data:`HALO_PARAMETERS`, the first ``hidden_states`` (empty: not that contract)."""
    params = list(inspect.signature(cls.forward).parameters)[1:]
    if not params or params[0] != "hidden_states" or HALO_PARAMETERS[0] not in params:
        return ()
    at = params.index(HALO_PARAMETERS[0])
    return tuple(params[:at]) if params[at:at + len(HALO_PARAMETERS)] == list(HALO_PARAMETERS) else ()


def halo_tokens(module: nn.Module) -> int | None:
    """How many tokens before a position the output of ``module`` at that position reads, or ``None`` for a module
    that is not a halo projection: a class of :data:`HALO_CLASSES` with an integer ``conv_kernel_size`` whose
    ``forward`` takes its sequence inputs then ``(cache, conv_mask)`` (:func:`sequence_inputs`)."""
    cls = type(module)
    kernel = getattr(module, "conv_kernel_size", None)
    reach = next((f for suffix, f in HALO_CLASSES.items() if cls.__name__.endswith(suffix)), None)
    if reach is None or not isinstance(kernel, int):
        return None
    return reach(kernel) if sequence_inputs(cls) else None


def halo_projections(model: nn.Module) -> dict[str, nn.Module]:
    """``{name: module}`` of the halo projections of ``model`` (see :func:`halo_tokens`)."""
    return {name: m for name, m in model.named_modules() if halo_tokens(m) is not None}


def served_halo_layer_types(model: nn.Module, config, served: frozenset[int] = frozenset()) -> frozenset[str]:
    """The layer types of ``config.layer_types`` whose every layer holds a halo projection: attention through the
    ``AttentionInterface`` after it, so the sp/cp attention serves them. A layer that also holds a module of
    :data:`~xpar_zoo.styles.sequence_mixers.MODULE_REASONS` (a relative-position bias) is served only where that
    module is in ``served`` (ids of the modules another sp/cp style serves)."""
    types = list(getattr(config, "layer_types", None) or ())
    layers = decoder_layers(model)
    if len(layers) != len(types):
        return frozenset()
    found: dict[str, bool] = {}
    for layer, kind in zip(layers, types):
        if kind in HALO_LAYER_TYPES:
            unserved = any(id(m) not in served and any(f in type(m).__name__ for f in MODULE_REASONS)
                           for m in layer.modules())
            found[kind] = (found.get(kind, True) and not unserved
                           and any(halo_tokens(m) is not None for m in layer.modules()))
    return frozenset(k for k, ok in found.items() if ok)


def _runs(batch, state, seq_len: int) -> list[tuple[int, int, int]]:
    """This rank's tokens as runs of consecutive positions: ``[(first local index, first position, count)]``,
    once per forward."""
    if batch.cache.halo_runs is None:
        positions = (batch.local if batch.local is not None else state.layout(seq_len).local).tolist()
        runs, start = [], 0
        for i in range(1, len(positions) + 1):
            if i == len(positions) or positions[i] != positions[i - 1] + 1:
                runs.append((start, positions[start], i - start))
                start = i
        batch.cache.halo_runs = runs
    return batch.cache.halo_runs


def _halo_forward(module: nn.Module, state, original, halo: int):
    signature, inputs = inspect.signature(original), sequence_inputs(type(module))

    @functools.wraps(original)
    def forward(*args, **kwargs):
        batch = state.current
        if batch is None:
            raise ModelStateError(f"{type(module).__name__} (sp/cp halo projection) ran outside a forward of the "
                                  "parallelized model")
        bound = signature.bind(*args, **kwargs)
        cache = bound.arguments.get("cache")
        if cache is not None and not getattr(cache, "row_positions", False):  # (an sp/cp row cache: no state)
            raise ModelStateError("sp/cp: a KV cache reached a convolutional projection; generate without sp/cp")
        seq_len = batch.keys.numel()
        whole = {name: gather_rows_in_order(bound.arguments[name], state, batch) for name in inputs
                 if isinstance(bound.arguments.get(name), torch.Tensor)}
        valid = batch.key_valid
        parts = []
        for _, first, n in _runs(batch, state, seq_len):
            lo = max(0, first - halo)
            # each its own storage: the module keeps no view of the whole rows
            bound.arguments.update({name: rows[:, lo:first + n].clone() for name, rows in whole.items()})
            bound.arguments["cache"] = None
            bound.arguments["conv_mask"] = None if valid is None else valid[:, lo:first + n].long()
            out = original(*bound.args, **bound.kwargs)
            parts.append(out[:, first - lo:] if isinstance(out, torch.Tensor) else tuple(t[:, first - lo:]
                                                                                        for t in out))
        if isinstance(parts[0], torch.Tensor):
            return torch.cat(parts, dim=1)
        return tuple(torch.cat(pieces, dim=1) for pieces in zip(*parts))

    return forward


def install_halo_projections(model: nn.Module, state) -> list[str]:
    """Wrap every halo projection of ``model`` to run on this rank's runs with their halos (see the module
    docstring) for ``state``'s sequence group; returns their names."""
    found = halo_projections(model)
    for module in found.values():
        module.forward = _halo_forward(module, state, module.forward, halo_tokens(module))
    return list(found)
