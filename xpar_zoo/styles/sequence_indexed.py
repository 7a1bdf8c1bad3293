"""Indexed sparse attention under sp/cp (DeepSeek Sparse Attention: deepseek_v32, glm_moe_dsa, axk2, hy_v4,
dots3_note, mistral_large4), with the real transformers modules.

**The indexer.** A DSA *indexer* (its own module, ``self_attn.indexer``) scores each query against every key of
the row with its own small heads and keeps the top-k keys per query; transformers' attention then lets a query see
only those. Under sp/cp the indexer's ``forward`` is wrapped (:func:`install_indexers`): it runs on this rank's
own ``S/(sp·cp)`` tokens as queries (the sequence split, not a head split: its heads need not divide by ``sp``, and
no all-to-all is needed) against the **whole row's** indexer keys. The keys reach it through the module's own cache
protocol: the wrapper hands it a cache whose ``update_indexer(k)`` all-gathers this rank's keys (computed by the
module's own code) over the sequence group and returns the whole row's, in row order, so the scores, the top-k and
its tie order are those of one process. The mask the indexer scores under is built from the global positions
(causal, packed documents, padding: :meth:`~xpar_zoo.styles.sequence_masks.SequenceForward.block_mask`).

**In blocks.** transformers' indexer holds per-head float32 scores ``[b, q, heads, S]`` for its ``q`` queries; the
wrapper calls it a block of queries at a time so that a block's scores fit the byte budget
(:func:`indexer_block_rows`), never a ``[S, S]`` score tensor beyond it. Where blocks are needed, one call with an
empty key set first computes this rank's keys for the gather. The indexer runs without gradients in transformers
(no indexer loss), so nothing is kept for backward.

**The attention.** The indexer returns the top-k as *global row positions* (``[b, S/(sp·cp), topk]``); under a
wrapper implementation transformers' DSA attention passes them to the attention function as ``indices`` (it folds
them into its mask only for ``eager`` / ``sdpa`` by name), and shared-indexer layers (glm_moe_dsa) reuse them. The
sp/cp attention gathers them over sp (the queries of the cp chunk after the all-to-all) and masks every key a query
did not select, on top of the global mask (:func:`selected_forward`): the whole ``[b, 1, S/cp, S]`` mask per layer
where it fits the budget, else a block of queries at a time (each block's selection rebuilt in backward), as
:func:`~xpar_zoo.styles.sequence_paths.choose_inner_attention` decides.

transformers' DSA attention slices the model's 4-D mask for its indexer (``attention_mask[:, 0]``), which the model
does not build under a wrapper implementation: the attention module's forward gets a broadcastable placeholder
(no memory), unused by the wrapped indexer and the sp/cp attention, which build their masks from global positions.
"""

from __future__ import annotations

import functools
import inspect

import torch
from torch import nn

from ..compat import AttributeView, view_target
from ..errors import ModelStateError, PlanError
from ..parallel.collectives import gather_rows
from ..parallel.mesh import PlanShard
from ..zoo.forward_source import forward_source
from .calls import call_arguments
from .sequence_masks import SequenceForward, current_forward
from .sequence_mixers import decoder_layers, gather_rows_in_order
from .sequence_paths import attention_block_rows

# The indexer's forward parameters the wrapper relies on (transformers' DSA indexer contract).
INDEXER_PARAMETERS = ("hidden_states", "q_resid", "position_embeddings", "attention_mask", "cache")
# The layer types whose attention holds a DSA indexer (or reuses the previous layer's top-k).
INDEXED_LAYER_TYPES = frozenset({"indexed_attention", "minimax_m3_sparse"})
# The forward parameters of a block indexer (minimax_m3's: per key/value head, the top-k blocks of keys out).
BLOCK_PARAMETERS = ("hidden_states", "position_embeddings", "cache", "position_ids")


# ---- which modules --------------------------------------------------------------------------------------------

def is_dsa_indexer(module: nn.Module) -> bool:
    """Whether ``module`` is a DSA indexer the sp/cp wrapper serves: its forward takes the queries' hidden states,
    ``q_resid``, the rotary embeddings, a mask and a ``cache`` whose ``update_indexer`` supplies its keys, and
    returns the top-k key indices."""
    cls = type(module)
    if not cls.__name__.endswith("Indexer"):
        return False
    params = inspect.signature(cls.forward).parameters
    source = forward_source(cls.forward)
    return all(p in params for p in INDEXER_PARAMETERS) and "update_indexer" in source and ".topk(" in source


