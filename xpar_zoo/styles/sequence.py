"""Long context: Ulysses sequence parallelism (``sp``) and context parallelism (``cp``) on the real transformers
classes, through transformers' ``AttentionInterface`` and a wrapper around the model's forward (no modeling code).

**Tokens.** The ``sp·cp`` ranks of a *sequence group* (:class:`~xpar_zoo.mesh.Mesh`) share one micro-batch of
``b`` rows of ``S`` tokens. The ``S`` positions are dealt to the ``cp`` ranks head-tail (zig-zag): the row is cut
into ``2·cp`` equal chunks and cp rank ``c`` keeps chunks ``c`` and ``2·cp-1-c`` (causal work balanced; without cp
one chunk: the row); each cp chunk is cut into ``sp`` consecutive parts, one per sp rank. So a rank holds
``S/(sp·cp)`` tokens outside attention (``S`` must divide by ``2·cp·sp``, or by ``sp`` without cp).

**Data.** Every rank of a group passes the same full-length rows to ``model(...)``; :func:`install_sequence_parallel`
wraps the model's forward to keep this rank's tokens: ``input_ids`` / ``inputs_embeds`` and ``position_ids``
(computed on the whole row, ``arange(S)``, when not given) are indexed by the rank's positions; labels are shifted
on the whole row *before* the split (a target at a chunk boundary is predicted from the previous chunk's last token,
as in one process) and handed to transformers' loss as ``shift_labels``. The global-batch loss
(:mod:`xpar_zoo.loss`) then counts each target once over the world, so the mean of ``out.loss`` over all ranks is
the global-batch mean and the gradients are its gradients; the fused (vocab-parallel) head takes the same
``shift_labels``. A 2-D ``attention_mask`` (padding) is kept whole for the attention mask below and not passed on.
:func:`shard_sequence` does the same split ahead of time for loaders that hand the model only its part; the part
carries :data:`PART_KEY` (a :class:`SequencePart`), so the model never guesses from shapes which it was given.
:func:`data_shard` says which of ``world/(sp·cp)`` parts of the global batch a rank's loader reads.

**Attention.** ``parallelize`` registers ``xpar_seq_<inner>`` in transformers' ``AttentionInterface`` around the
model's implementation ``<inner>`` (``eager``: the modeling module's own ``eager_attention_forward``, so sinks and
MLA head dims keep their code; ``sdpa``; ``flex_attention``; ``flash_attention_2/3`` as ``xpar_seq_fa2/3``) and sets
the model to it. flex and flash take no dense mask: :func:`flex_inner` (a ``BlockMask`` from the global indices)
and :func:`flash_inner` (one call per run of query positions against its key prefix, bottom-right causal; varlen
for packed documents and padding); see docs/long_context.md. Around the inner call: ``sp`` exchanges sequence
for heads with an all-to-all (``[b, H, S/(sp·cp), d] → [b, H/sp, S/cp, d]``; key/value heads repeated first where
fewer than ``sp`` or not dividing by it; a per-head sink ``s_aux`` / ``module.sinks`` sliced to the local heads);
``cp`` all-gathers keys and values over the cp group (backward: reduce-scatter) so each rank's ``S/cp`` queries see
the whole row. The mask is built here from the *global* token indices, never from the local mask transformers
would build for a shard: causal, a ``sliding_window`` (as transformers passes it), packed documents (a new document
starts where ``position_ids`` do not step by one, transformers' own rule, so no token attends across a boundary,
across cp chunks too) and padding. Additive in the query dtype (for ``sdpa`` too: a boolean one would become a
float copy per layer inside it), ``[b, 1, S/cp, S]`` per forward (built once per window, shared by the layers)
where it fits a byte budget; beyond it a block of queries at a time, each block's mask rebuilt in backward
(:func:`blocked_attention`, :func:`attention_block_rows`). Where it would be the plain causal mask of a whole row
(no cp, packing, padding or window) ``sdpa`` gets none and runs causal itself (its flash kernels on a GPU). With
cp on plain causal rows, ``sdpa`` on CUDA gets none either (:func:`lower_right_attention`: each query chunk against
the key prefix that ends where it ends, aligned lower-right; :func:`cp_lower_right` chooses). The model applies
RoPE before attention with the local ``position_ids``, which hold global positions.

**Hybrid models** (linear attention, SSM and short-convolution layers: qwen3_next's gated delta net, minimax's
lightning attention, mamba mixers) run those layers on the whole rows of the sequence group
(:mod:`xpar_zoo.styles.sequence_mixers`: the hidden states are all-gathered around the real module, which runs
unchanged; the rank keeps its tokens of the output). Exact, but their compute is repeated over the group and their
activation memory is not divided. Sequence mixing that is not such a module (a convolution inside the attention,
an indexer inside indexed sparse attention) is refused, naming it and why.

``generate`` (a KV cache) is refused on an sp/cp mesh with one line: decoding one token at a time has nothing to
split. Parameters are placed exactly as without sp/cp, so checkpoints are unchanged.
"""

from __future__ import annotations

import bisect
import functools
import inspect
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from ..compat import (attn_implementation, config_with_attn_implementation, flash_kernels_loaded,
                      supports_attn_implementation)
from ..errors import BatchError, ModelStateError, PlanError
from ..parallel.collectives import GatherRows, all_to_all
from ..parallel.mesh import Mesh, PlanShard
from .sequence_mixers import (decoder_layers, dispatches_attention, install_sequence_mixers, sequence_mixers,
                              unserved_mixers)

ATTENTION_PREFIX = "xpar_seq_"
FLASH_IMPLEMENTATIONS = ("flash_attention_2", "flash_attention_3")
INNER_IMPLEMENTATIONS = ("eager", "sdpa", "flex_attention", *FLASH_IMPLEMENTATIONS)
# The wrapper's name of each flash implementation: none with "flash" in it, or transformers would treat the wrapper
# as flash itself (load kernels by its name, take flash-only paths computed from the local tokens).
WRAPPER_NAMES = {"flash_attention_2": "fa2", "flash_attention_3": "fa3"}
# The key of a batch that :func:`shard_sequence` made: its value is a SequencePart.
PART_KEY = "xpar_sequence_part"
IGNORE_INDEX = -100


# ---- the token layout -------------------------------------------------------------------------------------------

def wrapper_name(inner: str) -> str:
    """The ``AttentionInterface`` name of the sp/cp attention around ``inner`` (``xpar_seq_sdpa``,
    ``xpar_seq_fa2`` for ``flash_attention_2``)."""
    return ATTENTION_PREFIX + WRAPPER_NAMES.get(inner, inner)


def check_sequence_length(seq_len: int, sp: int, cp: int) -> None:
    """Raise :class:`~xpar_zoo.errors.BatchError` when rows of ``seq_len`` tokens cannot be dealt to ``sp·cp``
    ranks (``2·cp·sp`` equal chunks with cp, ``sp`` without)."""
    parts = 2 * cp * sp if cp > 1 else sp
    if seq_len % parts:
        why = (f"2·cp·sp = 2·{cp}·{sp} = {parts} (cp deals each rank a head and a tail chunk of every row, split "
               f"again over sp)" if cp > 1 else f"sp={sp}")
        raise BatchError(f"sequence length {seq_len} does not divide by {why}; pad the rows to a multiple of "
                         f"{parts} (labels -100 on the padding)")


