"""The per-forward state of the sp/cp attention (:mod:`xpar_zoo.styles.sequence`): :class:`SequenceForward` holds
the global indices of one forward's queries and keys, its packed documents and padding, and in :class:`ForwardCache`
what the layers share: host-side facts and the masks built from them (dense, per block, flex's ``BlockMask`` through
:func:`banded_block_mask`, flash's varlen segments) and the hybrid mixers' gathered rows.

The mask is built from the *global* token indices, never from the local mask transformers would build for a shard:
causal, a ``sliding_window`` (as transformers passes it), packed documents (a new document starts where
``position_ids`` do not step by one, transformers' own rule, so no token attends across a boundary, across cp chunks
too) and padding. Additive in the query dtype (for ``sdpa`` too: a boolean one would become a float copy per layer
inside it), ``[b, 1, S/cp, S]`` per forward (built once per window, shared by the layers) where it fits a byte
budget; beyond it a block of queries at a time, each block's mask rebuilt in backward
(:func:`~xpar_zoo.styles.sequence_inner.blocked_attention`; the choice:
:func:`~xpar_zoo.styles.sequence_paths.choose_inner_attention`).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import torch
from torch import nn

from ..errors import ModelStateError
from ..parallel.state import consecutive_runs
from .sequence_paths import MaskKind

Block = tuple[int, int, "slice | torch.Tensor"]  # (first local query, queries, keys: an index of the gathered keys)
Segments = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int]  # flash's varlen layout of a run


def current_forward(state, what: str) -> SequenceForward:
    """The forward ``state`` (a :class:`~xpar_zoo.styles.sequence.SequenceParallel`) is in; a
    :class:`~xpar_zoo.errors.ModelStateError` naming ``what`` ran outside one."""
    if state.current is None:
        raise ModelStateError(f"{what} ran outside a forward of the parallelized model")
    return state.current


@dataclass
class ForwardCache:
    """What one forward builds once and its layers share (each a host sync or a mask), by what it is for. The
    attention fills the first part, the hybrid mixers (:mod:`~xpar_zoo.styles.sequence_mixers`) the second."""

    in_order: bool | None = None  # queries and keys both in row order (no cp)
    runs: list[tuple[int, int, int]] | None = None  # the queries' runs of consecutive positions
    key_order: torch.Tensor | None = None  # puts the gathered keys in row order
    sees_a_key: bool | None = None  # every query has an allowed key under the causal mask
    dense: dict[tuple[bool, int | None, torch.dtype | None], torch.Tensor] = field(default_factory=dict)
    blocks: dict[tuple[int, bool, int | None], list[Block]] = field(default_factory=dict)
    flex: dict[tuple[bool, int | None], object] = field(default_factory=dict)  # BlockMasks by (causal, window)
    segments: dict[tuple[int, int], Segments] = field(default_factory=dict)  # by (run end, run length)
    # the hybrid mixers': the whole rows' 0/1 padding mask (None: no padding), and the gathered per-token kwargs by
    # the id of the local tensor (kept beside it: ids are reused once freed)
    mixer_mask: torch.Tensor | None = None
    mixer_kwargs: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # the halo projections' (zaya): this rank's tokens as runs of consecutive positions
    halo_runs: list[tuple[int, int, int]] | None = None
    # the compressors' (deepseek_v4): by the id of their attention module, how many entries the compressor appended
    # to its keys and which of them each of this rank's queries may see (until the attention takes them)
    compressed: dict[int, tuple[int, torch.Tensor | None]] = field(default_factory=dict)
    # the positioned attention's (inkling): the attention modules that got the whole row's keys from a row cache
    # (until their attention call), and the forward seen with this rank's tokens as queries against the whole row
    row_keys: set[int] = field(default_factory=set)
    row_forward: SequenceForward | None = None


@dataclass
class SequenceForward:
    """What the attention of one forward needs: the global indices of the queries and keys (on the device), the
    packed documents and the padding of the whole rows, this rank's own tokens outside attention (``local``, on the
    device: the hybrid mixers and indexers keep them of their whole-row outputs), and what its layers share
    (:class:`ForwardCache`)."""

    queries: torch.Tensor
    keys: torch.Tensor
    docs: torch.Tensor | None
    key_valid: torch.Tensor | None
    local: torch.Tensor | None = None
    cache: ForwardCache = field(default_factory=ForwardCache)
    vision_blocks: torch.Tensor | None = None  # [b, S]: each image's block number, -1 elsewhere (see block_mask)

    def mask_kind(self, causal: bool, window: int | None, keys: int) -> MaskKind:
        """What this call's mask is (:class:`~xpar_zoo.styles.sequence_paths.MaskKind`): plain causality in row
        order, plain causality by global position, or more."""
        if not self.causal_only(causal, window, keys):
            return MaskKind.MASKED
        return MaskKind.CAUSAL_IN_ORDER if self.in_order() else MaskKind.CAUSAL

    def in_order(self) -> bool:
        """Whether the queries and keys are both in row order (no cp). One host sync per forward."""
        if self.cache.in_order is None:
            self.cache.in_order = self.queries.shape == self.keys.shape and bool((self.keys == self.queries).all())
        return self.cache.in_order

    def causal_only(self, causal: bool, window: int | None, keys: int) -> bool:
        """Whether the mask is plain causality by global position (no packed documents, no padding, no window
        shorter than the row), whatever the order of the queries and keys."""
        return (causal and self.docs is None and self.key_valid is None and (window is None or window >= keys)
                and not self.bidirectional(window))

    def bidirectional(self, window: int | None) -> bool:
        """Whether this call's mask lets the tokens of one image see each other both ways: a sliding-window layer
        of rows whose images attend bidirectionally (:attr:`vision_blocks`)."""
        return self.vision_blocks is not None and window is not None

    def query_runs(self) -> list[tuple[int, int, int]]:
        """The runs of consecutive global positions in the queries (cp: the head chunk and the tail chunk):
        ``[(first local query, queries, global end)]``; a run attends causally to the row's keys before its end."""
        if self.cache.runs is None:  # one host sync per forward
            self.cache.runs = [(i, n, first + n) for i, first, n in consecutive_runs(self.queries.tolist())]
        return self.cache.runs

    def key_order(self) -> torch.Tensor:
        """Indices that put the cp-gathered keys in row order (``keys[:, :, order]``)."""
        if self.cache.key_order is None:
            self.cache.key_order = torch.argsort(self.keys)
        return self.cache.key_order

    def keys_in_row_order(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``[b, h, S, d]`` tensors of the gathered keys (keys, values) put in row order."""
        order = self.key_order()
        return tuple(t[:, :, order] for t in tensors)

    def mask(self, causal: bool, window: int | None, additive_dtype: torch.dtype | None) -> torch.Tensor:
        """The ``[b, 1, S/cp, S]`` mask of the whole forward (boolean, or additive in ``additive_dtype``), built
        once per window and kind and shared by the layers."""
        key = (causal, window, additive_dtype)
        if key not in self.cache.dense:
            self.cache.dense[key] = self.block_mask(self.queries, self.keys, causal, window, additive_dtype)
        return self.cache.dense[key]

    def block_mask(self, queries: torch.Tensor, keys: torch.Tensor, causal: bool, window: int | None,
                   additive_dtype: torch.dtype | None) -> torch.Tensor:
        """The ``[b, 1, len(queries), len(keys)]`` mask of the given global query and key positions (not kept)."""
        q, k = queries[:, None], keys[None, :]
        allowed = k <= q if causal else torch.ones(q.shape[0], k.shape[1], dtype=torch.bool, device=q.device)
        if window is not None:
            allowed = allowed & (k > q - window)  # q - k < window, without an int64 [q, k] difference
        allowed = allowed[None]
        if self.bidirectional(window):  # (causal or the same image) and the window: Gemma 4's sliding layers
            blocks = self.vision_blocks
            same = (blocks[:, queries, None] == blocks[:, None, keys]) & (blocks[:, queries, None] >= 0)
            allowed = allowed | (same & (k > q - window)[None])
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

    def blocks(self, rows: int, causal: bool, window: int | None) -> list[Block]:
        """The query blocks of :func:`blocked_attention`: ``[(first local query, queries, keys)]``, at most
        ``rows`` consecutive global positions each (never across a run: cp's head and tail chunks apart). ``keys``
        indexes the gathered keys: with a causal mask and no padding only those a query of the block may see (the
        row up to the block's last position, from its first less the window, and on packed rows from the start of
        its first query's document, the earliest over the rows), else all. One host sync per forward."""
        cache = (rows, causal, window)
        if cache in self.cache.blocks:
            return self.cache.blocks[cache]
        # a query no key is allowed to (left padding) attends to every key: keep them all where one may exist
        trim = causal and not self.bidirectional(window) and (
            self.key_valid is None or (window is None and self.every_query_sees_a_key()))
        order = self.key_order().tolist() if trim else None
        positions = self.keys[self.key_order()].tolist() if trim else None  # the keys' positions, ascending
        floor = self.document_starts() if trim and self.docs is not None else None
        out = []
        for start, n, end in self.query_runs():
            for s in range(start, start + n, rows):
                m = min(rows, start + n - s)
                keys: slice | torch.Tensor = slice(None)
                if trim:
                    first = end - n + (s - start)  # global position of the block's first query
                    earliest = max(0 if window is None else first - window + 1, 0 if floor is None else floor[first])
                    lo = bisect.bisect_left(positions, earliest)
                    keys = _index(order[lo:bisect.bisect_right(positions, first + m - 1)], self.keys.device)
                out.append((s, m, keys))
        self.cache.blocks[cache] = out
        return out

    def every_query_sees_a_key(self) -> bool:
        """Whether, under the causal mask without a window, every query of the rows has an allowed key: each row's
        first token and the first token of each of its packed documents is not padding (right-padded rows are;
        then no query falls back to attending to every key, and a block's keys may be trimmed). One host sync."""
        if self.cache.sees_a_key is None:
            first = torch.zeros_like(self.key_valid)
            first[:, 0] = True
            if self.docs is not None:
                first[:, 1:] |= self.docs[:, 1:] != self.docs[:, :-1]
            self.cache.sees_a_key = bool((self.key_valid | ~first).all())
        return self.cache.sees_a_key

    def document_starts(self) -> list[int]:
        """Per global position, the first position of its packed document, the earliest over the rows (a causal
        query sees no key before it): ``docs`` numbers each row's documents in order, so a document starts where
        its number first appears."""
        starts = torch.searchsorted(self.docs.contiguous(), self.docs.contiguous())  # [b, S], left: the first index
        return starts.min(0).values.tolist()

    def flex_block_mask(self, causal: bool, window: int | None):
        """The mask of :meth:`mask` as a flex ``BlockMask`` (:func:`banded_block_mask` over a ``mask_mod`` that
        computes the global indices): per forward and window, shared by the layers. A query with no
        key left (padding) gets no output, as in flex's own single-process masks."""
        key = (causal, window)
        if key not in self.cache.flex:
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

            blocks = self.vision_blocks if self.bidirectional(window) else None
            if blocks is not None:
                mask_mod = _with_image_blocks(mask_mod, blocks, docs, query_at, key_at, window)
            rows = next((t.shape[0] for t in (docs, valid, blocks) if t is not None), None)
            self.cache.flex[key] = banded_block_mask(mask_mod, rows, self.queries.numel(), self.keys.numel(),
                                                    self.queries.device)
        return self.cache.flex[key]

    def flash_segments(self, end: int, n: int) -> Segments:
        """The varlen layout of the query run of global positions ``[end-n, end)`` against the keys ``[0, end)`` in
        row order, every row flattened into one: ``(query index into [b·n], key index into [b·end], cu_seqlens_q,
        cu_seqlens_k, max_seqlen_q, max_seqlen_k)``. A segment is one document of one row that has an unpadded
        query in the run; its keys are that document's unpadded keys before ``end``, so its queries are the last of
        its keys and flash's bottom-right causal alignment is exact. Padded queries are in no segment (no output, as
        in flash's own unpadding). Once per forward and run (host syncs), shared by the layers."""
        key = (end, n)
        if key not in self.cache.segments:
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
            self.cache.segments[key] = (q_index, k_index, cu_q, cu_k, *longest)
        return self.cache.segments[key]


def lower_right_mask(queries: int, keys: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The additive causal mask of the last ``queries`` of ``keys`` positions, aligned lower-right, for the queries
    in *reverse* order: reversed query ``i`` may see key ``j`` where ``i + j < keys``, so the ``[1, 1, queries, keys]``
    mask is a view with strides ``(0, 0, 1, 1)`` of one row of ``queries + keys - 1`` entries (0 for the first
    ``keys``, the dtype's min after, as :meth:`SequenceForward.block_mask`'s). torch's CPU flash attention reads it
    in place; an op that needs it dense makes a ``[queries, keys]`` copy."""
    row = torch.full((queries + keys - 1,), torch.finfo(dtype).min, dtype=dtype, device=device)
    row[:keys] = 0
    return row.as_strided((1, 1, queries, keys), (0, 0, 1, 1))


def _with_image_blocks(mask_mod, blocks: torch.Tensor, docs: torch.Tensor | None, query_at, key_at, window: int):
    """``mask_mod`` or the same image within the window (and document): the tokens of one image see each other both
    ways (:meth:`SequenceForward.bidirectional`). A separate function, so that the plain ``mask_mod`` flex compiles
    stays as it was."""

    def with_blocks(b, h, q_idx, kv_idx):
        q, k = query_at(q_idx), key_at(kv_idx)
        same = (blocks[b, q] == blocks[b, k]) & (blocks[b, q] >= 0) & (q - k < window)
        if docs is not None:
            same = same & (docs[b, q] == docs[b, k])
        return mask_mod(b, h, q_idx, kv_idx) | same

    return with_blocks


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
