"""Compressed attention under sp/cp (deepseek_v4's compressed sparse and heavily compressed layers), with the real
transformers modules.

**What transformers does.** A compressed layer's attention module holds a *compressor* (``self_attn.compressor``):
it projects the tokens it is given (``kv_proj``, ``gate_proj``), pools each window of ``compress_rate`` tokens into
one compressed entry (gated softmax, a norm, RoPE at the window's row position) and returns the entries with a
per-query causal bias over them ``[b, 1, q, entries]`` (in CSA layers the bias also keeps only the top-k entries its
own *indexer* picks per query: the indexer pools the tokens the same way and scores each query against the
entries). The attention module concatenates the entries after its own keys (``K = V``) and the bias after its 4-D
mask (when the model passes one) and calls the attention function.

**Under sp/cp** (:func:`install_compressors`): the compressor's and its indexer's window projections (``kv_proj``
and ``gate_proj``, :data:`PROJECTIONS`) return the group's whole rows, all-gathered in row order, so the module's
own code pools the same windows as one process on the whole row, while its queries (``q_residual``, the indexer's
query projection and weights, the causal bias from ``position_ids``) stay this rank's tokens: each rank's bias rows,
and its indexer's scores and top-k, are those of one process for its queries. The compressor's ``forward`` is
wrapped to record how many entries it appended and which of them each query may see (its bias, as a boolean) for
the sp/cp attention (:func:`split_compressed`), which takes them off the keys it is handed, gathers and exchanges
only the tokens' keys (sp, cp), puts the entries (identical on every rank) back after the whole row's keys for its
local heads, and masks them per query on top of the global mask of the tokens (:func:`compressed_forward`:
the whole mask where it fits the block budget, else a block of queries at a time). The gather's backward sums the
projections' gradients over the group into each token's owner, and each rank's entries get the gradients of its own
queries only, so the sums over the ranks are the single-process gradients.

**Packed rows:** transformers' compressor is not document-aware (its windows and their bias span the whole row,
the bias judged from each query's ``position_ids``); under sp/cp it runs the same way: the entries leak across
packed documents exactly as in one process, while the tokens' keys never attend across a boundary.
"""

from __future__ import annotations

import functools
import inspect
from typing import cast

import torch
from torch import nn

from ..compat import AttributeView, view_target
from ..errors import ModelStateError
from ..parallel.collectives import gather_rows
from ..parallel.mesh import PlanShard
from .sequence_layout import kv_repeat
from .sequence_masks import SequenceForward, current_forward
from .sequence_mixers import decoder_layers, gather_rows_in_order

# The forward parameters of a compressor (transformers' deepseek_v4 contract), and the projections that read tokens
# for its windows (the compressor's and its indexer's).
COMPRESSOR_PARAMETERS = ("hidden_states", "q_residual", "position_ids", "cache", "layer_idx")
PROJECTIONS = ("kv_proj", "gate_proj")
# Layer types whose attention holds a compressor.
COMPRESSED_LAYER_TYPES = frozenset({"compressed_sparse_attention", "heavily_compressed_attention"})


def _pools_windows(module: nn.Module) -> bool:
    """Whether ``module`` pools windows of ``compress_rate`` tokens from its :data:`PROJECTIONS` (a compressor or a
    compressor's indexer) with the forward of :data:`COMPRESSOR_PARAMETERS`."""
    if not isinstance(getattr(module, "compress_rate", None), int):
        return False
    if not all(isinstance(getattr(module, p, None), nn.Linear) for p in PROJECTIONS):
        return False
    params = list(inspect.signature(type(module).forward).parameters)[1:]
    return params[:len(COMPRESSOR_PARAMETERS)] == list(COMPRESSOR_PARAMETERS)


def is_compressor(module: nn.Module) -> bool:
    """Whether ``module`` is a compressor the sp/cp attention serves: a ``...Compressor`` that pools windows
    (:func:`_pools_windows`), and whose every submodule with a ``compress_rate`` (its indexer) does too."""
    if not type(module).__name__.endswith("Compressor") or not _pools_windows(module):
        return False
    return all(_pools_windows(m) for m in module.modules() if hasattr(m, "compress_rate"))


def compressed_attention_modules(model: nn.Module) -> dict[str, nn.Module]:
    """``{name: attention module}`` of the attention modules of ``model`` that hold a served compressor."""
    return {name: m for name, m in model.named_modules()
            if isinstance(m.__dict__.get("_modules", {}).get("compressor"), nn.Module) and is_compressor(m.compressor)}


