"""Start N local processes with a gloo (CPU) process group — for the demo, the tests and the benchmarks.

``run(fn, world_size, *args)`` calls ``fn(*args)`` on every rank and returns rank 0's result. A failure on any rank
raises in the caller with that rank's traceback; collectives time out instead of hanging forever. Kept rather
than torch's ``elastic_launch`` (same start-up time, measured): every rank's traceback in the caller's exception and
tolerance of a teardown crash after the job finished (docs/design.md, "Where we keep our own code").

Ranks are spawned (fresh interpreters) by default; ``XPAR_ZOO_START_METHOD=forkserver`` (the tests set it) forks
them from one server process that imported torch, transformers and xpar_zoo once (:data:`PRELOAD`), so that a run
does not import them again on every rank. A forked rank ends with ``os._exit`` (no atexit handlers, no interpreter
teardown); a run whose environment differs from the server's (modules read it on import) spawns.
"""

from __future__ import annotations

import datetime
import functools
import os
import pickle
import socket
import traceback
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch.multiprocessing as mp

from ..parallel.teardown import exit_rank

START_METHOD_ENV = "XPAR_ZOO_START_METHOD"
# What the fork server imports once for all the runs of a process (the import every rank would otherwise repeat).
PRELOAD = ("torch", "torch.distributed", "transformers", "transformers.modeling_utils", "xpar_zoo")
# Variables that may change between runs without making the server's imports stale; a forked rank gets the caller's.
VOLATILE_ENV = ("PYTEST_CURRENT_TEST",)


def free_port() -> int:
    """A TCP port on localhost that is free right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _CallerFd:
    """The caller's file descriptor ``fd``, handed to a rank forked from the server (whose own stdout and stderr are
    the caller's when the server started, e.g. another test's captured output)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self):
        from multiprocessing import reduction

        return _detach, (reduction.DupFd(self.fd),)


def _detach(dup) -> int:
    return dup.detach()


def _environment() -> tuple:
    return tuple(sorted((k, v) for k, v in os.environ.items() if k not in VOLATILE_ENV))


@functools.cache
def _forkserver_environment() -> tuple:
    """Start this process's fork server with :data:`PRELOAD` imported; the environment it started with."""
    from multiprocessing import forkserver

    forkserver.set_forkserver_preload(list(PRELOAD))
    forkserver.ensure_running()
    return _environment()


def _start_method(requested: str | None) -> str:
    """``requested``, else the environment's choice; a fork server whose environment is no longer the caller's
    (modules read it on import) gives way to spawn."""
    method = requested or os.environ.get(START_METHOD_ENV, "spawn")
    if method not in ("spawn", "forkserver"):
        raise ValueError(f"{START_METHOD_ENV}={method!r}: use 'spawn' or 'forkserver'")
    if method == "forkserver" and _forkserver_environment() != _environment():
        return "spawn"
    return method


def _from_caller(method: str) -> tuple | None:
    """What a process forked from the server takes from the caller (a spawned one has it already): the caller's
    stdout and stderr, and :data:`VOLATILE_ENV`."""
    if method != "forkserver":
        return None
    return (_CallerFd(1), _CallerFd(2)), {k: os.environ.get(k) for k in VOLATILE_ENV}


def _adopt(from_caller: tuple | None) -> None:
    if from_caller is None:
        return
    streams, volatile = from_caller
    for target, fd in zip((1, 2), streams):
        os.dup2(fd, target)
        os.close(fd)
    for key, value in volatile.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def _worker(rank: int, world_size: int, port: int, timeout_s: float, queue, fn: Callable, args: tuple,
            from_caller: tuple | None = None) -> None:
    _adopt(from_caller)
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
    if from_caller is None:  # spawned: end the process safely (a forked rank ends with os._exit already)
        exit_rank(0)


def run(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 300.0,
        start_method: str | None = None) -> Any:
    """Run ``fn(*args)`` on ``world_size`` gloo ranks (local processes); return rank 0's result. ``start_method``:
    ``"spawn"`` or ``"forkserver"`` (see the module docstring); default ``$XPAR_ZOO_START_METHOD``, else spawn."""
    method = _start_method(start_method)
    ctx = mp.get_context(method)
    queue = ctx.SimpleQueue()
    port = free_port()
    messages: list = []
    procs = mp.start_processes(_worker, args=(world_size, port, timeout_s, queue, fn, args, _from_caller(method)),
                               nprocs=world_size, join=False, start_method=method)
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


def _in_turn(jobs: dict) -> dict:
    return {name: fn(*args) for name, (fn, args) in jobs.items()}


