"""Start N local processes with a gloo (CPU) process group — for the demo, the tests and the benchmarks.

``run(fn, world_size, *args)`` calls ``fn(*args)`` on every rank and returns rank 0's result. A failure on any rank
raises in the caller with that rank's traceback; collectives time out instead of hanging forever. Kept rather
than torch's ``elastic_launch`` (same start-up time, measured): every rank's traceback in the caller's exception and
tolerance of a teardown crash after the job finished (docs/design.md, "Where we keep our own code").
"""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port on localhost that is free right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, timeout_s: float, queue, fn: Callable, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    try:
        result = fn(*args)
        dist.barrier()  # no rank tears the group down while another still connects or communicates
        if rank == 0:
            # Plain pickle bytes: torch's queue reductions would share tensor memory with this process, which is
            # about to exit. (Our own child process: trusted data.)
            queue.put(("ok", pickle.dumps(result)))
    except BaseException:
        queue.put(("error", f"rank {rank}:\n{traceback.format_exc()}"))
        raise
    finally:
        dist.destroy_process_group()


def run(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 300.0) -> Any:
    """Run ``fn(*args)`` on ``world_size`` gloo ranks (spawned processes); return rank 0's result."""
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    messages: list = []
    procs = mp.start_processes(_worker, args=(world_size, port, timeout_s, queue, fn, args), nprocs=world_size,
                               join=False, start_method="spawn")
    try:
        # Drain the queue while waiting: a result larger than the pipe's buffer would otherwise block rank 0.
        while not procs.join(timeout=0.05):
            while not queue.empty():
                messages.append(queue.get())
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:  # a rank raised, or died
        while not queue.empty():
            messages.append(queue.get())
        errors = [payload for kind, payload in messages if kind == "error"]
        finished = any(kind == "ok" for kind, _ in messages)
        if not (isinstance(e, mp.ProcessExitedException) and finished and not errors):
            raise RuntimeError("distributed run failed:\n" + ("\n".join(errors) or str(e))) from None
        # Rank 0 reports only after a barrier that every rank reached with the job done: a process that died after
        # that (seen once: a C++ "terminate called" while the interpreter shut down) lost nothing.
        warnings.warn(f"a rank died after the job had finished on every rank ({e}); its result stands",
                      RuntimeWarning, stacklevel=2)
    while not queue.empty():
        messages.append(queue.get())
    for kind, payload in messages:
        if kind == "ok":
            return pickle.loads(payload)
    raise RuntimeError("distributed run finished without a result from rank 0")