def served_compressed_layer_types(model: nn.Module, config) -> frozenset[str]:
    """The layer types of ``config.layer_types`` whose every layer holds a compressed attention module of
    :func:`compressed_attention_modules`."""
    types = list(getattr(config, "layer_types", None) or ())
    layers = decoder_layers(model)
    if len(layers) != len(types):
        return frozenset()
    owners = {id(m) for m in compressed_attention_modules(model).values()}
    served: dict[str, bool] = {}
    for layer, kind in zip(layers, types):
        if kind in COMPRESSED_LAYER_TYPES:
            served[kind] = served.get(kind, True) and any(id(m) in owners for m in layer.modules())
    return frozenset(k for k, ok in served.items() if ok)


# ---- the compressor on the whole row's windows, this rank's queries --------------------------------------------

def _whole_rows_projection(state, original):
    @functools.wraps(original)
    def forward(x: torch.Tensor) -> torch.Tensor:
        batch = current_forward(state, "a compressor's projection (sp/cp)")
        return gather_rows_in_order(original(x), state, batch)

    return forward


def _compressor_forward(attention: nn.Module, state, original, signature: inspect.Signature):
    @functools.wraps(original)
    def forward(*args, **kwargs):
        batch = current_forward(state, f"{type(attention).__name__}'s compressor (sp/cp)")
        if signature.bind(*args, **kwargs).arguments.get("cache") is not None:
            raise ModelStateError("sp/cp: a KV cache reached a compressor; generate on a mesh without sp/cp")
        entries, bias = original(*args, **kwargs)
        allowed = None if bias is None else bias[:, 0] > float("-inf")  # [b, q, entries]: which a query may see
        batch.cache.compressed[id(attention)] = (entries.shape[2], allowed)
        return entries, bias

    return forward


def install_compressors(model: nn.Module, state) -> list[str]:
    """Wrap every compressed attention module of ``model`` for ``state``'s sequence group (a
    :class:`~xpar_zoo.styles.sequence.SequenceParallel`): its compressor's and indexer's window projections return
    the whole rows, and the compressor records its entries for :func:`split_compressed`. Returns the attention
    modules' names."""
    found = compressed_attention_modules(model)
    for attention in found.values():
        compressor = attention.compressor
        for pooling in (m for m in compressor.modules() if hasattr(m, "compress_rate")):
            for name in PROJECTIONS:
                projection = getattr(pooling, name)
                projection.forward = _whole_rows_projection(state, projection.forward)
        original = compressor.forward
        compressor.forward = _compressor_forward(attention, state, original, inspect.signature(original))
    return list(found)


# ---- the attention over the tokens and the entries -------------------------------------------------------------

Entries = tuple[torch.Tensor, torch.Tensor, "torch.Tensor | None"]  # (keys, values, which a query may see)


def split_compressed(state, module: nn.Module, key: torch.Tensor, value: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, Entries | None]:
    """The tokens' keys and values of ``module``'s attention call (``[b, kv, s, d]``) and the compressed entries its
    compressor appended after them (``[b, kv, entries, d]`` each, with the boolean ``[b, s, entries]`` of which this
    rank's queries may see), or ``None`` for an attention without a compressor."""
    compressor = module._modules.get("compressor") if isinstance(module, nn.Module) else None
    if compressor is None or not is_compressor(compressor):
        return key, value, None
    recorded = current_forward(state, "sp/cp attention").cache.compressed.pop(id(module), None)
    if recorded is None:
        raise ModelStateError(f"sp/cp: {type(module).__name__}'s compressor did not run before its attention")
    count, allowed = recorded
    if count == 0:
        return key, value, None
    return key[:, :, :-count], value[:, :, :-count], (key[:, :, -count:], value[:, :, -count:], allowed)


def _local_heads(t: torch.Tensor, heads: int, state) -> torch.Tensor:
    """``t`` (``[b, kv, n, d]``, the same on every rank) for this rank's heads after sp's all-to-all: key/value
    heads repeated as the tokens' are, then this sp rank's share."""
    if state.sp == 1:
        return t
    repeat = kv_repeat(heads, t.shape[1], state.sp)
    t = t.repeat_interleave(repeat, 1) if repeat > 1 else t
    n = t.shape[1] // state.sp
    return t[:, state.sp_rank * n:(state.sp_rank + 1) * n]