def run_together(jobs: dict[str, tuple[Callable, tuple]], world_size: int, timeout_s: float = 300.0) -> dict:
    """Run the jobs ``{name: (fn, args)}`` one after another in one launched run (one start, one set of imports
    and one process group for all): ``{name: rank 0's result of fn(*args)}``. A failing job fails them all; see
    :func:`run_each` for one that fails only itself."""
    return run(_in_turn, world_size, jobs, timeout_s=timeout_s)


class JobFailed(RuntimeError):
    """A job of :func:`run_each` failed: its launched run's error, raised where the job's results are read."""


_STARTED = "started"


def _in_turn_recorded(jobs: list, progress: str) -> None:
    """Run ``[(index, fn, args)]`` in turn; rank 0 records the index it starts (``progress/started``) and each result
    (``progress/<index>.pkl``), before a barrier that keeps every rank in the same job."""
    import torch.distributed as dist

    rank = dist.get_rank()
    for index, fn, args in jobs:
        if rank == 0:
            with open(os.path.join(progress, _STARTED), "w") as f:
                f.write(str(index))
        result = fn(*args)
        if rank == 0:  # written before the barrier: a rank past it finds this job recorded
            with open(os.path.join(progress, f"{index}.pkl.tmp"), "wb") as f:
                pickle.dump(result, f)
            os.replace(os.path.join(progress, f"{index}.pkl.tmp"), os.path.join(progress, f"{index}.pkl"))
        dist.barrier()


def _recorded(progress: str, indices) -> dict:
    out = {}
    for index in indices:
        path = os.path.join(progress, f"{index}.pkl")
        if os.path.exists(path):
            with open(path, "rb") as f:
                payload = f.read()
            out[index] = pickle.loads(payload)  # written by our own child process (rank 0): trusted data
    return out


def _started(progress: str) -> int | None:
    path = os.path.join(progress, _STARTED)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return int(f.read())


def run_each(jobs: dict[Any, tuple[Callable, tuple]], world_size: int, timeout_s: float = 300.0) -> dict:
    """Run the jobs ``{name: (fn, args)}`` one after another in one launched run, as :func:`run_together`, but a
    failing job fails only itself: ``{name: rank 0's result of fn(*args), or a JobFailed with the run's error}``.
    The job a failed run was in is the one rank 0 had started and not finished; a new run takes the jobs after it.
    A run that fails before any job started fails every job it had."""
    import tempfile

    names = list(jobs)
    outcomes: dict[int, Any] = {}
    while len(outcomes) < len(names):
        pending = [i for i in range(len(names)) if i not in outcomes]
        with tempfile.TemporaryDirectory(prefix="xpar-zoo-jobs-") as progress:
            try:
                run(_in_turn_recorded, world_size, [(i, *jobs[names[i]]) for i in pending], progress,
                    timeout_s=timeout_s)
                error = None
            except RuntimeError as e:
                error = e
            outcomes.update(_recorded(progress, pending))
            started = _started(progress)
        if error is None:
            continue  # every pending job recorded (the loop ends), else another run takes the rest
        if started is None:  # the run failed before its first job: nothing to tell the jobs apart by
            failed = [i for i in pending if i not in outcomes]
        else:
            failed = [started] if started not in outcomes else []
        for i in failed:
            outcomes[i] = JobFailed(f"job {names[i]!r} failed in its launched run: {error}")
    return {names[i]: outcomes[i] for i in range(len(names))}


class JobResults(Mapping):
    """The results of several :func:`run_each` jobs as one mapping: ``results[key]`` is found in the result (a dict)
    of the job ``job_of(key)``, and raises that job's :class:`JobFailed` when it failed. By default a key's job is
    its first element (``results[arch, mesh]`` in the job ``arch``), or the key itself."""

    def __init__(self, outcomes: dict, job_of: Callable[[Any], Any] | None = None) -> None:
        self.outcomes = outcomes
        self.job_of = job_of or (lambda key: key[0] if isinstance(key, tuple) else key)

    def __getitem__(self, key):
        outcome = self.outcomes[self.job_of(key)]
        if isinstance(outcome, JobFailed):
            raise outcome
        return outcome[key]

    def __iter__(self):
        for outcome in self.outcomes.values():
            if not isinstance(outcome, JobFailed):
                yield from outcome

    def __len__(self) -> int:
        return sum(1 for _ in self)


def _alone(fn: Callable, args: tuple, from_caller: tuple | None) -> None:
    _adopt(from_caller)
    fn(*args)


def start(fn: Callable[..., Any], *args: Any, start_method: str | None = None):
    """Start ``fn(*args)`` in one local process without a process group, as :func:`run` starts a rank; return the
    started ``multiprocessing.Process`` (``join()`` it; its ``exitcode`` is 1 when ``fn`` raised, ``-signal`` when a
    signal ended it)."""
    method = _start_method(start_method)
    proc = mp.get_context(method).Process(target=_alone, args=(fn, args, _from_caller(method)))
    proc.start()
    return proc
