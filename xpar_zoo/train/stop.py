"""Stopping a run cleanly on SIGINT (Ctrl-C) or SIGTERM (SLURM preemption, ``kill``, our launcher forwarding
either): the signal only sets a flag; after each step every rank learns whether any rank got one (one all-reduce of
an integer), so all ranks stop after the same step, save a checkpoint there and exit with 128 + the signal
(130, 143). A second signal stops at once (``KeyboardInterrupt``), saving nothing."""

from __future__ import annotations

import signal
import threading

import torch
import torch.distributed as dist

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Stopped(Exception):
    """The run stopped on a signal after saving; ``code`` is the exit status (128 + the signal number)."""

    def __init__(self, signum: int, message: str) -> None:
        super().__init__(message)
        self.signum = signum
        self.code = 128 + signum


class _SignalHandlers:
    """While active (a context manager), SIGINT and SIGTERM call the subclass's ``_handler``; the previous handlers
    come back on exit. Outside the main thread it does nothing (signals are delivered to the main thread only)."""

    _old: dict[int, object]

    def _handler(self, signum, frame) -> None:
        raise NotImplementedError

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for s in SIGNALS:
                self._old[s] = signal.signal(s, self._handler)
        return self

    def __exit__(self, *exc) -> None:
        for s, old in self._old.items():
            signal.signal(s, old)
        self._old.clear()


class StopOnSignal(_SignalHandlers):
    """While active (a context manager), SIGINT and SIGTERM set :attr:`signum` instead of stopping the process;
    :meth:`agreed` is the largest signal number any rank received (0: none). Outside the main thread it does
    nothing (signals are delivered to the main thread only)."""

    def __init__(self, announce=print) -> None:
        self.signum = 0
        self._announce = announce
        self._old: dict[int, object] = {}

    def _handler(self, signum, frame) -> None:
        if self.signum:  # the second one: stop now
            self.__exit__(None, None, None)
            raise KeyboardInterrupt
        self.signum = signum
        self._announce(f"{signal.Signals(signum).name}: finishing this step, then saving a checkpoint "
                       "(send it again to stop without saving)")

    def agreed(self, device: torch.device) -> int:
        """The largest signal number received on any rank since the start (0: none). A collective."""
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return self.signum
        flag = torch.tensor([self.signum], dtype=torch.int64, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())


class StopAtOnce(_SignalHandlers):
    """Outside the training loop (loading, exporting): SIGINT or SIGTERM stops the run at once with
    :class:`Stopped` (no step is in flight: nothing trained since the last checkpoint is lost), said on rank 0; the
    loop's :class:`StopOnSignal` takes over while it runs."""

    def __init__(self, rank: int = 0) -> None:
        self.rank = rank
        self._old: dict[int, object] = {}

    def _handler(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.rank == 0:
            print(f"{name}: stopped (nothing trained since the last checkpoint is lost)", flush=True)
        raise Stopped(signum, f"stopped by {name}")
