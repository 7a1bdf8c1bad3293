"""The inner attention paths of the sp/cp attention (:mod:`xpar_zoo.styles.sequence`), each called on the
queries of a cp chunk against the gathered keys and values: cp's plain causal rows on sdpa without a dense mask
(:func:`lower_right_attention`), the masked attention a block of queries at a time (:func:`blocked_attention`), and
the inner implementations that take no dense mask (:data:`OWN_MASK_INNER`):
:func:`flex_inner` (a ``BlockMask`` from the global indices) and :func:`flash_inner` (one call per run of query
positions against its key prefix, bottom-right causal; varlen for packed documents and padding); see
docs/long_context.md. Where it would be the plain causal mask of a whole row (no cp, packing, padding or window)
``sdpa`` gets none and runs causal itself (its flash kernels on a GPU). With cp on plain causal rows, ``sdpa`` on
CUDA and the CPU gets no dense one either (:func:`lower_right_attention`: each query chunk against the key prefix
that ends where it ends, aligned lower-right; :meth:`~xpar_zoo.parallel.options.ParallelOptions.cp_lower_right`
chooses).
"""

from __future__ import annotations

import torch

from ..compat import attn_implementation, efficient_attention, is_fake, view_target
from ..errors import PlanError
from .sequence_masks import SequenceForward, lower_right_mask

# ---- sdpa without a mask: cp's plain causal rows ----------------------------------------------------------------


def lower_right_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, batch: SequenceForward,
                          dropout: float, scaling: float | None) -> torch.Tensor:
    """Causal sdpa of the queries of a cp chunk (``[b, h, S/cp, d]``, runs of consecutive global positions: the
    head and tail chunks) against the cp-gathered keys and values of the whole row (``[b, kv, S, d]``), with no
    dense mask: the keys are put in row order once, and each run of queries attends to the prefix of the row that
    ends where the run ends, aligned lower-right. On CUDA with ``torch.nn.attention.bias.causal_lower_right``, the
    key/value heads repeated to the query heads (sdpa's ``enable_gqa`` does not reach its lower-right kernels); on
    the CPU with :func:`lower_right_mask` (torch's CPU sdpa runs a ``causal_lower_right`` bias on its math path,
    whose scores it keeps), key/value heads grouped. Returns ``[b, S/cp, h, dv]`` as transformers' sdpa does."""
    key, value = batch.keys_in_row_order(key, value)
    groups = query.shape[1] // key.shape[1]
    fake = is_fake(query)
    cpu = query.device.type == "cpu" and not fake
    if groups > 1 and not cpu:
        key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    outs = []
    for start, n, end in batch.query_runs():
        q, k, v = query[:, :, start:start + n], key[:, :, :end], value[:, :, :end]
        if fake:  # a simulated world: a GPU's lower-right kernel keeps what its causal one keeps
            o = efficient_attention(q, k, v, True, scaling)
        elif cpu:
            o = _lower_right_on_cpu(q, k, v, dropout, scaling)
        else:
            from torch.nn.attention.bias import causal_lower_right

            o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(n, end),
                                                                 dropout_p=dropout, scale=scaling)
        outs.append(o.transpose(1, 2))
    return torch.cat(outs, dim=1)


def _lower_right_on_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout: float,
                        scaling: float | None) -> torch.Tensor:
    """sdpa of the ``n`` queries ``q`` (``[b, h, n, d]``: the last ``n`` of the ``end`` positions of ``k`` / ``v``,
    ``[b, kv, end, d]`` in row order), causal aligned lower-right, on torch's CPU flash kernel: the queries reversed
    against :func:`lower_right_mask` (``n + end - 1`` entries, not ``n × end``), the output put back in order. The
    values and the queries' gradients are those of the dense mask; the keys' and values' gradients sum the same
    terms in another order."""
    mask = lower_right_mask(q.shape[2], k.shape[2], q.dtype, q.device)
    out = torch.nn.functional.scaled_dot_product_attention(q.flip(2), k, v, attn_mask=mask, dropout_p=dropout,
                                                           scale=scaling, enable_gqa=q.shape[1] != k.shape[1])
    return out.flip(2)


# ---- the masked attention, a block of queries at a time ---------------------------------------------------------

