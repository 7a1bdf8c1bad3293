"""The token layout of sp/cp long context (:mod:`xpar_zoo.styles.sequence`) and its collectives: which global
token positions a rank holds (:func:`token_layout`), the packed documents of a row (:func:`document_ids`), Ulysses'
all-to-alls between sequence and heads, and cp's all-gather of keys and values.

**Tokens.** The ``sp·cp`` ranks of a *sequence group* (:class:`~xpar_zoo.mesh.Mesh`) share one micro-batch of
``b`` rows of ``S`` tokens. The ``S`` positions are dealt to the ``cp`` ranks head-tail (zig-zag): the row is cut
into ``2·cp`` equal chunks and cp rank ``c`` keeps chunks ``c`` and ``2·cp-1-c`` (causal work balanced; without cp
one chunk: the row); each cp chunk is cut into ``sp`` consecutive parts, one per sp rank. So a rank holds
``S/(sp·cp)`` tokens outside attention (``S`` must divide by ``2·cp·sp``, or by ``sp`` without cp).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..compat import is_fake, real_tensors
from ..errors import BatchError, PlanError
from ..parallel.collectives import GatherRows, all_to_all
from ..parallel.mesh import PlanShard

# ---- the token layout -------------------------------------------------------------------------------------------

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
    with real_tensors():  # a function of the sizes alone: real in a simulated world too (its runs are read on host)
        queries = cp_chunk(seq_len, cp, cp_rank)
        part = seq_len // (sp * cp)
        keys = torch.cat([cp_chunk(seq_len, cp, c) for c in range(cp)])
        return TokenLayout(queries[sp_rank * part:(sp_rank + 1) * part], queries, keys)


def document_ids(position_ids: torch.Tensor) -> torch.Tensor | None:
    """``[b, S]`` document numbers of packed rows (a document starts where ``position_ids`` do not step by one,
    transformers' ``find_packed_sequence_indices``), or ``None`` when every row is one document (and for fake
    positions, which have no values)."""
    if is_fake(position_ids):  # a simulated world's rows have no values: plain rows (xpar_zoo.sizing.simulate)
        return None
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


def check_heads(heads: int, sp: int, owner: str) -> None:
    """Raise :class:`~xpar_zoo.errors.PlanError` (naming ``owner``, the model) when Ulysses ``sp`` does not divide
    its ``heads`` query heads, with the split that fits (cp is not limited by heads)."""
    if heads % sp:
        hint = (f"; use sp={heads}, cp={sp // heads} instead" if sp > heads and sp % heads == 0
                else "; use a smaller sp, or cp")
        raise PlanError(f"sp={sp} does not divide the {heads} query heads of {owner}{hint} (cp is not limited by "
                        "heads)")


def kv_repeat(query_heads: int, kv_heads: int, sp: int) -> int:
    """How many times each key/value head is repeated before the sp all-to-all so that the key/value heads divide
    by ``sp`` and still divide the query heads (1: none)."""
    for r in range(1, query_heads // kv_heads + 1):
        if (kv_heads * r) % sp == 0 and query_heads % (kv_heads * r) == 0:
            return r
    raise PlanError(f"cannot spread {kv_heads} key/value heads over sp={sp} for {query_heads} query heads")