# The forward parameters of a selection indexer (qwen4_exp's QSA: a dense boolean selection mask out).
SELECTION_PARAMETERS = ("hidden_states", "position_embeddings", "attention_mask", "cache")


def is_selection_indexer(module: nn.Module) -> bool:
    """Whether ``module`` is a selection indexer the sp/cp wrapper serves: its forward takes the queries' hidden
    states, the rotary embeddings of every key (the queries' last), the visibility mask ``[b, 1, q, keys]`` and a
    ``cache`` whose ``update_indexer`` supplies its keys, and returns a boolean ``[b, 1, q, keys]`` selection."""
    cls = type(module)
    if not cls.__name__.endswith("Indexer") or is_dsa_indexer(module):
        return False
    params = list(inspect.signature(cls.forward).parameters)[1:]
    source = forward_source(cls.forward)
    return params[:len(SELECTION_PARAMETERS)] == list(SELECTION_PARAMETERS) and "update_indexer" in source and (
        ".topk(" in source)


def is_block_indexer(module: nn.Module) -> bool:
    """Whether ``module`` is a block indexer the sp/cp wrapper serves: its forward takes the queries' hidden states,
    the rotary embeddings, a ``cache`` whose ``layers[i].update_index`` supplies its keys, and the queries'
    ``position_ids``, and returns per indexer head the top-k blocks of ``block_size`` keys ``[b, heads, q, k]``."""
    cls = type(module)
    if not cls.__name__.endswith("Indexer") or not isinstance(getattr(module, "block_size", None), int):
        return False
    params = list(inspect.signature(cls.forward).parameters)[1:]
    source = forward_source(cls.forward)
    return params[:len(BLOCK_PARAMETERS)] == list(BLOCK_PARAMETERS) and "update_index(" in source and ".topk(" in source


def block_attention_modules(model: nn.Module) -> dict[str, nn.Module]:
    """``{name: attention module}`` of the attention modules of ``model`` whose ``indexer`` is a block indexer and
    that hand its blocks to the attention function as ``block_indices``."""
    return {name: m for name, m in model.named_modules()
            if isinstance(m._modules.get("indexer"), nn.Module) and is_block_indexer(m._modules["indexer"])
            and "block_indices=" in forward_source(type(m).forward)}


def selection_attention_modules(model: nn.Module) -> dict[str, nn.Module]:
    """``{name: attention module}`` of the attention modules of ``model`` whose ``indexer`` is a selection indexer
    and that dispatch through the ``AttentionInterface`` with the selection folded into their mask."""
    return {name: m for name, m in model.named_modules()
            if isinstance(m._modules.get("indexer"), nn.Module) and is_selection_indexer(m._modules["indexer"])
            and "ALL_ATTENTION_FUNCTIONS" in forward_source(type(m).forward)}


def _passes_indices(cls: type) -> bool:
    """Whether the attention class hands the top-k to a non-eager/sdpa attention function as ``indices``."""
    return "indices=" in forward_source(cls.forward)


def indexed_attention_modules(model: nn.Module) -> dict[str, nn.Module]:
    """``{name: attention module}`` of the DSA attention modules of ``model``: a module with an ``indexer``
    attribute (a served indexer, or ``None`` on a layer that reuses the previous layer's top-k)."""
    found = {}
    for name, module in model.named_modules():
        indexer = module.__dict__.get("indexer", module._modules.get("indexer", False))
        if (indexer is None or isinstance(indexer, nn.Module) and is_dsa_indexer(indexer)) and _passes_indices(
                type(module)):
            found[name] = module
    return found


