"""Attention whose bias and query scaling come from the positions of the tokens it is given, under sp/cp (inkling,
inkling2: a relative-position bias ``[b, heads, q, k]`` over query-key distances, and queries log-scaled by their
position), with the real transformers module.

**What transformers does.** ``InklingAttention`` takes the positions of its queries and keys from its cache
(``q_offset = cache.get_query_offset(layer)``, ``kv_length, kv_offset = cache.get_mask_sizes(q, layer)``, the
keys from ``cache.update``), else ``arange`` of the tokens it is given, and builds from them the dense
relative-position bias (``rel_logits_proj``) and the log-scaling of its queries, then calls the attention function
with the bias as ``position_bias``. ``Inkling2*Attention`` is handed the distances instead (``relative_distance``,
which its model computes once per forward with its module's ``get_relative_distance(inputs_embeds, cache,
is_sliding)`` from the same cache protocol) and reads the keys from ``cache.update``.

**Under sp/cp** (:func:`install_positioned_attention`): the module's ``forward`` is handed a *row cache*
(:class:`RowPositions`, stateless) through that protocol: its queries' offsets are the global row positions of this
rank's tokens, its keys are the whole row's (``update`` all-gathers this rank's keys and values over the sequence
group, in row order) at row positions ``0 … S-1``. The module's own code then builds the bias of this rank's queries
against every key of the row, and scales its queries by their row positions, exactly as one process. The sp/cp
attention sees the call was served so (:func:`takes_row_keys`) and runs the inner attention of this rank's queries,
all heads, against the whole row's keys (no all-to-all: the bias and the queries stay this rank's) under the global
mask of those positions. A module given its distances gets them from its own module's ``get_relative_distance``
called with the row cache (this rank's row positions against the whole row's), in place of the model's (:func:`row_attention`: causal, window, packed documents, padding; the whole mask, built once
per forward and shared by the layers: the bias transformers materialises is already ``[b, heads, S/(sp·cp), S]``).
The gather's backward sums the keys' and values' gradients over the group into their owners.
"""

from __future__ import annotations

import functools
import inspect
import sys

import torch
from torch import nn

from ..errors import ModelStateError
from ..zoo.forward_source import forward_source
from .sequence_masks import SequenceForward, current_forward
from .sequence_mixers import gather_rows_in_order

# What the attention's forward reads from its cache to place its queries and keys, and the modules of its bias.
CACHE_POSITIONS = ("get_query_offset", "get_mask_sizes", "cache.update(", "ALL_ATTENTION_FUNCTIONS")
BIAS_SUFFIXES = ("RelativeLogits", "RelativePositionBias")
# The parameter of an attention handed its query-key distances, and the function of its modeling module that
# computes them from the cache protocol (inkling2: ``get_relative_distance(inputs_embeds, cache, is_sliding)``).
DISTANCES = "relative_distance"
DISTANCE_FUNCTION = "get_relative_distance"
GIVEN_POSITIONS = ("cache.update(", "ALL_ATTENTION_FUNCTIONS")


def distance_function(cls: type):
    """The modeling module's function that computes the distances ``cls``'s forward is handed, or ``None``."""
    return getattr(sys.modules.get(cls.__module__), DISTANCE_FUNCTION, None)


def is_positioned_attention(module: nn.Module) -> bool:
    """Whether ``module`` is attention the row cache serves: it holds a relative-position bias module, its forward
    takes a ``cache`` argument and reads its keys through it, and its positions too (:data:`CACHE_POSITIONS`) or
    it is handed its distances (:data:`DISTANCES`) that its modeling module computes from the cache protocol
    (:data:`DISTANCE_FUNCTION`)."""
    cls = type(module)
    params = inspect.signature(cls.forward).parameters
    if "cache" not in params or not any(type(m).__name__.endswith(BIAS_SUFFIXES) for m in module.children()):
        return False
    source = forward_source(cls.forward)
    if DISTANCES in params:
        return all(p in source for p in GIVEN_POSITIONS) and callable(distance_function(cls))
    return all(p in source for p in CACHE_POSITIONS)


def positioned_attention_modules(model: nn.Module) -> dict[str, nn.Module]:
    """``{name: attention module}`` of the attention modules of ``model`` the row cache serves."""
    return {name: m for name, m in model.named_modules() if is_positioned_attention(m)}


