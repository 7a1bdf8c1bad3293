"""Greedy byte batching, shared by the converters and the checkpoint reader."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeVar

T = TypeVar("T")


def byte_batches(items: Iterable[tuple[T, int]], max_bytes: int) -> list[list[T]]:
    """Consecutive ``(item, nbytes)`` grouped, in order, into batches of at most ``max_bytes`` (an item larger than
    that gets a batch of its own)."""
    out: list[list[T]] = []
    total = 0
    for item, nbytes in items:
        if not out or (out[-1] and total + nbytes > max_bytes):
            out.append([])
            total = 0
        out[-1].append(item)
        total += nbytes
    return out
