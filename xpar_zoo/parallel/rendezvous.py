"""A bounded wait for every rank before a collective call: a rank that calls ``save_checkpoint`` alone (the DDP
habit ``if rank == 0: save(...)``) gets a clear error within a timeout instead of hanging in the first collective,
and ranks that call with different arguments all get the same error.

It runs through the default process group's c10d store (no collective runs until every rank is known to be there):
each rank numbers its calls, the k-th calls of all ranks meet, open or close atomically (``compare_set``) so every
rank sees the same outcome, then compare their arguments. The protocol step by step: ``docs/design.md``,
"Checkpoints".
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Mapping
from typing import Any

import torch.distributed as dist

from ..compat import default_store
from .mesh import check_same_on_all_ranks

_NS = "xpar_zoo/rendezvous"
_OPEN, _CLOSED = b"open", b"closed"
_ABSENT = b"\x00absent"  # compare_set with a non-empty expected value never creates the key: a non-blocking read


def _peek(store, key: str) -> bytes | None:
    value = store.compare_set(key, _ABSENT, _ABSENT)
    return None if value == _ABSENT else value


def meet(call: str, arguments: Mapping[str, Any], error: type[Exception], timeout: float) -> None:
    """Wait until every rank of the default process group has made a guarded call too (at most ``timeout``
    seconds), then check that all made the same ``call`` with the same ``arguments`` (``{name: value}``, values
    comparable and printable). Raises ``error`` on every rank that came, with the same message, when some rank did
    not come in time or the calls differ. Returns at once without a process group or with one rank."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    if not (isinstance(timeout, (int, float)) and timeout > 0):
        raise error(f"{call}: the rendezvous timeout must be a positive number of seconds, got {timeout!r}")
    store = default_store()
    rank, world = dist.get_rank(), dist.get_world_size()
    while True:  # skip calls closed before this rank came: the others gave up on them and moved on
        base = f"{_NS}/{store.add(f'{_NS}/seq/{rank}', 1)}"
        if _peek(store, f"{base}/state") != _CLOSED:
            break
    state_key = f"{base}/state"
    if store.add(f"{base}/arrived", 1) == world:
        state = store.compare_set(state_key, "", _OPEN)
    else:
        deadline = time.monotonic() + timeout
        state = None
        while state is None:  # the store may wake a waiter without the key set (libuv's compare_set miss does)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                state = store.compare_set(state_key, "", _CLOSED)
                break
            try:
                store.wait([state_key], datetime.timedelta(seconds=remaining))
            except dist.DistStoreError:  # timed out: closed on the next turn, unless opened meanwhile
                pass
            state = _peek(store, state_key)
    if state != _OPEN:
        count = store.add(f"{base}/arrived", 0)
        raise error(f"every rank must call {call} ({count} of {world} arrived within {timeout:g} s): call it on "
                    "all ranks, not only on some")
    if store.add(f"{base}/left", 1) == world:
        for key in ("state", "arrived", "left"):
            store.delete_key(f"{base}/{key}")
    check_same_on_all_ranks(call, "calls (every rank must make the same call)", error)
    check_same_on_all_ranks(dict(arguments), f"{call} arguments (every rank must pass the same)", error)
