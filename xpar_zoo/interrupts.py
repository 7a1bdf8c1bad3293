"""The command line's first seconds: a Ctrl-C (SIGINT) or SIGTERM that arrives while the ``xpar_zoo`` package is
still importing (torch and transformers take seconds) ends the process with one line and status 130 / 143 instead
of an interpreter traceback. Only when this process is the command (``xpar-zoo …``, ``python -m xpar_zoo…``, as
torchrun and ``xpar-zoo train --nproc-per-node`` start the ranks): importing xpar_zoo as a library changes no signal
handler. Nothing is open yet, so the process ends at once (``os._exit``). Standard library only."""

from __future__ import annotations

import os
import signal
import sys
import threading

from .environment import says_for_every_rank

SIGNALS = (signal.SIGINT, signal.SIGTERM)
_DEFAULTS = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL}


def is_command(orig_argv: list[str] | None = None, argv0: str | None = None) -> bool:
    """Whether this interpreter runs the xpar-zoo command (the console script, or ``-m xpar_zoo…``)."""
    orig = list(getattr(sys, "orig_argv", []) if orig_argv is None else orig_argv)
    if "-m" in orig:
        i = orig.index("-m")
        return i + 1 < len(orig) and orig[i + 1].split(".")[0] == "xpar_zoo"
    argv0 = (getattr(sys, "argv", None) or [""])[0] if argv0 is None else argv0
    return os.path.basename(argv0) == "xpar-zoo"


def _stop_while_importing(signum, frame) -> None:
    if says_for_every_rank():  # every rank of a launch gets the signal: rank 0 says it once
        sys.stderr.write(f"xpar-zoo: {signal.Signals(signum).name} while starting: stopped before anything was "
                         "loaded or written (rerun the command to start again)\n")
        sys.stderr.flush()
    os._exit(128 + signum)


def quiet_while_importing() -> None:
    """Top of the package's ``__init__``, in the command's process: SIGINT / SIGTERM end it quietly (see the module
    docstring) until :func:`end_quiet_import`. A handler someone else installed is left alone."""
    if not is_command() or threading.current_thread() is not threading.main_thread():
        return
    for s in SIGNALS:
        if signal.getsignal(s) is _DEFAULTS[s]:
            signal.signal(s, _stop_while_importing)


def end_quiet_import() -> None:
    """End of the package's ``__init__``: Python's own handlers again (the command installs its own)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for s in SIGNALS:
        if signal.getsignal(s) is _stop_while_importing:
            signal.signal(s, _DEFAULTS[s])