def served_indexed_layer_types(model: nn.Module, config) -> frozenset[str]:
    """The layer types of ``config.layer_types`` that the sp/cp attention serves as indexed attention: each
    layer of the type holds a DSA attention module of :func:`indexed_attention_modules`, and every indexer-like
    module of the model is one :func:`is_dsa_indexer` accepts."""
    types = list(getattr(config, "layer_types", None) or ())
    layers = decoder_layers(model)
    attention = {**indexed_attention_modules(model), **selection_attention_modules(model),
                 **block_attention_modules(model)}
    if not attention or len(layers) != len(types):
        return frozenset()
    if any(type(m).__name__.endswith("Indexer") and not is_dsa_indexer(m) and not is_selection_indexer(m)
           and not is_block_indexer(m) for m in model.modules()):
        return frozenset()
    owners = {id(m) for m in attention.values()}
    served: dict[str, bool] = {}
    for layer, kind in zip(layers, types):
        if kind in INDEXED_LAYER_TYPES:
            served[kind] = served.get(kind, True) and any(id(m) in owners for m in layer.modules())
    return frozenset(k for k, ok in served.items() if ok)


# ---- the indexer on this rank's queries against the whole row's keys -------------------------------------------

def indexer_query_bytes(rows: int, heads: int, keys: int) -> int:
    """What one query of transformers' DSA indexer holds against ``keys`` keys for ``rows`` rows: per key its
    per-head float32 scores and their ReLU (``8·heads``), the summed and masked scores (8) and the mask (1)."""
    return rows * keys * (8 * heads + 9)