def with_entries(state, batch: SequenceForward, entries: Entries, heads: int, key: torch.Tensor,
                 value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, SequenceForward]:
    """The whole row's keys and values (``[b, kv/sp, S, d]``, gathered) with the compressed entries after them for
    this rank's heads (``heads``: the layer's query heads), and ``batch`` seen with the entries' mask
    (:func:`compressed_forward`)."""
    k, v, allowed = entries
    k, v = _local_heads(k, heads, state), _local_heads(v, heads, state)
    view = compressed_forward(state, batch, allowed, k.shape[2])
    return torch.cat([key, k], dim=2), torch.cat([value, v], dim=2), view


def _gather_over_sp(allowed: torch.Tensor, state) -> torch.Tensor:
    """``[b, S/(sp·cp), n]`` of this rank's queries → ``[b, S/cp, n]`` of its cp chunk's (sp rank order)."""
    if state.sp == 1:
        return allowed
    rows = allowed.transpose(0, 1).to(torch.uint8).contiguous()
    shard = PlanShard(state.sp_group, state.sp, state.sp_rank, 0)
    return gather_rows(rows, [rows.shape[0]] * state.sp, shard).transpose(0, 1).bool()


class _Compressed(AttributeView):
    """The forward's masks with ``count`` compressed entries after the whole row's keys: key ``S + j`` is entry
    ``j``, seen by the queries ``allowed`` says (``[b, S/cp, count]``, in the cp chunk's query order; ``None``:
    every query)."""

    def __init__(self, batch: SequenceForward, allowed: torch.Tensor | None, count: int) -> None:
        device = batch.queries.device
        tokens = batch.keys.numel()
        rows = torch.full((tokens,), -1, dtype=torch.long, device=device)
        rows = rows.index_put_((batch.queries,), torch.arange(batch.queries.numel(), device=device))
        keys = torch.cat([batch.keys, torch.arange(tokens, tokens + count, device=device)])
        super().__init__(batch, {"allowed": allowed, "query_rows": rows, "keys": keys, "tokens": tokens,
                                 "count": count})

    def block_mask(self, queries, keys, causal, window, additive_dtype):
        """``[b, 1, len(queries), len(keys)]``; ``keys`` ends with every entry (:meth:`blocks`, :meth:`mask`)."""
        seen = view_target(self).block_mask(queries, keys[:-self.count], causal, window, None)
        if self.allowed is None:
            entries = torch.ones(seen.shape[0], 1, queries.numel(), self.count, dtype=torch.bool,
                                 device=seen.device)
        else:
            entries = self.allowed[:, None, self.query_rows[queries]]
        rows = max(seen.shape[0], entries.shape[0])
        allowed = torch.cat([seen.expand(rows, -1, -1, -1), entries.expand(rows, -1, -1, -1)], dim=-1)
        if additive_dtype is None:
            return allowed
        return torch.full(allowed.shape, torch.finfo(additive_dtype).min, dtype=additive_dtype,
                          device=allowed.device).masked_fill_(allowed, 0)

    def mask(self, causal: bool, window: int | None, additive_dtype):
        """The whole ``[b, 1, S/cp, S + count]`` mask of this layer (not shared: each layer has its own entries)."""
        return self.block_mask(self.queries, self.keys, causal, window, additive_dtype)

    def blocks(self, rows: int, causal: bool, window: int | None):
        """The blocks of the tokens' keys, each with every entry after them."""
        extra = torch.arange(self.tokens, self.tokens + self.count, device=self.keys.device)
        out = []
        for start, n, keys in view_target(self).blocks(rows, causal, window):
            if isinstance(keys, slice) and keys == slice(None):
                out.append((start, n, keys))
                continue
            index = torch.arange(keys.start, keys.stop, device=extra.device) if isinstance(keys, slice) else keys
            out.append((start, n, torch.cat([index, extra])))
        return out


def compressed_forward(state, batch: SequenceForward, allowed: torch.Tensor | None, count: int) -> SequenceForward:
    """``batch`` (the current forward, or a view of it) seen with ``count`` compressed entries after the whole row's
    keys, ``allowed`` (``[b, S/(sp·cp), count]`` of this rank's queries, gathered over sp) masking each query's."""
    view = _Compressed(batch, None if allowed is None else _gather_over_sp(allowed, state), count)
    return cast(SequenceForward, view)  # an AttributeView: a SequenceForward to its readers
