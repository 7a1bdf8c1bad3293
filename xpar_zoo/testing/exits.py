"""Repeated short runs of local gloo ranks beside CPU-burning processes, each rank ending as a real rank process ends,
and every rank's exit status: does a run that did its work end with status 0 everywhere? For the test suite and
``bench/clean_exits.py``.

The ranks are forked from the calling process (which imported what the job needs once, and must not run threads of
its own: call it from a fresh process, e.g. one :func:`xpar_zoo.testing.launch.start` started, or a script's main).
Each rank initialises a gloo process group, runs the job, ends the group in the safe order
(:func:`xpar_zoo.parallel.teardown.end_process_group`) and exits: ``ending="rank"`` through
:func:`~xpar_zoo.parallel.teardown.exit_rank`, as ``xpar-zoo train`` and the launched helpers' ranks do;
``ending="interpreter"`` by raising ``SystemExit`` up the caller's stack, as a plain script under torchrun does (a real
interpreter exit only where nothing above catches it: a script's main).
"""

from __future__ import annotations

import datetime
import os
import signal
import socket
import sys
import traceback
from collections.abc import Callable
from typing import Any

ENDINGS = ("rank", "interpreter")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _burn(seconds: float) -> None:
    """A child that keeps one CPU busy for at most ``seconds`` (killed sooner by its parent)."""
    signal.alarm(max(1, int(seconds)))
    while True:
        pass


def _rank(rank: int, world: int, port: int, job: Callable[..., Any], args: tuple, ending: str,
          timeout_s: float) -> None:
    import torch
    import torch.distributed as dist

    from ..parallel.teardown import end_process_group, exit_rank

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    code = 1
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))
        job(*args)
        end_process_group()
        code = 0
    except BaseException:
        traceback.print_exc()
    if ending == "rank":
        exit_rank(code)
    sys.exit(code)


def _fork(target: Callable[..., Any], *args: Any) -> int:
    pid = os.fork()
    if pid == 0:
        target(*args)  # never returns: exits, or raises SystemExit up the stack (ending="interpreter")
    return pid


def _status(pid: int) -> int:
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def repeat_runs(job: Callable[..., Any], world: int, runs: int, *args: Any, ending: str = "rank", burners: int = 2,
                timeout_s: float = 120.0) -> list[list[int]]:
    """Run ``job(*args)`` on ``world`` forked gloo ranks ``runs`` times, one run after another, beside ``burners``
    processes spinning on the CPU for the whole time; each run's exit statuses by rank (0: clean, ``-6``: aborted
    by SIGABRT, 1: the job raised, printed)."""
    if ending not in ENDINGS:
        raise ValueError(f"ending={ending!r}: use one of {', '.join(ENDINGS)}")
    parent = os.getpid()
    burning = [_fork(_burn, timeout_s * runs) for _ in range(burners)]
    statuses = []
    try:
        for _ in range(runs):
            port = _free_port()
            pids = [_fork(_rank, rank, world, port, job, args, ending, timeout_s) for rank in range(world)]
            statuses.append([_status(pid) for pid in pids])
    finally:
        if os.getpid() == parent:  # not in a rank leaving by SystemExit
            for pid in burning:
                os.kill(pid, signal.SIGKILL)
                _status(pid)
    return statuses


def summary(statuses: list[list[int]]) -> dict[str, Any]:
    """``{"runs", "unclean" (runs with a nonzero status on some rank), "statuses" (how often each nonzero status
    was seen)}``."""
    bad = [s for run in statuses for s in run if s != 0]
    return {"runs": len(statuses), "unclean": sum(any(run) for run in statuses),
            "statuses": {str(s): bad.count(s) for s in sorted(set(bad))}}


def tiny_training(mesh: dict[str, int], steps: int = 2) -> None:
    """On every rank: the tiny qwen3_moe parallelized on ``Mesh(**mesh)``, ``steps`` AdamW steps on a fixed batch
    (the short parity-script shape of run the statuses are about)."""
    import torch

    from ..parallel.mesh import Mesh
    from ..parallelize import parallelize
    from . import parity

    torch.manual_seed(0)
    model = parallelize(parity.build_model(parity.tiny_config("qwen3_moe")), Mesh(**mesh))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 100, (1, 32), generator=torch.Generator().manual_seed(1))
    for _ in range(steps):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