def cp_chunk(seq_len: int, cp: int, c: int) -> torch.Tensor:
    """The global token indices of cp rank ``c``'s chunk: head chunk ``c`` and tail chunk ``2·cp-1-c``."""
    if cp == 1:
        return torch.arange(seq_len)
    n = seq_len // (2 * cp)
    return torch.cat([torch.arange(c * n, (c + 1) * n), torch.arange((2 * cp - 1 - c) * n, (2 * cp - c) * n)])


@dataclass(frozen=True)
class TokenLayout:
    """Where the tokens of a row of ``seq_len`` go: ``local`` (this rank's, ``S/(sp·cp)``), ``queries`` (its cp
    chunk, the queries after the sp all-to-all, ``S/cp``) and ``keys`` (the row in cp-gathered order, ``S``)."""

    local: torch.Tensor
    queries: torch.Tensor
    keys: torch.Tensor


@functools.lru_cache(maxsize=16)
def token_layout(seq_len: int, sp: int, cp: int, sp_rank: int, cp_rank: int) -> TokenLayout:
    """The :class:`TokenLayout` of sp rank ``sp_rank`` and cp rank ``cp_rank`` (indices on the CPU)."""
    check_sequence_length(seq_len, sp, cp)
    queries = cp_chunk(seq_len, cp, cp_rank)
    part = seq_len // (sp * cp)
    keys = torch.cat([cp_chunk(seq_len, cp, c) for c in range(cp)])
    return TokenLayout(queries[sp_rank * part:(sp_rank + 1) * part], queries, keys)


def document_ids(position_ids: torch.Tensor) -> torch.Tensor | None:
    """``[b, S]`` document numbers of packed rows (a document starts where ``position_ids`` do not step by one,
    transformers' ``find_packed_sequence_indices``), or ``None`` when every row is one document."""
    first = position_ids[:, :1] - 1
    docs = (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)
    return None if bool((docs[:, -1] == 0).all()) else docs


# ---- collectives ------------------------------------------------------------------------------------------------