def blocked_attention(call, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, batch: SequenceForward,
                      causal: bool, window: int | None, rows: int) -> torch.Tensor:
    """The masked attention of ``query`` (``[b, h, S/cp, d]``) against ``key`` / ``value`` (``[b, kv, S, d]``,
    gathered order) in blocks of at most ``rows`` queries (:meth:`SequenceForward.blocks`), exact: a query is a row of
    its own softmax, so the blocks need no log-sum-exp merge. Each block builds its own ``[b, 1, rows, keys]`` mask
    from the global positions, against only the keys a causal block may see, and calls ``call(q, k, v, mask)``
    (the inner attention, ``[b, rows, h, dv]`` out) under non-reentrant activation checkpointing: neither its
    mask nor eager's scores are kept for backward, which rebuilds and recomputes one block at a time. So the mask
    and score transients are one block (:func:`~xpar_zoo.styles.sequence_paths.block_rows`), not ``[b, 1, S/cp,
    S]`` per forward and ``[b, h, S/cp, S]`` per layer, for one more forward of the attention in backward. Layer
    checkpointing (``activation_checkpointing_enable``) nests around it."""
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


def _attention_block(call, batch: SequenceForward, causal: bool, window: int | None, start: int, keys, q: torch.Tensor,
                     key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """One block of :func:`blocked_attention`: its keys, its mask, the inner attention."""
    mask = batch.block_mask(batch.queries[start:start + q.shape[2]], batch.keys[keys], causal, window, q.dtype)
    return call(q, key[:, :, keys], value[:, :, keys], mask)


# ---- the inner implementations that take no dense mask: flex and flash ---------------------------------------------

def flex_inner(batch: SequenceForward, module, query, key, value, causal: bool, dropout: float, scaling, window,
               kwargs: dict) -> torch.Tensor:
    """transformers' ``flex_attention`` forward with a ``BlockMask`` built from the global indices
    (:meth:`SequenceForward.flex_block_mask`): no dense ``[S/cp, S]`` mask is kept. Key/value heads stay grouped (flex's
    ``enable_gqa``); a value head dim other than the query's (MLA) is flex's own. Sinks (``s_aux``) need flex's
    log-sum-exp, which transformers does not request on CPU: refused there."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if kwargs.get("s_aux") is not None and query.device.type == "cpu":
        raise PlanError(f"sp/cp: {type(view_target(module)).__name__} has attention sinks (s_aux), which "
                        "flex_attention serves only on CUDA (transformers reads flex's log-sum-exp there); use eager "
                        "or sdpa on CPU")
    block = batch.flex_block_mask(causal, window)
    out, _ = ALL_ATTENTION_FUNCTIONS["flex_attention"](module, query, key, value, block, dropout=dropout,
                                                      scaling=scaling, sliding_window=window, **kwargs)
    return out


def flash_inner(batch: SequenceForward, module, query, key, value, causal: bool, dropout: float, scaling, window,
                kwargs: dict) -> torch.Tensor:
    """transformers' flash forward (``flash_attention_2`` / ``_3``) with no mask: the keys in row order, and each
    run of consecutive query positions (the whole row under sp alone; cp's head and tail chunks) against the key
    prefix that ends where the run ends, causal aligned bottom-right (flash's semantics when fewer queries than
    keys). Packed documents and padding: varlen, with ``cu_seqlens`` for the queries and the keys of each run
    separately (:meth:`SequenceForward.flash_segments`). Sliding window, softcap and sinks pass through to flash (whose
    window, bottom-right aligned, is then exact in global positions)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if not causal:  # each run attends to its key prefix: causal rows only
        raise PlanError(f"sp/cp: {type(view_target(module)).__name__} is not causal; flash attention under sp/cp "
                        "serves causal attention only (use sdpa or flex_attention)")
    function = ALL_ATTENTION_FUNCTIONS[attn_implementation(module.config)]
    if batch.queries.numel() != batch.keys.numel():  # cp: the gathered keys back in row order
        key, value = batch.keys_in_row_order(key, value)
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


def global_kwargs(kwargs: dict) -> dict:
    """The attention's keyword arguments without those transformers computed from this rank's tokens
    (:data:`LOCAL_KWARGS`)."""
    return {k: v for k, v in kwargs.items() if k not in LOCAL_KWARGS}