def indexer_block_rows(rows: int, heads: int, queries: int, keys: int, budget: float) -> int | None:
    """Queries per call of the indexer, or ``None`` where all ``queries`` fit ``budget`` bytes at once."""
    per_query = indexer_query_bytes(rows, heads, keys)
    if queries * per_query <= budget:
        return None
    return max(1, int(budget // per_query))


def indexed_layer_count(config) -> int:
    """How many layers of ``config`` attend through a DSA indexer's top-k (its ``indexed_attention`` layer types)."""
    if not getattr(config, "index_topk", None):
        return 0
    return sum(kind in INDEXED_LAYER_TYPES for kind in getattr(config, "layer_types", None) or ())


def indexed_attention_bytes(config, rows: int, seq: int, dtype_bytes: int, sp: int, cp: int, eager: bool,
                            budget: float) -> tuple[float, float]:
    """What DSA adds on one rank for ``rows`` rows of ``seq`` tokens: ``(the indexer's transient, the selection mask
    one indexed layer keeps for backward)``. Without sp/cp transformers' own: the whole row's scores
    (:func:`indexer_query_bytes` per query) and its ``[b, 1, S, S]`` mask with the top-k folded in (boolean for sdpa,
    additive for eager). Under sp/cp: the indexer's ``S/(sp·cp)`` queries a block at a time under ``budget``, and
    the layer's ``[b, 1, S/cp, S]`` additive mask where it fits the budget (beyond it, one block's, transient)."""
    heads = getattr(config, "index_n_heads", None) or 1
    per_query = indexer_query_bytes(rows, heads, seq)
    if sp * cp == 1:
        return float(per_query * seq), float(rows * seq * seq * (dtype_bytes if eager else 1))
    local = seq // (sp * cp)
    block = indexer_block_rows(rows, heads, local, seq, budget)
    q_heads = config.num_attention_heads // sp
    whole = attention_block_rows(rows, q_heads, seq // cp, seq, dtype_bytes, eager, budget, selected=True) is None
    kept = rows * (seq // cp) * seq * dtype_bytes if whole else 0
    return float((block or local) * per_query), float(kept)


class _RowKeys:
    """The cache the wrapped indexer is handed: ``update_indexer(k)`` gathers this rank's indexer keys over the
    sequence group once and returns the whole row's (in row order), or none while only gathering."""

    def __init__(self, state, batch) -> None:
        self.state, self.batch = state, batch
        self.keys: torch.Tensor | None = None
        self.gathering = False

    def update_indexer(self, k: torch.Tensor, layer_idx: int) -> torch.Tensor:
        if self.keys is None:
            self.keys = gather_rows_in_order(k, self.state, self.batch)
        return self.keys[:, :0] if self.gathering else self.keys


def _indexer_forward(module: nn.Module, state, original, signature: inspect.Signature):
    @functools.wraps(original)
    def forward(*args, **kwargs):
        batch = current_forward(state, f"{type(module).__name__} (sp/cp indexer)")
        named = call_arguments(signature, args, kwargs)
        if named.get("cache") is not None:
            raise ModelStateError("sp/cp: a KV cache reached the indexer; generate on a mesh without sp/cp")
        hidden, q_resid, (cos, sin) = named["hidden_states"], named["q_resid"], named["position_embeddings"]
        b, local = hidden.shape[:2]
        seq_len = batch.keys.numel()
        positions = batch.local  # this rank's token positions
        every = torch.arange(seq_len, device=hidden.device)
        heads = getattr(module.config, "index_n_heads", None) or getattr(module, "n_heads", 1)
        rows = indexer_block_rows(b, heads, local, seq_len, state.options.block_budget(hidden.device.type))
        state.paths["indexer_whole" if rows is None else "indexer_blocked"] += 1
        cache = _RowKeys(state, batch)
        position_ids = named.get("position_ids")

        def run(lo: int, n: int, mask: torch.Tensor) -> torch.Tensor:
            def part(t):
                return t[:, lo:lo + n] if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[1] == local else t
            return original(hidden_states=part(hidden), q_resid=part(q_resid), position_embeddings=(part(cos),
                            part(sin)), attention_mask=mask, position_ids=part(position_ids), cache=cache)

        def mask_of(lo: int, n: int) -> torch.Tensor:
            return batch.block_mask(positions[lo:lo + n], every, True, None, None)[:, 0]  # [b, n, S] boolean

        if rows is None:
            return run(0, local, mask_of(0, local))
        cache.gathering = True  # this rank's keys, gathered: one call with no keys to score against
        run(0, local, torch.ones(b, local, 0, dtype=torch.bool, device=hidden.device))
        cache.gathering = False
        return torch.cat([run(lo, min(rows, local - lo), mask_of(lo, min(rows, local - lo)))
                          for lo in range(0, local, rows)], dim=1)

    return forward


def _placeholder_mask(original, signature: inspect.Signature):
    """The DSA attention's forward, given a broadcastable ``[b, 1, s, 1]`` mask (no memory) where the model passes
    none: transformers slices it for the indexer, which the wrapper gives its own."""
    @functools.wraps(original)
    def forward(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        if bound.arguments.get("attention_mask") is None:
            hidden = bound.arguments["hidden_states"]
            placeholder = torch.ones((), dtype=torch.bool, device=hidden.device)
            bound.arguments["attention_mask"] = placeholder.expand(hidden.shape[0], 1, hidden.shape[1], 1)
        return original(*bound.args, **bound.kwargs)

    return forward


def _visible_rows(module: nn.Module, state, original, signature: inspect.Signature):
    """A selection attention's forward given the global visibility of this rank's queries over the whole row
    (``[b, 1, s, S]`` boolean: causal, packed documents, padding) as its mask, and the rotary embeddings of the whole
    row followed by this rank's (the indexer reads the keys' from the first ``S``, the queries' from the last)."""
    @functools.wraps(original)
    def forward(*args, **kwargs):
        batch = current_forward(state, f"{type(module).__name__} (sp/cp selection attention)")
        bound = signature.bind(*args, **kwargs)
        hidden = bound.arguments["hidden_states"]
        every = torch.arange(batch.keys.numel(), device=hidden.device)
        visible = batch.block_mask(batch.local, every, True, None, None)
        bound.arguments["attention_mask"] = visible.expand(hidden.shape[0], -1, -1, -1)
        bound.arguments["position_embeddings"] = tuple(
            torch.cat([gather_rows_in_order(t, state, batch), t], dim=1) for t in bound.arguments["position_embeddings"])
        return original(*bound.args, **bound.kwargs)

    return forward


class _RowIndexKeys:
    """The cache a block indexer is handed: ``layers[i].update_index(k)`` gathers this rank's indexer keys
    (``[b, 1, s, d]``) over the sequence group and returns the whole row's, in row order."""

    def __init__(self, state, batch) -> None:
        self.state, self.batch, self.layers = state, batch, self

    def __getitem__(self, layer_idx: int) -> _RowIndexKeys:
        return self

    def update_index(self, k: torch.Tensor) -> torch.Tensor:
        return gather_rows_in_order(k.transpose(1, 2), self.state, self.batch).transpose(1, 2)


def _row_cache_forward(module: nn.Module, state, original, signature: inspect.Signature, cache_class: type):
    """The indexer's forward handed ``cache_class(state, this forward's state)`` as its ``cache`` (none may be
    given: a KV cache means generation, refused under sp/cp)."""
    @functools.wraps(original)
    def forward(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        if bound.arguments.get("cache") is not None:
            raise ModelStateError("sp/cp: a KV cache reached the indexer; generate on a mesh without sp/cp")
        bound.arguments["cache"] = cache_class(state, current_forward(state, f"{type(module).__name__} (sp/cp)"))
        return original(*bound.args, **bound.kwargs)

    return forward


def install_indexers(model: nn.Module, state) -> list[str]:
    """Wrap every DSA attention module of ``model`` (its mask placeholder) and its indexer (this rank's queries
    against the whole row's keys, in blocks under the budget), and every selection attention module (the global
    visibility and the whole row's rotary embeddings) and its indexer (the whole row's keys), for ``state``'s
    sequence group (a :class:`~xpar_zoo.styles.sequence.SequenceParallel`); returns the attention modules' names."""
    found = indexed_attention_modules(model)
    for module in found.values():
        original = module.forward
        module.forward = _placeholder_mask(original, inspect.signature(original))
        indexer = module.indexer
        if indexer is not None:
            inner = indexer.forward
            indexer.forward = _indexer_forward(indexer, state, inner, inspect.signature(inner))
    selection = selection_attention_modules(model)
    for module in selection.values():
        original = module.forward
        module.forward = _visible_rows(module, state, original, inspect.signature(original))
        inner = module.indexer.forward
        module.indexer.forward = _row_cache_forward(module.indexer, state, inner, inspect.signature(inner), _RowKeys)
    blocks = block_attention_modules(model)
    for module in blocks.values():
        inner = module.indexer.forward
        module.indexer.forward = _row_cache_forward(module.indexer, state, inner, inspect.signature(inner), _RowIndexKeys)
    return [*found, *selection, *blocks]


# ---- the attention under the selection --------------------------------------------------------------------------

def check_indexed_inner(module: nn.Module, inner: str) -> None:
    """Raise :class:`~xpar_zoo.errors.PlanError` when the indexer's top-k cannot be applied with ``inner``:
    transformers applies it as a mask for eager and sdpa only (flex and flash would attend densely)."""
    if inner not in ("eager", "sdpa"):
        raise PlanError(f"sp/cp: {type(module).__name__} is indexed sparse attention, which transformers applies "
                        f"with eager or sdpa only (its top-k is a mask there); {inner} would ignore the top-k")


def gather_selection(indices: torch.Tensor, state) -> torch.Tensor:
    """The top-k of this rank's queries (``[b, S/(sp·cp), topk]``, global row positions) for the queries of its cp
    chunk after the sp all-to-all (``[b, S/cp, topk]``, gathered over sp in rank order), as int64."""
    indices = indices.long()
    if state.sp == 1:
        return indices
    rows = indices.transpose(0, 1).contiguous()
    shard = PlanShard(state.sp_group, state.sp, state.sp_rank, 0)
    return gather_rows(rows, [rows.shape[0]] * state.sp, shard).transpose(0, 1)


class _Selected(AttributeView):
    """The forward's masks (a :class:`~xpar_zoo.styles.sequence_masks.SequenceForward`) with the keys a query did
    not select masked too: what the whole-mask and blocked paths build their masks from (per layer: the selection is
    the layer's)."""

    def __init__(self, batch: SequenceForward, selection: torch.Tensor) -> None:
        local = torch.full((batch.keys.numel(),), -1, dtype=torch.long, device=batch.queries.device)
        local = local.index_put_((batch.queries,), torch.arange(batch.queries.numel(), device=local.device))
        super().__init__(batch, {"selection": selection, "query_rows": local})

    def chosen(self, queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """``[b, 1, len(queries), len(keys)]``: whether each query (global positions) selected each key."""
        rows = self.selection[:, self.query_rows[queries]]
        picked = torch.zeros(*rows.shape[:2], self.keys.numel(), dtype=torch.bool, device=rows.device)
        return picked.scatter_(-1, rows, True)[:, None, :, keys]

    def block_mask(self, queries, keys, causal, window, additive_dtype):
        mask = view_target(self).block_mask(queries, keys, causal, window, additive_dtype)
        chosen = self.chosen(queries, keys)
        if additive_dtype is None:
            return mask & chosen
        return mask.masked_fill(~chosen, torch.finfo(additive_dtype).min)

    def mask(self, causal: bool, window: int | None, additive_dtype):
        """The whole ``[b, 1, S/cp, S]`` mask of this layer's selection (not shared: each layer selects its own)."""
        return self.block_mask(self.queries, self.keys, causal, window, additive_dtype)


class _Chosen(_Selected):
    """:class:`_Selected` from a dense selection: ``[b, S/cp, S]`` boolean of the cp chunk's queries against the
    row's keys in row order."""

    def chosen(self, queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        return self.selection[:, None, self.query_rows[queries]][..., keys]


class _Blocks(_Selected):
    """:class:`_Selected` from a block indexer's choice: ``[b, index heads, S/cp, k]`` blocks of ``block_size``
    keys per query of the cp chunk (``-1``: none), each index head choosing for its group of query heads; the mask
    is per head, for this sp rank's ``count`` heads from ``first``."""

    def __init__(self, batch: SequenceForward, selection: torch.Tensor, block_size: int, group: int, first: int,
                 count: int) -> None:
        super().__init__(batch, selection)
        self.__dict__.update(block_size=block_size, group=group, first=first, count=count)

    def chosen(self, queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """``[b, count, len(queries), len(keys)]``: whether each of this rank's heads sees each key."""
        rows = self.selection[:, :, self.query_rows[queries]]
        blocks = -(-self.keys.numel() // self.block_size)
        picked = torch.zeros(*rows.shape[:3], blocks + 1, dtype=torch.bool, device=rows.device)
        picked = picked.scatter_(-1, rows.masked_fill(rows < 0, blocks).long(), True)[..., keys // self.block_size]
        return picked.repeat_interleave(self.group, 1)[:, self.first:self.first + self.count]


def block_forward(state, module: nn.Module, blocks: torch.Tensor, heads: int) -> _Blocks:
    """The current forward of ``state`` seen with ``module``'s block indexer's choice (``[b, index heads,
    S/(sp·cp), k]`` of this rank's queries, gathered over sp) masking every key outside a query head's blocks;
    ``heads``: the layer's query heads."""
    rows = blocks
    if state.sp > 1:
        shard = PlanShard(state.sp_group, state.sp, state.sp_rank, 0)
        packed = blocks.transpose(0, 2).contiguous()
        rows = gather_rows(packed, [packed.shape[0]] * state.sp, shard).transpose(0, 2)
    count = heads // state.sp
    return _Blocks(state.current, rows, module.indexer.block_size, heads // blocks.shape[1], state.sp_rank * count,
                   count)


def selection_mask(module: nn.Module, attention_mask) -> torch.Tensor | None:
    """The dense selection ``[b, s, S]`` (this rank's queries against the row's keys in row order) a selection
    attention module hands the attention function as its mask, or ``None`` for another module."""
    indexer = module._modules.get("indexer") if isinstance(module, nn.Module) else None
    if not isinstance(indexer, nn.Module) or not is_selection_indexer(indexer):
        return None
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dtype != torch.bool:
        raise ModelStateError(f"sp/cp: {type(module).__name__} passed no boolean selection mask to its attention")
    return attention_mask[:, 0]


def chosen_forward(state, selection: torch.Tensor) -> _Chosen:
    """The current forward of ``state`` seen with a dense selection (``[b, S/(sp·cp), S]`` of this rank's queries,
    gathered over sp) masking every key a query did not select."""
    rows = selection
    if state.sp > 1:
        shard = PlanShard(state.sp_group, state.sp, state.sp_rank, 0)
        packed = selection.transpose(0, 1).to(torch.uint8).contiguous()
        rows = gather_rows(packed, [packed.shape[0]] * state.sp, shard).transpose(0, 1).bool()
    return _Chosen(state.current, rows)


def selected_forward(state, indices: torch.Tensor) -> _Selected:
    """The current forward of ``state`` (a :class:`~xpar_zoo.styles.sequence.SequenceParallel`) seen with the DSA
    top-k ``indices`` of this rank's queries (gathered over sp: :func:`gather_selection`) masking every key a query
    did not select."""
    return _Selected(state.current, gather_selection(indices, state))