def heads_to_sequence(x: torch.Tensor, group, size: int) -> torch.Tensor:
    """Ulysses' first all-to-all: ``[b, H, s, d]`` (this rank's ``s`` tokens, every head) → ``[b, H/size, size·s,
    d]`` (the group's tokens in rank order, this rank's block of heads). Differentiable."""
    b, heads, s, d = x.shape
    rows = x.reshape(b, size, heads // size, s, d).permute(1, 3, 0, 2, 4).reshape(size * s, b, heads // size, d)
    out = all_to_all(rows, [s] * size, [s] * size, group)
    return out.permute(1, 2, 0, 3)


def sequence_to_heads(y: torch.Tensor, group, size: int) -> torch.Tensor:
    """The inverse for the attention output: ``[b, size·s, h, d]`` → ``[b, s, size·h, d]``. Differentiable."""
    b, total, h, d = y.shape
    s = total // size
    rows = y.reshape(b, size, s, h, d).permute(1, 2, 0, 3, 4).reshape(size * s, b, h, d)
    out = all_to_all(rows, [s] * size, [s] * size, group)
    return out.reshape(size, s, b, h, d).permute(2, 1, 0, 3, 4).reshape(b, s, size * h, d)


def gather_sequence(x: torch.Tensor, shard: PlanShard) -> torch.Tensor:
    """``[b, h, s, d]`` of every cp rank, concatenated on the sequence in cp rank order (backward: the sum of the
    gradients, scattered back). Differentiable."""
    b, h, s, d = x.shape
    rows = x.permute(2, 0, 1, 3).contiguous()
    full = GatherRows.apply(rows, [s] * shard.size, shard)
    return full.permute(1, 2, 0, 3)


def kv_repeat(query_heads: int, kv_heads: int, sp: int) -> int:
    """How many times each key/value head is repeated before the sp all-to-all so that the key/value heads divide
    by ``sp`` and still divide the query heads (1: none)."""
    for r in range(1, query_heads // kv_heads + 1):
        if (kv_heads * r) % sp == 0 and query_heads % (kv_heads * r) == 0:
            return r
    raise PlanError(f"cannot spread {kv_heads} key/value heads over sp={sp} for {query_heads} query heads")


# cp's plain causal rows on sdpa: "lower_right" (no mask: each query chunk against the key prefix that ends where it
# ends, torch's causal_lower_right: flash/efficient kernels on CUDA) or "dense" (the shared additive mask).
CP_ATTENTION_ENV = "XPAR_ZOO_CP_ATTENTION"


def cp_lower_right(device: torch.device) -> bool:
    """Whether cp's plain causal rows on sdpa run without a mask (:func:`lower_right_attention`): on CUDA by default
    (kernels without a mask); elsewhere torch materialises a ``[chunk, prefix]`` mask per call and layer, kept for
    backward, which costs more than the one additive mask per forward that the layers share. The environment
    variable ``XPAR_ZOO_CP_ATTENTION`` (``lower_right`` or ``dense``) overrides the choice."""
    mode = os.environ.get(CP_ATTENTION_ENV, "").strip().lower()
    if mode not in ("", "lower_right", "dense"):
        raise PlanError(f"{CP_ATTENTION_ENV}={mode!r}: expected 'lower_right' or 'dense'")
    return mode == "lower_right" if mode else device.type == "cuda"


def lower_right_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, batch, dropout: float,
                          scaling: float | None) -> torch.Tensor:
    """Causal sdpa of the queries of a cp chunk (``[b, h, S/cp, d]``, runs of consecutive global positions: the
    head and tail chunks) against the cp-gathered keys and values of the whole row (``[b, kv, S, d]``), with no
    mask: the keys are put in row order once, and each run of queries attends to the prefix of the row that ends
    where the run ends, aligned lower-right (``torch.nn.attention.bias.causal_lower_right``). Key/value heads are
    repeated to the query heads (sdpa's ``enable_gqa`` does not reach its lower-right kernels). Returns
    ``[b, S/cp, h, dv]`` as transformers' sdpa does."""
    from torch.nn.attention.bias import causal_lower_right

    order = batch.key_order()
    key, value = key[:, :, order], value[:, :, order]
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    outs = []
    for start, n, end in batch.query_runs():
        q = query[:, :, start:start + n]
        o = torch.nn.functional.scaled_dot_product_attention(
            q, key[:, :, :end], value[:, :, :end], attn_mask=causal_lower_right(n, end), dropout_p=dropout,
            scale=scaling)
        outs.append(o.transpose(1, 2))
    return torch.cat(outs, dim=1)


# The blocked sp/cp attention (:func:`blocked_attention`): the bytes one block of queries may hold for its mask and,
# for eager, its scores (MiB); where the whole mask fits, it is built once per forward and shared by the layers.
ATTENTION_BLOCK_ENV = "XPAR_ZOO_ATTENTION_BLOCK_MIB"
ATTENTION_BLOCK_MIB = 16.0


def attention_block_budget() -> float:
    """The bytes of one block of :func:`blocked_attention`: ``XPAR_ZOO_ATTENTION_BLOCK_MIB`` (MiB, a positive
    number), else 16 MiB."""
    raw = os.environ.get(ATTENTION_BLOCK_ENV, "").strip()
    if not raw:
        return ATTENTION_BLOCK_MIB * 2 ** 20
    try:
        mib = float(raw)
    except ValueError:
        mib = float("nan")
    if not mib > 0:
        raise PlanError(f"{ATTENTION_BLOCK_ENV}={raw!r}: expected a positive number of MiB")
    return mib * 2 ** 20


def attention_query_bytes(rows: int, heads: int, keys: int, dtype_bytes: int, eager: bool) -> int:
    """What one query of the masked sp/cp attention holds while its block runs, for ``rows`` rows against ``keys``
    keys (``heads`` per rank): per key its additive mask (``dtype_bytes``) and the boolean terms it is built from
    (2), and for eager its scores, their softmax and gradients (``heads·(8 + 2·dtype_bytes)``); sdpa makes no
    score matrix."""
    return rows * keys * (dtype_bytes + 2 + (heads * (8 + 2 * dtype_bytes) if eager else 0))


def attention_block_rows(rows: int, heads: int, queries: int, keys: int, dtype_bytes: int, eager: bool,
                         budget: float | None = None) -> int | None:
    """Queries per block of :func:`blocked_attention` for ``rows`` rows of ``queries`` queries against ``keys``
    keys, or ``None`` where all of them fit the budget (:func:`attention_block_budget`; a query's bytes:
    :func:`attention_query_bytes`): then one mask per forward, shared by the layers."""
    per_query = attention_query_bytes(rows, heads, keys, dtype_bytes, eager)
    budget = attention_block_budget() if budget is None else budget
    if queries * per_query <= budget:
        return None
    return max(1, int(budget // per_query))


def blocked_attention(call, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, batch, causal: bool,
                      window: int | None, rows: int) -> torch.Tensor:
    """The masked attention of ``query`` (``[b, h, S/cp, d]``) against ``key`` / ``value`` (``[b, kv, S, d]``,
    gathered order) in blocks of at most ``rows`` queries (:meth:`_Forward.blocks`), exact: a query is a row of
    its own softmax, so the blocks need no log-sum-exp merge. Each block builds its own ``[b, 1, rows, keys]`` mask
    from the global positions, against only the keys a causal block may see, and calls ``call(q, k, v, mask)``
    (the inner attention, ``[b, rows, h, dv]`` out) under non-reentrant activation checkpointing: neither its
    mask nor eager's scores are kept for backward, which rebuilds and recomputes one block at a time. So the mask
    and score transients are one block (:func:`attention_block_rows`), not ``[b, 1, S/cp, S]`` per forward and
    ``[b, h, S/cp, S]`` per layer, for one more forward of the attention in backward. Layer checkpointing
    (``activation_checkpointing_enable``) nests around it."""
    from torch.utils.checkpoint import checkpoint

    outs = []
    for start, n, keys in batch.blocks(rows, causal, window):
        q = query[:, :, start:start + n]
        args = (call, batch, causal, window, start, keys, q, key, value)
        if torch.is_grad_enabled():
            outs.append(checkpoint(_attention_block, *args, use_reentrant=False))
        else:
            outs.append(_attention_block(*args))
    return torch.cat(outs, dim=1)


def _attention_block(call, batch, causal: bool, window: int | None, start: int, keys, q: torch.Tensor,
                     key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """One block of :func:`blocked_attention`: its keys, its mask, the inner attention."""
    mask = batch.block_mask(batch.queries[start:start + q.shape[2]], batch.keys[keys], causal, window, q.dtype)
    return call(q, key[:, :, keys], value[:, :, keys], mask)


# ---- the inner implementations that take no dense mask: flex and flash ---------------------------------------------

def flex_inner(batch, module, query, key, value, causal: bool, dropout: float, scaling, window, kwargs: dict
               ) -> torch.Tensor:
    """transformers' ``flex_attention`` forward with a ``BlockMask`` built from the global indices
    (:meth:`_Forward.block_mask`): no dense ``[S/cp, S]`` mask is kept. Key/value heads stay grouped (flex's
    ``enable_gqa``); a value head dim other than the query's (MLA) is flex's own. Sinks (``s_aux``) need flex's
    log-sum-exp, which transformers does not request on CPU: refused there."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if kwargs.get("s_aux") is not None and query.device.type == "cpu":
        owner = module._module if isinstance(module, _ModuleView) else module
        raise PlanError(f"sp/cp: {type(owner).__name__} has attention sinks (s_aux), which flex_attention serves "
                        "only on CUDA (transformers reads flex's log-sum-exp there); use eager or sdpa on CPU")
    block = batch.flex_block_mask(causal, window)
    out, _ = ALL_ATTENTION_FUNCTIONS["flex_attention"](module, query, key, value, block, dropout=dropout,
                                                      scaling=scaling, sliding_window=window, **kwargs)
    return out


def flash_inner(batch, module, query, key, value, causal: bool, dropout: float, scaling, window, kwargs: dict
                ) -> torch.Tensor:
    """transformers' flash forward (``flash_attention_2`` / ``_3``) with no mask: the keys in row order, and each
    run of consecutive query positions (the whole row under sp alone; cp's head and tail chunks) against the key
    prefix that ends where the run ends, causal aligned bottom-right (flash's semantics when fewer queries than
    keys). Packed documents and padding: varlen, with ``cu_seqlens`` for the queries and the keys of each run
    separately (:meth:`_Forward.flash_segments`). Sliding window, softcap and sinks pass through to flash (whose
    window, bottom-right aligned, is then exact in global positions)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if not causal:  # each run attends to its key prefix: causal rows only
        owner = module._module if isinstance(module, _ModuleView) else module
        raise PlanError(f"sp/cp: {type(owner).__name__} is not causal; flash attention under sp/cp serves causal "
                        "attention only (use sdpa or flex_attention)")
    function = ALL_ATTENTION_FUNCTIONS[attn_implementation(module.config)]
    if batch.queries.numel() != batch.keys.numel():  # cp: the gathered keys back in row order
        order = batch.key_order()
        key, value = key[:, :, order], value[:, :, order]
    common = {**kwargs, "dropout": dropout, "scaling": scaling, "sliding_window": window, "is_causal": causal}
    outs = []
    for start, n, end in batch.query_runs():
        q, k, v = query[:, :, start:start + n], key[:, :, :end], value[:, :, :end]
        if batch.docs is None and batch.key_valid is None:
            outs.append(function(module, q, k, v, None, **common)[0])
        else:
            outs.append(_flash_varlen(function, batch.flash_segments(end, n), module, q, k, v, common))
    return torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]


def _flash_varlen(function, segments, module, q, k, v, common: dict) -> torch.Tensor:
    """One flash call over the segments of a query run (every row's documents in one varlen batch): ``[b, n, h,
    dv]``, zero where a query is padding."""
    q_index, k_index, cu_q, cu_k, max_q, max_k = segments
    b, h, n, _ = q.shape
    out = q.new_zeros(b * n, h, v.shape[-1])
    if q_index.numel():
        def flat(t, index):  # [b, heads, s, d] -> [1, heads, tokens, d]
            return t.transpose(1, 2).reshape(-1, *t.shape[1:2], t.shape[-1])[index].transpose(0, 1)[None]

        got, _ = function(module, flat(q, q_index), flat(k, k_index), flat(v, k_index), None, cu_seq_lens_q=cu_q,
                          cu_seq_lens_k=cu_k, max_length_q=max_q, max_length_k=max_k, **common)
        out = out.index_copy(0, q_index, got[0])
    return out.view(b, n, h, -1)


# The inner implementations served without the dense mask, each by its own function.
OWN_MASK_INNER = {"flex_attention": flex_inner, "flash_attention_2": flash_inner, "flash_attention_3": flash_inner}
# Keyword arguments transformers computes from the local tokens; the inner call must not see them.
LOCAL_KWARGS = ("position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def _global_kwargs(kwargs: dict) -> dict:
    return {k: v for k, v in kwargs.items() if k not in LOCAL_KWARGS}


class _ModuleView:
    """The attention module as the inner attention function sees it under sp: its own attributes, except the
    local head counts and per-head sinks."""

    def __init__(self, module: nn.Module, overrides: Mapping[str, object]) -> None:
        object.__setattr__(self, "_module", module)
        self.__dict__.update(overrides)

    def __getattr__(self, name: str):
        return getattr(self._module, name)


# ---- the per-forward state --------------------------------------------------------------------------------------

@dataclass
class _Forward:
    """What the attention of one forward needs: the global indices of the queries and keys (on the device), the
    packed documents and the padding of the whole rows, and the masks built from them (one per window and kind)."""

    queries: torch.Tensor
    keys: torch.Tensor
    docs: torch.Tensor | None
    key_valid: torch.Tensor | None
    masks: dict = field(default_factory=dict)

    def causal_only(self, causal: bool, window: int | None, keys: int) -> bool:
        """Whether the mask is plain causality by global position (no packed documents, no padding, no window
        shorter than the row), whatever the order of the queries and keys."""
        return causal and self.docs is None and self.key_valid is None and (window is None or window >= keys)

    def plain_causal(self, causal: bool, window: int | None, keys: int) -> bool:
        """Whether the mask is the plain causal one of queries and keys both in row order (no cp, no packed
        documents, no padding, no window shorter than the row)."""
        if "in_order" not in self.masks:  # one host sync per forward, not per layer
            self.masks["in_order"] = self.queries.shape == self.keys.shape and bool((self.keys == self.queries).all())
        return self.causal_only(causal, window, keys) and self.masks["in_order"]

    def query_runs(self) -> list[tuple[int, int, int]]:
        """The runs of consecutive global positions in the queries (cp: the head chunk and the tail chunk):
        ``[(first local query, queries, global end)]``; a run attends causally to the row's keys before its end."""
        if "runs" not in self.masks:  # one host sync per forward
            q = self.queries.tolist()
            runs, start = [], 0
            for i in range(1, len(q) + 1):
                if i == len(q) or q[i] != q[i - 1] + 1:
                    runs.append((start, i - start, q[i - 1] + 1))
                    start = i
            self.masks["runs"] = runs
        return self.masks["runs"]

    def key_order(self) -> torch.Tensor:
        """Indices that put the cp-gathered keys in row order (``keys[:, :, order]``)."""
        if "order" not in self.masks:
            self.masks["order"] = torch.argsort(self.keys)
        return self.masks["order"]

    def mask(self, causal: bool, window: int | None, additive_dtype: torch.dtype | None) -> torch.Tensor:
        """The ``[b, 1, S/cp, S]`` mask of the whole forward (boolean, or additive in ``additive_dtype``), built
        once per window and kind and shared by the layers."""
        key = (causal, window, additive_dtype)
        if key not in self.masks:
            self.masks[key] = self.block_mask(self.queries, self.keys, causal, window, additive_dtype)
        return self.masks[key]

    def block_mask(self, queries: torch.Tensor, keys: torch.Tensor, causal: bool, window: int | None,
                   additive_dtype: torch.dtype | None) -> torch.Tensor:
        """The ``[b, 1, len(queries), len(keys)]`` mask of the given global query and key positions (not kept)."""
        q, k = queries[:, None], keys[None, :]
        allowed = k <= q if causal else torch.ones(q.shape[0], k.shape[1], dtype=torch.bool, device=q.device)
        if window is not None:
            allowed = allowed & (k > q - window)  # q - k < window, without an int64 [q, k] difference
        allowed = allowed[None]
        if self.docs is not None:
            allowed = allowed & (self.docs[:, queries, None] == self.docs[:, None, keys])
        if self.key_valid is not None:
            allowed = allowed & self.key_valid[:, None, keys]
            allowed = allowed | ~allowed.any(-1, keepdim=True)  # a padded query attends to all: no NaN
        allowed = allowed[:, None]
        if additive_dtype is not None:
            allowed = torch.full(allowed.shape, torch.finfo(additive_dtype).min, dtype=additive_dtype,
                                 device=allowed.device).masked_fill_(allowed, 0)  # in place: no second copy
        return allowed

    def blocks(self, rows: int, causal: bool, window: int | None) -> list[tuple[int, int, slice | torch.Tensor]]:
        """The query blocks of :func:`blocked_attention`: ``[(first local query, queries, keys)]``, at most
        ``rows`` consecutive global positions each (never across a run: cp's head and tail chunks apart). ``keys``
        indexes the gathered keys: with a causal mask and no padding only those a query of the block may see (the
        row up to the block's last position, from its first less the window), else all. One host sync per
        forward."""
        cache = ("blocks", rows, causal, window)
        if cache in self.masks:
            return self.masks[cache]
        trim = causal and self.key_valid is None  # padded queries attend to every key: keep them all
        order = self.key_order().tolist() if trim else None
        positions = self.keys[self.key_order()].tolist() if trim else None  # the keys' positions, ascending
        out = []
        for start, n, end in self.query_runs():
            for s in range(start, start + n, rows):
                m = min(rows, start + n - s)
                keys: slice | torch.Tensor = slice(None)
                if trim:
                    first = end - n + (s - start)  # global position of the block's first query
                    lo = 0 if window is None else bisect.bisect_left(positions, first - window + 1)
                    keys = _index(order[lo:bisect.bisect_right(positions, first + m - 1)], self.keys.device)
                out.append((s, m, keys))
        self.masks[cache] = out
        return out

    def flex_block_mask(self, causal: bool, window: int | None):
        """The mask of :meth:`mask` as a flex ``BlockMask`` (:func:`banded_block_mask` over a ``mask_mod`` that
        computes the global indices): per forward and window, shared by the layers. A query with no
        key left (padding) gets no output, as in flex's own single-process masks."""
        key = ("block", causal, window)
        if key not in self.masks:
            docs, valid = self.docs, self.key_valid
            query_at, key_at = _positions(self.queries), _positions(self.keys)

            def mask_mod(b, h, q_idx, kv_idx):
                q, k = query_at(q_idx), key_at(kv_idx)
                allowed = k <= q if causal else k >= 0
                if window is not None:
                    allowed = allowed & (q - k < window)
                if docs is not None:
                    allowed = allowed & (docs[b, q] == docs[b, k])
                if valid is not None:
                    allowed = allowed & valid[b, k]
                return allowed

            rows = next((t.shape[0] for t in (docs, valid) if t is not None), None)
            self.masks[key] = banded_block_mask(mask_mod, rows, self.queries.numel(), self.keys.numel(),
                                                self.queries.device)
        return self.masks[key]

    def flash_segments(self, end: int, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                         int, int]:
        """The varlen layout of the query run of global positions ``[end-n, end)`` against the keys ``[0, end)`` in
        row order, every row flattened into one: ``(query index into [b·n], key index into [b·end], cu_seqlens_q,
        cu_seqlens_k, max_seqlen_q, max_seqlen_k)``. A segment is one document of one row that has an unpadded
        query in the run; its keys are that document's unpadded keys before ``end``, so its queries are the last of
        its keys and flash's bottom-right causal alignment is exact. Padded queries are in no segment (no output, as
        in flash's own unpadding). Once per forward and run (host syncs), shared by the layers."""
        key = ("segments", end, n)
        if key not in self.masks:
            ref = self.docs if self.docs is not None else self.key_valid
            rows, device = ref.shape[0], ref.device
            docs = self.docs if self.docs is not None else torch.zeros_like(ref, dtype=torch.long)
            valid = self.key_valid if self.key_valid is not None else torch.ones_like(ref, dtype=torch.bool)
            segment = docs[:, :end] + (torch.arange(rows, device=device)[:, None] * (end + 1))
            q_valid = valid[:, end - n:end]
            q_index = q_valid.reshape(-1).nonzero().flatten()
            q_segments, q_counts = torch.unique_consecutive(segment[:, end - n:end][q_valid], return_counts=True)
            k_valid = valid[:, :end] & torch.isin(segment, q_segments)
            k_index = k_valid.reshape(-1).nonzero().flatten()
            _, k_counts = torch.unique_consecutive(segment[k_valid], return_counts=True)
            cu_q, cu_k = (nn.functional.pad(c.cumsum(0, dtype=torch.int32), (1, 0)) for c in (q_counts, k_counts))
            longest = [int(c.max()) if c.numel() else 0 for c in (q_counts, k_counts)]
            self.masks[key] = (q_index, k_index, cu_q, cu_k, *longest)
        return self.masks[key]


def _index(indices: list[int], device: torch.device) -> slice | torch.Tensor:
    """``indices`` as a slice where they are consecutive (a view, no copy), else as an index tensor."""
    if indices == list(range(indices[0], indices[0] + len(indices))):
        return slice(indices[0], indices[0] + len(indices))
    return torch.tensor(indices, device=device)


# Mask entries a BlockMask is built from at a time (a band of query blocks against every key): bounds the transient
# that torch's create_block_mask, uncompiled, makes at once (int64 intermediates of [rows, S/cp, S]).
BLOCK_MASK_BAND_ENTRIES = 1 << 22
FLEX_BLOCK = 128  # flex's default sparse block size


def banded_block_mask(mask_mod, rows: int | None, q_len: int, kv_len: int, device: torch.device):
    """The ``BlockMask`` torch's ``create_block_mask(mask_mod, rows, None, q_len, kv_len)`` builds (per block of
    128 queries and 128 keys: fully allowed, partly allowed or skipped, then ``BlockMask.from_kv_blocks``), built a
    band of query blocks at a time so that no ``[rows, q_len, kv_len]`` intermediate exists: uncompiled,
    create_block_mask evaluates the ``mask_mod`` on every pair at once (at 8192 tokens on cp=4 more memory than
    sdpa's dense mask), and compiling it trips torch's CPU code generation on some shapes."""
    from torch.nn.attention.flex_attention import BlockMask

    r, n = rows or 1, FLEX_BLOCK
    blocks_q, blocks_kv = -(-q_len // n), -(-kv_len // n)
    band = max(1, BLOCK_MASK_BAND_ENTRIES // (r * n * blocks_kv * n))
    b, kv, head = torch.arange(r, device=device)[:, None, None], torch.arange(kv_len, device=device), torch.tensor(0)
    partial, full = [], []
    for first in range(0, blocks_q, band):
        q = torch.arange(first * n, min((first + band) * n, q_len), device=device)
        allowed = mask_mod(b, head, q[:, None], kv[None, :]).expand(r, q.numel(), kv_len)
        allowed = nn.functional.pad(allowed, (0, blocks_kv * n - kv_len, 0, -(-q.numel() // n) * n - q.numel()))
        counts = allowed.view(r, -1, n, blocks_kv, n).sum((2, 4), dtype=torch.int32)
        partial.append((counts > 0) & (counts < n * n))
        full.append(counts == n * n)

    def ordered(dense):  # torch's own ordering of the blocks of each query block: allowed first, stable
        dense = torch.cat(dense, dim=1)[:, None].to(torch.int32)
        return dense.sum(-1, dtype=torch.int32), torch.argsort(dense, dim=-1, descending=True, stable=True).to(torch.int32)

    return BlockMask.from_kv_blocks(*ordered(partial), *ordered(full), BLOCK_SIZE=(n, n), mask_mod=mask_mod,
                                    seq_lengths=(q_len, kv_len))


def _positions(indices: torch.Tensor):
    """``idx -> indices[idx]`` as arithmetic on ``idx`` for indices made of runs of consecutive positions (a cp
    chunk, the cp-gathered row): a flex ``mask_mod`` then reads no captured index tensor (torch's CPU flex kernel
    fails to compile such a lookup once shapes turn dynamic)."""
    values = indices.tolist()
    steps = [(0, values[0])] + [(i, values[i] - i) for i in range(1, len(values)) if values[i] != values[i - 1] + 1]

    def position(idx):
        out = idx + steps[0][1]
        for (_, before), (start, shift) in zip(steps, steps[1:]):
            out = out + (idx >= start) * (shift - before)
        return out

    return position


@dataclass(frozen=True)
class SequencePart:
    """The mark :func:`shard_sequence` puts under :data:`PART_KEY`: the batch holds this rank's part of rows of
    ``seq_len`` tokens; ``docs`` and ``key_valid`` are the whole rows' packed documents and padding (or ``None``)."""

    seq_len: int
    docs: torch.Tensor | None = None
    key_valid: torch.Tensor | None = None


class SequenceParallel:
    """The long-context state of one parallelized model: its sp and cp groups, the inner attention, and the
    current forward's :class:`_Forward` (kept until the next forward: activation checkpointing recomputes the
    attention during backward)."""

    def __init__(self, mesh: Mesh, inner: str) -> None:
        self.sp, self.cp = mesh.sp, mesh.cp
        self.sp_group, self.cp_group = mesh.sequence_group("sp"), mesh.sequence_group("cp")
        self.sp_rank, self.cp_rank = mesh.sequence_rank("sp"), mesh.sequence_rank("cp")
        self.inner = inner
        self.current: _Forward | None = None

    def layout(self, seq_len: int) -> TokenLayout:
        return token_layout(seq_len, self.sp, self.cp, self.sp_rank, self.cp_rank)

    def cp_shard(self) -> PlanShard:
        return PlanShard(self.cp_group, self.cp, self.cp_rank, 0)

    # ---- the batch --------------------------------------------------------------------------------------------
    def split(self, named: dict) -> tuple[dict, SequencePart]:
        """This rank's part of the full-length batch ``named`` (model keyword arguments), and its mark."""
        ids, embeds = named.get("input_ids"), named.get("inputs_embeds")
        ref = ids if ids is not None else embeds
        if ref is None:
            raise BatchError("sp/cp: the batch has neither input_ids nor inputs_embeds")
        b, seq_len = ref.shape[:2]
        local = self.layout(seq_len).local.to(ref.device)
        self.check_same_rows(ref)
        out = dict(named)
        positions = named.get("position_ids")
        if positions is None:
            positions = torch.arange(seq_len, device=ref.device)[None]
        if positions.dim() != 2 or positions.shape[-1] != seq_len:
            raise BatchError(f"sp/cp: position_ids of shape {tuple(positions.shape)}; expected [batch, {seq_len}] "
                             "(rope with several position rows, e.g. multimodal, is not supported)")
        positions = positions.expand(b, seq_len)
        mask = named.get("attention_mask")
        key_valid = None
        if mask is not None:
            if mask.dim() != 2 or tuple(mask.shape) != (b, seq_len):
                raise BatchError(f"sp/cp: attention_mask of shape {tuple(mask.shape)}; only a 2-D [batch, seq] "
                                 f"padding mask ({b}, {seq_len}) is supported (the attention builds its own mask)")
            key_valid = None if bool(mask.bool().all()) else mask.bool()
        out["attention_mask"] = None
        shift = named.get("shift_labels")
        labels = named.get("labels")
        if shift is None and labels is not None:
            ignore = named.get("ignore_index", IGNORE_INDEX)
            shift = nn.functional.pad(labels[..., 1:], (0, 1), value=ignore)
        if shift is not None:
            out["labels"] = out["shift_labels"] = shift[:, local.to(shift.device)]
        if ids is not None:
            out["input_ids"] = ids[:, local]
        if embeds is not None:
            out["inputs_embeds"] = embeds[:, local]
        out["position_ids"] = positions[:, local]
        return out, SequencePart(seq_len, document_ids(positions), key_valid)

    def check_same_rows(self, rows: torch.Tensor) -> None:
        """Raise :class:`~xpar_zoo.errors.BatchError` on every rank of the sequence group when its ranks were given
        different rows (e.g. a loader sharded by rank instead of :func:`data_shard`): each would train on tokens
        of rows it does not hold. A fingerprint of the rows (shape and a position-weighted sum), reduced by max and
        by min over the sp and cp groups: two small all-reduces and one host sync per forward."""
        weights = torch.arange(1, rows.shape[0] * rows.shape[1] + 1, device=rows.device,
                               dtype=torch.float64).view(rows.shape[:2])
        values = rows.to(torch.float64)
        values = values.sum(-1) if values.dim() == 3 else values  # inputs_embeds: [b, s, h]
        fingerprint = (values * weights).sum() + rows.shape[0] * 1e9 + rows.shape[1] * 1e6
        both = torch.stack([fingerprint, -fingerprint])
        for group, size in ((self.sp_group, self.sp), (self.cp_group, self.cp)):
            if size > 1:
                dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
        if bool(both[0] != -both[1]):
            raise BatchError(f"sp/cp: the ranks of a sequence group (sp={self.sp} x cp={self.cp}) were given "
                             "different rows; every rank of a group must pass the same full-length rows (read the "
                             "loader's part with xpar_zoo.data_shard(model), or hand each rank its part with "
                             "xpar_zoo.shard_sequence)")

    def begin(self, part: SequencePart, device: torch.device) -> None:
        layout = self.layout(part.seq_len)
        self.current = _Forward(layout.queries.to(device), layout.keys.to(device), part.docs, part.key_valid)

    # ---- attention --------------------------------------------------------------------------------------------
    def inner_function(self, module: nn.Module):
        if self.inner == "eager":
            fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
            if fn is None:
                raise PlanError(f"{type(module).__name__}'s module has no eager_attention_forward to wrap under sp/cp")
            return fn
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        return ALL_ATTENTION_FUNCTIONS[self.inner]

    def inner_call(self, module, overrides: dict, dropout: float, scaling, sliding_window, kwargs: dict):
        """``call(q, k, v, mask) -> [b, q, h, dv]``: the inner attention of ``module`` (seen with the local head
        counts and sinks of ``overrides``) with the layer's other arguments."""
        kwargs = _global_kwargs(kwargs)
        view = _ModuleView(module, overrides) if overrides else module
        inner = self.inner_function(module)

        def call(q, k, v, mask):
            return inner(view, q, k, v, mask, dropout=dropout, scaling=scaling, sliding_window=sliding_window,
                         **kwargs)[0]
        return call

    def masked_attention(self, call, query, key, value, causal: bool, window: int | None) -> torch.Tensor:
        """The attention under the mask of the global positions: the whole ``[b, 1, S/cp, S]`` mask, additive in the
        query dtype, built once per forward and shared by the layers where it fits the block budget (for eager and
        sdpa alike: sdpa would turn a boolean mask into a float one of its own, saved for backward, in every
        layer); otherwise :func:`blocked_attention`, a block of queries at a time."""
        batch = self.current
        rows = attention_block_rows(query.shape[0], query.shape[1], query.shape[2], key.shape[2],
                                    query.element_size(), self.inner == "eager")
        if rows is None:
            return call(query, key, value, batch.mask(causal, window, query.dtype))
        return blocked_attention(call, query, key, value, batch, causal, window, rows)

    def inner_view(self, module: nn.Module, overrides: dict):
        """The module as flex / flash see it: the sp overrides, and for flash a config that names the inner
        implementation (transformers' flash forward loads its kernels by that name)."""
        if self.inner in FLASH_IMPLEMENTATIONS:
            overrides = {**overrides, "config": config_with_attn_implementation(module.config, self.inner)}
        return _ModuleView(module, overrides) if overrides else module

    def attention(self, module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None,
                  **kwargs):
        batch = self.current
        if batch is None:
            raise ModelStateError("sp/cp attention ran outside a forward of the parallelized model")
        heads, kv_heads = query.shape[1], key.shape[1]
        overrides = {}
        if self.sp > 1:
            if heads % self.sp:
                raise PlanError(f"{type(module).__name__} has {heads} query heads, not divisible by sp={self.sp}")
            repeat = kv_repeat(heads, kv_heads, self.sp)
            if repeat > 1:
                key, value = key.repeat_interleave(repeat, 1), value.repeat_interleave(repeat, 1)
            query, key, value = (heads_to_sequence(t, self.sp_group, self.sp) for t in (query, key, value))
            overrides["num_key_value_groups"] = query.shape[1] // key.shape[1]
            lo, n = self.sp_rank * (heads // self.sp), heads // self.sp
            if kwargs.get("s_aux") is not None:
                kwargs["s_aux"] = kwargs["s_aux"][lo:lo + n]
            sinks = getattr(module, "sinks", None)
            if isinstance(sinks, torch.Tensor) and sinks.dim() == 1 and sinks.shape[0] == heads:
                overrides["sinks"] = sinks[lo:lo + n]
        if self.cp > 1:
            shard = self.cp_shard()
            key, value = gather_sequence(key, shard), gather_sequence(value, shard)
        causal = bool(getattr(module, "is_causal", True))
        if self.inner in OWN_MASK_INNER:  # flex and flash: no dense mask, their own from the global indices
            out = OWN_MASK_INNER[self.inner](batch, self.inner_view(module, overrides), query, key, value, causal,
                                             dropout, scaling, sliding_window, _global_kwargs(kwargs))
            return (sequence_to_heads(out, self.sp_group, self.sp) if self.sp > 1 else out), None
        if (self.cp > 1 and self.inner == "sdpa" and cp_lower_right(query.device)
                and batch.causal_only(causal, sliding_window, key.shape[2])
                and kwargs.get("s_aux") is None and getattr(module, "sinks", None) is None):
            out = lower_right_attention(query, key, value, batch, dropout, scaling)
        else:
            call = self.inner_call(module, overrides, dropout, scaling, sliding_window, kwargs)
            if self.inner == "sdpa" and batch.plain_causal(causal, sliding_window, key.shape[2]):
                out = call(query, key, value, None)  # sdpa's own is_causal over the whole row (flash kernels on GPU)
            else:
                out = self.masked_attention(call, query, key, value, causal, sliding_window)
        if self.sp > 1:
            out = sequence_to_heads(out, self.sp_group, self.sp)
        return out, None


def _sequence_attention(module, *args, **kwargs):
    """The function registered as ``xpar_seq_<inner>``: the attention of the model ``module`` belongs to."""
    state: SequenceParallel | None = module.__dict__.get("_xpar_seq")
    if state is None:
        raise ModelStateError(f"{type(module).__name__} is set to an xpar_zoo sp/cp attention but belongs to no "
                              "model parallelized with sp/cp")
    return state.attention(module, *args, **kwargs)


# ---- checks and installation ------------------------------------------------------------------------------------

def _text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def recurrent_layers(model: nn.Module) -> list[str]:
    """Sequence mixing of ``model`` outside the ``AttentionInterface`` that sp/cp cannot run on whole rows (the
    mixers :func:`~xpar_zoo.styles.sequence_mixers.sequence_mixers` finds run gathered), one ``"what: why"`` each."""
    return unserved_mixers(model, _text_config(model.config))


def attention_outside_interface(model: nn.Module) -> str | None:
    """The first attention module class of ``model`` whose forward does not call transformers'
    ``ALL_ATTENTION_FUNCTIONS`` (it computes attention itself: sp/cp cannot wrap it), or ``None``. Sequence mixers
    that run on gathered whole rows (linear attention) are not attention here."""
    mixers, layers = tuple(sequence_mixers(model)), {id(m) for m in decoder_layers(model)}
    for name, module in model.named_modules():
        cls = type(module)
        if (name in mixers or name.startswith(tuple(m + "." for m in mixers)) or id(module) in layers
                or "Attention" not in cls.__name__):
            continue
        if not dispatches_attention(cls) and any(True for _ in module.parameters()):
            return f"{cls.__name__} ({name})"
    return None


def check_sequence_parallel(model: nn.Module, mesh: Mesh) -> str:
    """Raise :class:`~xpar_zoo.errors.PlanError` (one line, naming the numbers) when ``model`` cannot run on
    ``mesh``'s sp/cp; return the inner attention implementation. Before any tensor is touched."""
    sizes = ", ".join(f"{d}={n}" for d, n in (("sp", mesh.sp), ("cp", mesh.cp)) if n > 1)
    config = model.config
    if any(getattr(config, k, None) is not None for k in getattr(config, "sub_configs", {}) if k != "text_config"):
        raise PlanError(f"{sizes}: {type(model).__name__} is multimodal; long context supports text-only causal LMs")
    recurrent = recurrent_layers(model)
    if recurrent:
        raise PlanError(f"{sizes}: {type(model).__name__} has sequence mixing that sp/cp cannot run on whole rows "
                        f"({'; '.join(recurrent)}); sp and cp are refused for it")
    inner = attn_implementation(config) or "eager"
    if inner.startswith(ATTENTION_PREFIX):
        raise PlanError(f"{type(model).__name__} is already set to sp/cp attention ({inner})")
    if inner not in INNER_IMPLEMENTATIONS:
        raise PlanError(f"{sizes}: attention implementation {inner!r} is not supported under sp/cp; load the model "
                        f"with attn_implementation in {INNER_IMPLEMENTATIONS}")
    direct = attention_outside_interface(model)
    if direct:
        raise PlanError(f"{sizes}: {direct} does not dispatch attention through transformers' AttentionInterface, "
                        "which sp/cp wraps")
    text = _text_config(config)
    heads, kv_heads = getattr(text, "num_attention_heads", None), getattr(text, "num_key_value_heads", None)
    if mesh.sp > 1:
        if not heads:
            raise PlanError(f"sp={mesh.sp}: {type(model).__name__}'s config has no num_attention_heads")
        if heads % mesh.sp:
            hint = (f"; use cp (e.g. sp={heads}, cp={mesh.sp // heads}) for the rest" if heads < mesh.sp
                    and mesh.sp % heads == 0 else "; use a smaller sp, or cp")
            raise PlanError(f"sp={mesh.sp} does not divide the {heads} query heads of {type(model).__name__}"
                            f"{hint} (cp is not limited by heads)")
        kv_repeat(heads, kv_heads or heads, mesh.sp)
    forward = inspect.signature(model.forward).parameters.values()
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in forward):
        raise PlanError(f"{sizes}: {type(model).__name__}.forward takes no **kwargs, so the shifted labels of the "
                        "split rows cannot reach its loss")
    return inner


def _own_config(model: nn.Module) -> None:
    """Give ``model`` its own copy of its config before its attention implementation changes: a config object
    shared with another model (built from the same config) must keep its implementation."""
    import copy

    old = model.config
    new = copy.deepcopy(old)
    for module in model.modules():
        if getattr(module, "config", None) is old:
            module.config = new


def _keep_wrapped(model: nn.Module, state: SequenceParallel) -> None:
    """Wrap again an attention implementation set on ``model`` after ``parallelize`` (``set_attn_implementation
    ("eager")`` would otherwise run attention on this rank's tokens alone, silently wrong); refuse one the wrapper
    cannot serve."""
    current = attn_implementation(model.config)
    if current == wrapper_name(state.inner):
        return
    if current not in INNER_IMPLEMENTATIONS:
        raise PlanError(f"sp/cp: the model's attention implementation was set to {current!r} after parallelize; "
                        f"under sp/cp it must be one of {INNER_IMPLEMENTATIONS}")
    from transformers import AttentionInterface

    AttentionInterface.register(wrapper_name(current), _sequence_attention)
    state.inner = current
    model.set_attn_implementation(wrapper_name(current))


def install_sequence_parallel(model: nn.Module, mesh: Mesh, inner: str) -> SequenceParallel:
    """Set ``model`` to ``xpar_seq_<inner>`` attention and wrap its forward to keep this rank's part of full-length
    rows (see the module docstring). Call after every other forward wrapper (the global-batch loss must count the
    split targets)."""
    from transformers import AttentionInterface

    name = wrapper_name(inner)
    AttentionInterface.register(name, _sequence_attention)
    state = SequenceParallel(mesh, inner)
    _own_config(model)
    model.set_attn_implementation(name)
    if attn_implementation(model.config) != name:
        raise PlanError(f"{type(model).__name__} did not take the sp/cp attention implementation {name!r}")
    for module in model.modules():
        module.__dict__["_xpar_seq"] = state
    install_sequence_mixers(model, state)  # linear-attention / SSM mixers: on the group's whole rows
    original = model.forward
    signature = inspect.signature(original)
    var_kw = next(p.name for p in signature.parameters.values() if p.kind is inspect.Parameter.VAR_KEYWORD)
    params = signature.parameters

    @functools.wraps(original)
    def forward(*args, **kwargs):
        bound = dict(signature.bind_partial(*args, **kwargs).arguments)
        named = {**bound, **bound.pop(var_kw, {})}
        if named.get("past_key_values") is not None or named.get("cache") is not None:
            raise ModelStateError(f"a KV cache (generate) is not supported on an sp/cp mesh (sp={state.sp}, "
                                  f"cp={state.cp}); generate on a mesh without sp/cp")
        keep = named.get("logits_to_keep")
        if keep is not None and not (isinstance(keep, int) and keep == 0):
            raise BatchError(f"sp/cp: logits_to_keep={keep!r} would keep the last tokens of this rank's part, not "
                             "of the rows; leave it 0 under sp/cp")
        part = named.pop(PART_KEY, None)
        if part is None:
            named, part = state.split(named)
        else:
            ref = named.get("input_ids") if named.get("input_ids") is not None else named.get("inputs_embeds")
            local = state.layout(part.seq_len).local.numel()
            if ref is None or ref.shape[1] != local:
                raise BatchError(f"sp/cp: a shard_sequence part of rows of {part.seq_len} tokens holds {local} "
                                 f"tokens per row here, the batch has {None if ref is None else ref.shape[1]}")
            if named.get("attention_mask") is not None:
                raise BatchError("sp/cp: pass no attention_mask with a shard_sequence part (it carries the padding)")
        if "use_cache" in params:
            named["use_cache"] = False
        _keep_wrapped(model, state)
        ref = named.get("input_ids") if named.get("input_ids") is not None else named.get("inputs_embeds")
        state.begin(part, ref.device)
        return original(**named)

    model.forward = forward

    def generate(*args, **kwargs):
        raise ModelStateError(f"generate is not supported on an sp/cp mesh (sp={state.sp}, cp={state.cp}); "
                              "generate on a mesh without sp/cp (checkpoints load on any mesh)")

    model.generate = generate
    return state


def check_inner_available(model: nn.Module, inner: str, sizes: str) -> None:
    """Raise :class:`~xpar_zoo.errors.PlanError` when ``inner`` cannot run for ``model`` here: a class that does
    not support it (as transformers refuses it), or flash without its kernels (the ``flash_attn`` /
    ``flash_attn_interface`` package on a GPU, transformers' hub kernels, or kernels transformers has loaded)."""
    from transformers.utils import is_flash_attn_2_available, is_flash_attn_3_available

    if not supports_attn_implementation(model, inner):
        raise PlanError(f"{sizes}: {type(model).__name__} does not support attention implementation {inner!r}")
    if inner in FLASH_IMPLEMENTATIONS and not flash_kernels_loaded(inner):
        available = is_flash_attn_2_available if inner == "flash_attention_2" else is_flash_attn_3_available
        if not available(kernels_fallback_ok=True):
            raise PlanError(f"{sizes}: {inner} is not available here (no flash_attn kernels for this device); use "
                            "sdpa, or install flash-attn on a GPU")


def set_inner_attention(model: nn.Module, inner: str) -> None:
    """Make ``inner`` (one of :data:`INNER_IMPLEMENTATIONS`) the attention that the sp/cp attention of ``model``
    wraps: what ``model.set_attn_implementation(inner)`` is without sp/cp. (That call on an sp/cp model would replace
    the sp/cp attention itself, and each rank would attend to its own tokens only.) A :class:`PlanError` on another
    name, on one the model's class does not support, and on flash without its kernels."""
    from transformers import AttentionInterface

    state = next((m.__dict__["_xpar_seq"] for m in (model, *model.modules()) if "_xpar_seq" in m.__dict__), None)
    if state is None:
        raise PlanError(f"{type(model).__name__} is not parallelized with sp/cp; call set_attn_implementation")
    if inner not in INNER_IMPLEMENTATIONS:
        raise PlanError(f"sp={state.sp}, cp={state.cp}: attention implementation {inner!r} is not supported under "
                        f"sp/cp; use one of {', '.join(INNER_IMPLEMENTATIONS)}")
    check_inner_available(model, inner, f"sp={state.sp}, cp={state.cp}")
    name = wrapper_name(inner)
    AttentionInterface.register(name, _sequence_attention)
    state.inner = inner
    model.set_attn_implementation(name)


# ---- the public helpers -----------------------------------------------------------------------------------------

def _parallel_state(model: nn.Module):
    for module in (model, *model.modules()):
        state = module.__dict__.get("_xpar")
        if state is not None:
            return state
    return None


def data_shard(model: nn.Module) -> tuple[int, int]:
    """``(index, count)``: this rank's data loader reads part ``index`` of ``count`` equal parts of the global batch.
    The ranks of one sp·cp sequence group get the same index and pass the same rows; ``count = world / (sp·cp)``
    (``(rank, world)`` without sp/cp; ``(0, 1)`` for a model that is not parallelized)."""
    state = _parallel_state(model)
    if state is None:
        return 0, 1
    return state.mesh.data_shard()


def shard_sequence(batch: Mapping[str, torch.Tensor], model: nn.Module) -> dict:
    """This rank's part of a full-length ``batch`` (``input_ids`` or ``inputs_embeds``, ``labels`` /
    ``shift_labels``, ``position_ids``, a 2-D ``attention_mask``): tokens, global ``position_ids`` and labels already
    shifted (as ``labels`` and ``shift_labels``), marked with :data:`PART_KEY` so that ``model(**part)`` knows it
    was given its part. Without sp/cp the batch is returned as a new dict, unchanged."""
    state = next((m.__dict__["_xpar_seq"] for m in (model, *model.modules()) if "_xpar_seq" in m.__dict__), None)
    if state is None:
        return dict(batch)
    if PART_KEY in batch:
        raise BatchError("shard_sequence: the batch is already this rank's part")
    named, part = state.split(dict(batch))
    named = {k: v for k, v in named.items() if v is not None or k in batch}
    named.pop("attention_mask", None)
    named[PART_KEY] = part
    return named