def served_bias_modules(model: nn.Module) -> frozenset[int]:
    """The ids of the relative-position bias modules of the served attention modules of ``model``."""
    return frozenset(id(m) for a in positioned_attention_modules(model).values() for m in a.children()
                     if type(m).__name__.endswith(BIAS_SUFFIXES))


class RowPositions:
    """The stateless cache a positioned attention module is handed under sp/cp: its queries at this rank's row
    positions, its keys the whole row's (gathered in row order)."""

    row_positions = True  # an sp/cp row cache (the halo projections accept it: it holds no state)
    is_sliding = ()  # no cache layers: transformers' distance and mask helpers read their sizes from layer 0

    def __init__(self, state, batch: SequenceForward, module: nn.Module) -> None:
        self.state, self.batch, self.module = state, batch, module

    def get_query_offset(self, layer_idx: int) -> torch.Tensor:
        local = self.batch.local
        return local - torch.arange(local.numel(), device=local.device)

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        return self.batch.keys.numel(), 0

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        self.batch.cache.row_keys.add(id(self.module))
        return tuple(gather_rows_in_order(t.transpose(1, 2), self.state, self.batch).transpose(1, 2)
                     for t in (key, value))


def _positioned_forward(module: nn.Module, state, original, signature: inspect.Signature):
    @functools.wraps(original)
    def forward(*args, **kwargs):
        batch = current_forward(state, f"{type(module).__name__} (sp/cp positioned attention)")
        bound = signature.bind(*args, **kwargs)
        if bound.arguments.get("cache") is not None:
            raise ModelStateError("sp/cp: a KV cache reached the attention; generate on a mesh without sp/cp")
        cache = bound.arguments["cache"] = RowPositions(state, batch, module)
        if DISTANCES in bound.arguments:
            hidden = bound.arguments["hidden_states"]
            bound.arguments[DISTANCES] = distance_function(type(module))(
                hidden, cache, bool(getattr(module, "is_sliding", False)))
        return original(*bound.args, **bound.kwargs)

    return forward


def install_positioned_attention(model: nn.Module, state) -> list[str]:
    """Wrap every positioned attention module of ``model`` to run with a :class:`RowPositions` cache for ``state``'s
    sequence group (a :class:`~xpar_zoo.styles.sequence.SequenceParallel`); returns their names."""
    found = positioned_attention_modules(model)
    for module in found.values():
        original = module.forward
        module.forward = _positioned_forward(module, state, original, inspect.signature(original))
    return list(found)


def takes_row_keys(state, module: nn.Module) -> bool:
    """Whether ``module``'s attention call got the whole row's keys from a :class:`RowPositions` cache."""
    keys = current_forward(state, "sp/cp attention").cache.row_keys
    if id(module) not in keys:
        return False
    keys.discard(id(module))
    return True


def _row_forward(batch: SequenceForward) -> SequenceForward:
    """``batch`` with this rank's tokens as the queries and the whole row in row order as the keys (per forward)."""
    if batch.cache.row_forward is None:
        keys = torch.arange(batch.keys.numel(), device=batch.keys.device)
        batch.cache.row_forward = SequenceForward(batch.local, keys, batch.docs, batch.key_valid, batch.local)
    return batch.cache.row_forward


def row_attention(state, module: nn.Module, query, key, value, dropout: float, scaling, window, kwargs: dict
                  ) -> torch.Tensor:
    """The inner attention of this rank's queries (``[b, H, S/(sp·cp), d]``, all heads) against the whole row's keys
    and values (``[b, kv, S, d]``, row order) under the global mask of their positions, the module's other arguments
    (its ``position_bias``) passed on: ``[b, S/(sp·cp), H, dv]``."""
    batch = _row_forward(current_forward(state, "sp/cp attention"))
    state.paths["row_keys"] += 1
    call = state.inner_call(module, {}, dropout, scaling, window, kwargs)
    return call(query, key, value, batch.mask(bool(getattr(module, "is_causal", True)), window, query.dtype))


# Attention over each token's own earlier layer states (inkling2's block and message residuals: the states of one
# token are its keys, its tokens the "heads" of the call), by class-name suffix: no token sees another.
DEPTH_SUFFIXES = ("AttentionResidual",)


def is_depth_attention(module: nn.Module) -> bool:
    """Whether ``module``'s attention calls mix each token's own layer states only (not causal, a class of
    :data:`DEPTH_SUFFIXES`): the sp/cp attention runs them as they are, on this rank's tokens."""
    return type(module).__name__.endswith(DEPTH_SUFFIXES) and getattr(module, "is_causal", True) is False
