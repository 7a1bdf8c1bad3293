"""Bytes each rank sends per collective kind, counted by wrapping torch.distributed's collectives (and xpar_zoo's
in-place FSDP2 collectives on gloo) for the duration of a ``with`` block: what tests/unit/test_sizing.py and
tests/distributed/test_lora.py hold the sizer's predictions against."""

from __future__ import annotations

import contextlib
import inspect
import threading
from collections.abc import Iterator

import torch.distributed as dist

from ..parallel.gloo_comms import InPlaceAllGather, InPlaceReduceScatter


def _gather(n, group, a):
    out = a.get("output_tensor", a.get("output"))
    return (n - 1) / n * out.numel() * out.element_size()


def _scatter(n, group, a):
    inp = a.get("input", a.get("input_tensor"))
    return (n - 1) / n * inp.numel() * inp.element_size()


def _reduce(n, group, a):
    return 2 * (n - 1) / n * a["tensor"].numel() * a["tensor"].element_size()


def _gather_list(n, group, a):
    return (n - 1) * a["tensor"].numel() * a["tensor"].element_size()


def _a2a(n, group, a):
    inp = a["input"]
    row = inp[0].numel() * inp.element_size() if inp.dim() and inp.shape[0] else 0
    splits = a.get("input_split_sizes") or [inp.shape[0] // n] * n
    return (sum(splits) - splits[dist.get_rank(group)]) * row


def _wrap(owner, name, kind, nbytes, totals: dict, saved: dict, busy: threading.local) -> None:
    """Count calls of ``owner.name`` (a torch.distributed function, or a collective class's ``__call__``, whose
    ``self`` binds like any argument) into ``totals[kind]``; what it calls in turn is not counted again. The original
    goes into ``saved``."""
    original = getattr(owner, name)
    saved[owner, name] = original
    signature = inspect.signature(original)

    def counted(*args, **kwargs):
        if getattr(busy, "on", False):
            return original(*args, **kwargs)
        busy.on = True
        try:
            bound = signature.bind(*args, **kwargs).arguments
            group = bound.get("group")
            n = dist.get_world_size(group)
            totals[kind] = totals.get(kind, 0.0) + nbytes(n, group, bound)
            return original(*args, **kwargs)
        finally:
            busy.on = False
    setattr(owner, name, counted)


@contextlib.contextmanager
def count_sent_bytes(totals: dict) -> Iterator[dict]:
    """Count the bytes this rank sends per collective kind (ring model: (n-1)/n of the unsharded buffer for
    all-gather / reduce-scatter, 2(n-1)/n for all-reduce, the rows addressed to other ranks for all-to-all)."""
    busy = threading.local()
    saved = {}  # (owner, name) -> the original
    wrapped = [(dist, "all_gather_single", "all_gather", _gather),
               (dist, "all_gather_into_tensor", "all_gather", _gather),
               (dist, "reduce_scatter_single", "reduce_scatter", _scatter),
               (dist, "reduce_scatter_tensor", "reduce_scatter", _scatter),
               (dist, "all_gather", "all_gather", _gather_list), (dist, "all_reduce", "all_reduce", _reduce),
               (dist, "all_to_all_single", "all_to_all", _a2a),
               # FSDP2's collectives on gloo (xpar_zoo.parallel.gloo_comms): counted as the all-gather and
               # reduce-scatter they do (ring model), not as the broadcasts and all-reduce they run on
               (InPlaceAllGather, "__call__", "all_gather", _gather),
               (InPlaceReduceScatter, "__call__", "reduce_scatter", _scatter)]
    for owner, name, kind, nbytes in wrapped:
        _wrap(owner, name, kind, nbytes, totals, saved, busy)
    try:
        yield totals
    finally:
        for (owner, name), fn in saved.items():
            setattr(owner, name, fn)
