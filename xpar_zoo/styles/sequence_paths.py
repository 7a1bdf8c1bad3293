"""Which inner path the sp/cp attention runs (:mod:`xpar_zoo.styles.sequence_inner` holds the paths): one pure
decision, :func:`choose_inner_attention`, that the attention wrapper
(:class:`~xpar_zoo.styles.sequence.SequenceParallel`) makes per call and the sizer (``xpar-zoo size``) makes for the
rows it sizes, so the two cannot drift; and the block budget's arithmetic (:func:`attention_block_rows`).

- ``flex_attention`` and flash (``flash_attention_2/3``) build their own masks from the global indices: :data:`FLEX`,
  :data:`FLASH`.
- ``sdpa`` on rows whose mask is plain causality: queries and keys both in row order (no cp) run sdpa's own causal
  kernel without a mask (:data:`SDPA_CAUSAL`); cp's chunks against the gathered row run each query run against its
  key prefix, aligned lower-right (:data:`LOWER_RIGHT`), where the options' ``cp_attention`` says so (on CUDA and
  the CPU by default) and the attention has no sinks.
- A DSA indexer's top-k (``selected``, :mod:`xpar_zoo.styles.sequence_indexed`: eager and sdpa only) masks every key
  a query did not select on top of the mask below, so it always takes the mask.
- Otherwise the dense mask of the global positions: built once per forward and shared by the layers where it (and
  eager's scores) fit the block budget (:data:`WHOLE_MASK`), else a block of queries at a time
  (:data:`BLOCKED`, :func:`block_rows` queries per block).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from ..parallel.options import ParallelOptions

FLASH_IMPLEMENTATIONS = ("flash_attention_2", "flash_attention_3")


class InnerPath(str, enum.Enum):
    """The inner paths of the sp/cp attention."""

    FLEX = "flex"  # transformers' flex_attention with a BlockMask from the global indices
    FLASH = "flash"  # transformers' flash forward per query run against its key prefix (varlen when packed / padded)
    SDPA_CAUSAL = "sdpa_causal"  # sdpa's own causal kernel over whole rows, no mask
    LOWER_RIGHT = "lower_right"  # sdpa per cp query run against its key prefix, causal lower-right, no dense mask
    WHOLE_MASK = "whole_mask"  # the [b, 1, S/cp, S] mask, once per forward, shared by the layers
    BLOCKED = "blocked"  # the mask a block of queries at a time, each block checkpointed


class MaskKind(str, enum.Enum):
    """What the attention mask of the global positions is for one call."""

    CAUSAL_IN_ORDER = "causal_in_order"  # plain causality, queries and keys both in row order (no cp)
    CAUSAL = "causal"  # plain causality by global position (cp: a chunk of queries against the gathered row)
    MASKED = "masked"  # packed documents, padding, a window shorter than the row, or not causal


@dataclass(frozen=True)
class AttentionSizes:
    """One call's sizes on one rank: ``rows`` rows, ``heads`` query heads, ``queries`` against ``keys`` positions,
    ``dtype_bytes`` per element."""

    rows: int
    heads: int
    queries: int
    keys: int
    dtype_bytes: int


def attention_query_bytes(rows: int, heads: int, keys: int, dtype_bytes: int, eager: bool,
                          selected: bool = False) -> int:
    """What one query of the masked sp/cp attention holds while its block runs, for ``rows`` rows against ``keys``
    keys (``heads`` per rank): per key its additive mask (``dtype_bytes``) and the boolean terms it is built from
    (2), for eager its scores, their softmax and gradients (``heads·(8 + 2·dtype_bytes)``; sdpa makes no score
    matrix), and under a DSA selection (``selected``) the selection's boolean and its masked copy
    (``1 + dtype_bytes``)."""
    per_key = dtype_bytes + 2 + (heads * (8 + 2 * dtype_bytes) if eager else 0) + (1 + dtype_bytes if selected else 0)
    return rows * keys * per_key


def attention_block_rows(rows: int, heads: int, queries: int, keys: int, dtype_bytes: int, eager: bool,
                         budget: float, selected: bool = False) -> int | None:
    """Queries per block of the blocked attention for ``rows`` rows of ``queries`` queries against ``keys`` keys,
    or ``None`` where all of them fit ``budget`` bytes
    (:meth:`~xpar_zoo.parallel.options.ParallelOptions.block_budget`; a query's bytes: :func:`attention_query_bytes`):
    then one mask per forward, shared by the layers."""
    per_query = attention_query_bytes(rows, heads, keys, dtype_bytes, eager, selected)
    if queries * per_query <= budget:
        return None
    return max(1, int(budget // per_query))


def block_rows(implementation: str, device_type: str | None, sizes: AttentionSizes, options: ParallelOptions,
               selected: bool = False) -> int | None:
    """Queries per block of the masked attention, or ``None`` where the whole mask (and eager's scores, and a DSA
    selection's masks) fit the options' block budget on ``device_type``."""
    return attention_block_rows(sizes.rows, sizes.heads, sizes.queries, sizes.keys, sizes.dtype_bytes,
                                implementation == "eager", options.block_budget(device_type), selected)


def choose_inner_attention(implementation: str, device_type: str | None, mask: MaskKind, sizes: AttentionSizes,
                           options: ParallelOptions, *, sinks: bool = False, selected: bool = False) -> InnerPath:
    """The inner path of the sp/cp attention around ``implementation`` on a ``device_type`` device for a call whose
    mask is ``mask``, of ``sizes``, under ``options`` (``sinks``: the attention has per-head sinks, which sdpa's
    lower-right path does not take; ``selected``: a DSA indexer's top-k masks the keys too). See the module
    docstring."""
    if selected:
        whole = block_rows(implementation, device_type, sizes, options, selected=True) is None
        return InnerPath.WHOLE_MASK if whole else InnerPath.BLOCKED
    if implementation == "flex_attention":
        return InnerPath.FLEX
    if implementation in FLASH_IMPLEMENTATIONS:
        return InnerPath.FLASH
    if implementation == "sdpa" and mask is MaskKind.CAUSAL_IN_ORDER:
        return InnerPath.SDPA_CAUSAL
    if (implementation == "sdpa" and mask is MaskKind.CAUSAL and not sinks
            and options.cp_lower_right(device_type or "cpu")):
        return InnerPath.LOWER_RIGHT
    if block_rows(implementation, device_type, sizes, options) is None:
        return InnerPath.WHOLE_MASK
    return InnerPath.BLOCKED
