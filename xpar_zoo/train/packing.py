"""Packing whole conversations into ``--seq-len`` rows, and runs measured in epochs.

- :func:`best_fit`: best-fit decreasing bin packing (longest first, each into the fullest row it still fits).
- :class:`ConversationCorpus`: the rows of packed conversations, with the interface of
  :class:`~xpar_zoo.train.data.PackedCorpus` (``rows``, ``rows_per_epoch``, ``fingerprint``…): the packing is made
  once, the order of the rows reshuffled every epoch from ``(seed, epoch)``. As for packed documents,
  ``position_ids`` restart at every conversation (so no token attends across conversations) and the row's tail is
  padding (its own positions, no target). Labels are the token where the target mask is set, else ``-100``.
- :class:`EpochLimit`: a corpus read for ``epochs`` epochs only: rows past the end are padding without targets,
  so the last step of ``--epochs N`` trains on the data's remainder and nothing else.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Sequence

import numpy as np
import torch

from ..errors import DataError
from ..loss.global_batch import IGNORE_INDEX


def best_fit(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Indices of ``lengths`` grouped into bins of at most ``capacity`` (best-fit decreasing; deterministic, each
    bin's indices in ascending order). Every length must be at most ``capacity``."""
    order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    bins: list[list[int]] = []
    free: dict[int, list[int]] = {}  # room left -> bins with that room
    rooms: list[int] = []  # sorted distinct rooms with a bin
    for i in order:
        n = int(lengths[i])
        if n > capacity:
            raise DataError(f"an item of {n} tokens does not fit a row of {capacity}")
        k = bisect.bisect_left(rooms, n)
        if k < len(rooms):
            room = rooms[k]
            b = free[room].pop()
            if not free[room]:
                del free[room]
                rooms.pop(k)
        else:
            room, b = capacity, len(bins)
            bins.append([])
        bins[b].append(i)
        left = room - n
        if left > 0:
            if left not in free:
                free[left] = []
                bisect.insort(rooms, left)
            free[left].append(b)
    return [sorted(b) for b in bins]


class ConversationCorpus:
    """Conversations (token ids and target masks) packed whole into rows of ``seq_len`` tokens."""

    def __init__(self, ids: list[np.ndarray], masks: list[np.ndarray], seq_len: int, seed: int, pad_id: int,
                 source: str = "data", summary: str = ""):
        if not ids:
            raise DataError(f"{source}: no conversations")
        self.lengths = np.asarray([len(x) for x in ids], dtype=np.int64)
        self.tokens = np.concatenate(ids).astype(np.int64)
        self.targets = np.concatenate(masks).astype(bool)
        self.starts = np.concatenate([[0], np.cumsum(self.lengths)[:-1]])
        self.seq_len, self.seed, self.pad_id, self.source, self.summary = seq_len, seed, pad_id, source, summary
        self.bins = best_fit(self.lengths, seq_len)
        self.rows_per_epoch = len(self.bins)
        self._order: tuple[int, np.ndarray] | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())

    @property
    def num_targets(self) -> int:
        """Target tokens of one epoch (the sum of the masks)."""
        return int(self.targets.sum())

    @property
    def fill(self) -> float:
        """The fraction of the rows' tokens that are data (not padding)."""
        return self.num_tokens / (self.rows_per_epoch * self.seq_len)

    def fingerprint(self) -> str:
        h = hashlib.sha1(b"conversations")
        h.update(np.asarray([self.seq_len, self.seed, len(self.lengths)], dtype=np.int64).tobytes())
        for a in (self.lengths, self.tokens, self.targets):
            h.update(a.tobytes())
        return h.hexdigest()[:16]

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if self._order is None or self._order[0] != epoch:
            self._order = (epoch, np.random.default_rng([self.seed, epoch]).permutation(self.rows_per_epoch))
        return self._order[1]

    def _row(self, g: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        epoch, i = divmod(g, self.rows_per_epoch)
        ids = np.full(self.seq_len, self.pad_id, dtype=np.int64)
        pos = np.empty(self.seq_len, dtype=np.int64)
        target = np.zeros(self.seq_len, dtype=bool)
        at = 0
        for c in self.bins[int(self._epoch_order(epoch)[i])]:
            n, s = int(self.lengths[c]), int(self.starts[c])
            ids[at:at + n] = self.tokens[s:s + n]
            target[at:at + n] = self.targets[s:s + n]
            pos[at:at + n] = np.arange(n)
            at += n
        pos[at:] = np.arange(self.seq_len - at)  # padding: a segment of its own
        return ids, pos, target

    def rows(self, first: int, count: int) -> dict[str, torch.Tensor]:
        """``input_ids``, ``position_ids`` and ``labels`` of global rows ``first … first + count − 1``."""
        parts = [self._row(g) for g in range(first, first + count)]
        ids = torch.from_numpy(np.stack([p[0] for p in parts]))
        pos = torch.from_numpy(np.stack([p[1] for p in parts]))
        target = torch.from_numpy(np.stack([p[2] for p in parts]))
        return {"input_ids": ids, "position_ids": pos, "labels": ids.masked_fill(~target, IGNORE_INDEX)}


def padding_rows(count: int, seq_len: int, pad_id: int) -> dict[str, torch.Tensor]:
    """``count`` rows of padding: no target."""
    ids = torch.full((count, seq_len), pad_id, dtype=torch.int64)
    pos = torch.arange(seq_len).expand(count, seq_len).clone()
    return {"input_ids": ids, "position_ids": pos, "labels": torch.full_like(ids, IGNORE_INDEX)}


class EpochLimit:
    """``corpus`` read for ``epochs`` epochs: global rows from ``epochs · rows_per_epoch`` on are padding."""

    def __init__(self, corpus, epochs: int, pad_id: int):
        self.corpus, self.epochs, self.pad_id = corpus, epochs, pad_id
        self.total_rows = epochs * corpus.rows_per_epoch

    def __getattr__(self, name):
        return getattr(self.corpus, name)

    def rows(self, first: int, count: int) -> dict[str, torch.Tensor]:
        real = max(0, min(count, self.total_rows - first))
        parts = [self.corpus.rows(first, real)] if real else []
        if real < count:
            parts.append(padding_rows(count - real, self.corpus.seq_len, self.pad_id))
        out = {}
        for k in dict.fromkeys(k for p in parts for k in p):
            per_token = [p[k] if k in p else torch.zeros_like(p["input_ids"]) for p in parts]
            out[k] = torch.cat(per_token if parts[0][k].shape == parts[0]["input_ids"].shape
                               else [p[k] for p in parts if k in p])  # per image (pixels): the real rows'
        return out


def steps_for_epochs(epochs: int, rows_per_epoch: int, rows_per_step: int) -> int:
    """Optimizer steps that read ``epochs`` epochs (the last one may be partly padding)."""
    return max(1, math.ceil(epochs * rows_per_epoch / rows_per_step))
