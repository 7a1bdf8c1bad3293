"""Ending a rank: its process group, then its process, in an order that cannot abort after the work is done.

A process group's C++ threads outlive ``destroy_process_group``: torch's own DeviceMesh and FSDP objects (and any
model still referenced) keep the groups, and so gloo's worker threads, alive until the interpreter shuts down, and a
gloo worker drops the tensors of the collective it ran only after the caller's ``wait`` has returned. A worker that
lags (a loaded machine) and drops a tensor Python created needs the GIL; asked for while the interpreter finalizes,
the thread is ended inside C++ and the process can abort ("terminate called without an active exception", SIGABRT)
after its work was done. The safe order, for a process that is a rank and nothing else:

1. :func:`end_process_group`: a barrier (no rank tears its connections down while another still communicates),
   then ``destroy_process_group``;
2. :func:`exit_rank`: the Python threads joined and the exit handlers run while the interpreter is whole (nothing
   is lost: files closed, logs flushed), then the process ends without the interpreter's teardown, which is where
   the process group's threads could still touch it.

Measured (bench/clean_exits.py): ``bench/RESULTS.md``, "Clean exits".
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from typing import NoReturn

import torch.distributed as dist

from ..compat import run_exit_handlers


def end_process_group() -> None:
    """Every rank: a barrier, then ``destroy_process_group`` (nothing when no process group is initialised)."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    try:
        dist.barrier()
    finally:
        dist.destroy_process_group()


def exit_rank(code: int = 0) -> NoReturn:
    """End this rank's process with ``code`` after :func:`end_process_group`: every other non-daemon Python thread
    joined, the exit handlers run (logging's flush among them), stdout and stderr flushed, then ``os._exit``."""
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    run_exit_handlers()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed, or the reader went away
            pass
    os._exit(code)
