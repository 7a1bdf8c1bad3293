"""Small collectives over Python values between our own ranks, shared by the checkpoint, the loader and the savers:
who this rank is, "rank 0 decides, every rank follows", and errors gathered so that every rank raises the same one
instead of some ranks waiting forever in the next collective. Each works in a plain single process too."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any, Literal, TypeVar, overload

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from ..compat import redistribute_logger
from ..errors import XparError

T = TypeVar("T")


def is_distributed() -> bool:
    """Whether a process group is initialised."""
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """This process's global rank (0 without a process group)."""
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    """The number of ranks (1 without a process group)."""
    return dist.get_world_size() if is_distributed() else 1


def broadcast(obj: Any, group: dist.ProcessGroup | None = None) -> Any:
    """Rank 0's ``obj`` on every rank (our own small Python values between our own processes)."""
    if not is_distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def all_gather(obj: Any, group: dist.ProcessGroup | None = None) -> list:
    """Every rank's ``obj``, by rank."""
    if not is_distributed():
        return [obj]
    values: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(values, obj, group=group)
    return values


def describe_error(e: BaseException) -> str:
    """One line for an error: our own message, each rank's failure of a DCP ``CheckpointException``, or the type
    and text of anything else."""
    if isinstance(e, XparError):
        return str(e)
    failures = getattr(e, "failures", None)
    if isinstance(e, CheckpointException) and isinstance(failures, dict) and failures:
        causes = {r: f[0] if isinstance(f, tuple) else f for r, f in failures.items()}  # {rank: (exception, tb)}
        return join_errors([describe_error(causes[r]) if r in causes else None for r in range(max(causes) + 1)])
    return f"{type(e).__name__}: {e}"


def join_errors(messages: list[str | None]) -> str | None:
    """Per-rank messages (None: no error) as lines, ranks with the same message on one line; None when none."""
    by_text: dict[str, list[int]] = {}
    for r, m in enumerate(messages):
        if m:
            by_text.setdefault(m, []).append(r)
    if len(messages) == 1:
        return messages[0]
    return "\n".join(f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {m}"
                     for m, rs in by_text.items()) or None


def every_error(message: str | None, group: dist.ProcessGroup | None = None) -> str | None:
    """Every rank's error message (or None) gathered: one line per distinct message, naming its ranks (a single
    process: its own message), or None when all ranks succeeded. The same text on every rank. A collective."""
    if not is_distributed():
        return message
    return join_errors(all_gather(message, group))


@overload
def run_everywhere(fn: Callable[[], T], *, rank0_only: bool = ..., active: Literal[True] = ...) -> T: ...
@overload
def run_everywhere(fn: Callable[[], T], *, rank0_only: bool = ..., active: bool) -> T | None: ...
def run_everywhere(fn: Callable[[], T], *, rank0_only: bool = False, active: bool = True) -> T | None:
    """``fn()`` on every rank (``rank0_only``: on rank 0, its result broadcast to all; ``active=False``: not on this
    rank, which still takes part): an :class:`~xpar_zoo.errors.XparError` raised on any rank is raised on every
    rank, with the same type and message, so that no rank is left waiting in the next collective. A collective."""
    result, error = None, None
    if active and (not rank0_only or rank() == 0):
        try:
            result = fn()
        except XparError as e:
            error = (type(e), str(e))
    if rank0_only:
        result, error = broadcast((result, error))
        failed = [error] if error else []
    else:
        failed = [e for e in all_gather(error) if e]
    if failed:
        kind, message = failed[0]
        raise kind(message)
    return result


class _ExactGatherFilter(logging.Filter):
    """Drops DTensor's warning that a redistribution takes several sequential collectives "and may give inconsistent
    results between ranks due to different reduction orders" when those collectives are all-gathers: they reduce
    nothing, so the result is exact. (FSDP2's dim-0 shard of a planned slice is a ``_StridedShard``; gathering it
    in full takes one all-gather per mesh dimension.)"""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        return not (str(record.msg).startswith("While redistributing") and len(args) > 3 and args[3] == "all_gather")


@contextlib.contextmanager
def exact_gathers() -> Iterator[None]:
    """Full tensors gathered inside this block do not log DTensor's "inconsistent results" warning for all-gathers
    (see :class:`_ExactGatherFilter`); every other warning stands."""
    logger = redistribute_logger()
    quiet = _ExactGatherFilter()
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)
