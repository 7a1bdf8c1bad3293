"""Stopping a run cleanly on SIGINT (Ctrl-C) or SIGTERM (SLURM preemption, ``kill``, our launcher forwarding
either): the signal only sets a flag; after each step every rank learns whether any rank got one (one all-reduce of
an integer), so all ranks stop after the same step, save a checkpoint there and exit with 128 + the signal
(130, 143). A second signal (more than :data:`REPEAT_WINDOW_S` after the first) stops at once, saving nothing. Outside the loop (starting, loading, exporting) a signal
stops at once. Every way ends with one line on rank 0 saying what is saved and what to type next
(:func:`saved_hint`)."""

from __future__ import annotations

import signal
import threading
import time

import torch
import torch.distributed as dist

SIGNALS = (signal.SIGINT, signal.SIGTERM)
# A signal this soon after the first is the same request passed on (torchrun forwards the terminal's Ctrl-C to ranks
# that got it already), not a second one.
REPEAT_WINDOW_S = 2.0


def saved_hint(output) -> str:
    """What a stopped run leaves and how to go on: the newest complete checkpoint in ``OUTPUT/checkpoints`` and
    ``--resume``, or that nothing is saved and the same command starts again."""
    from pathlib import Path

    from ..checkpoint.layout import scan_root

    if output is None:
        return "rerun the command to start again"
    from .outputs import CHECKPOINTS, blocks_a_new_run

    complete, _ = scan_root(Path(output) / CHECKPOINTS)
    if complete:
        return f"the run is saved at {complete[-1][1].name}: rerun with --resume to continue"
    if blocks_a_new_run(Path(output)):  # steps trained, none saved
        return "no checkpoint was saved: rerun with --force to start again"
    return "no checkpoint was saved yet: rerun the same command to start again"


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

    def __init__(self, announce=print, output=None, repeat_window_s: float = REPEAT_WINDOW_S) -> None:
        self.signum = 0
        self._announce = announce
        self._output = output
        self._window = repeat_window_s
        self._first_at = 0.0
        self._old: dict[int, object] = {}

    def _handler(self, signum, frame) -> None:
        if self.signum and time.monotonic() - self._first_at < self._window:
            return  # the same request passed on again (torchrun sends each rank the Ctrl-C they already got)
        if self.signum:  # the second one: stop now
            self.__exit__(None, None, None)
            name = signal.Signals(signum).name
            self._announce(f"{name} again: stopped at once without saving this step; {saved_hint(self._output)}")
            raise Stopped(signum, f"stopped by a second {name}")
        self.signum = signum
        self._first_at = time.monotonic()
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
    """Outside the training loop (starting, loading, exporting: ``phase``): SIGINT or SIGTERM stops the run at once
    with :class:`Stopped` (no step is in flight: nothing trained since the last checkpoint is lost; a half-written
    export or checkpoint is a staging directory, removed), said on rank 0 in one line with :func:`saved_hint` for
    ``output``; the loop's :class:`StopOnSignal` takes over while it runs. A second signal while the first is
    being handled is ignored (the first already stops the run)."""

    def __init__(self, rank: int = 0, phase: str = "", output=None) -> None:
        self.rank = rank
        self.phase = phase
        self.output = output
        self._stopping = False
        self._old: dict[int, object] = {}

    def _handler(self, signum, frame) -> None:
        if self._stopping:
            return
        self._stopping = True
        name = signal.Signals(signum).name
        if self.rank == 0:
            where = f" {self.phase}" if self.phase else ""
            print(f"{name}: stopped{where}; {saved_hint(self.output)}", flush=True)
        raise Stopped(signum, f"stopped by {name}")
