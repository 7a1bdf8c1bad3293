"""``xpar-zoo train --nproc-per-node N``: the command starts its ranks itself (as ``xpar-zoo demo`` does), without
torchrun. Each rank is ``python -m xpar_zoo train`` with the same arguments and torchrun's environment (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``…); with ``--nnodes`` the same line runs on every
node with its ``--node-rank`` and node 0's ``--master-addr``/``--master-port``.

The ranks run in a process group of their own: a Ctrl-C (or SIGTERM, e.g. SLURM's preemption) reaches this process
once and is forwarded once to every rank, which finish their step, save and exit 130/143
(:mod:`xpar_zoo.train.stop`). A rank's own errors are its one line (rank 0 prints them); when a rank dies otherwise,
this process says so in one line and stops the others. Exit status: the ranks' (0, 2 on bad input, 130/143 when
stopped by a signal), 1 when a rank failed.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

from ..environment import launcher_world_size
from ..errors import TrainConfigError

LAUNCHED = "XPAR_ZOO_TRAIN_LAUNCHED"  # set in the ranks this launcher starts
GRACE_S = 30.0  # how long the other ranks may take to exit after one failed before they are killed
AGAIN_GRACE_S = 3.0  # the same after a second signal: the user asked to stop at once


def launched_by_us() -> bool:
    return os.environ.get(LAUNCHED) == "1"


def under_torchrun() -> bool:
    """Whether torchrun (torch.distributed.elastic) started this process."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def under_other_launcher() -> bool:
    """Whether a launcher other than ``xpar-zoo train --nproc-per-node`` started this process as one rank."""
    return not launched_by_us() and (under_torchrun() or launcher_world_size() > 1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_launch(nproc: int, nnodes: int, node_rank: int, master_port: int | None) -> None:
    if under_other_launcher():
        raise TrainConfigError("--nproc-per-node starts the ranks itself: leave it out under torchrun (or another "
                               "launcher), which started this process as one rank")
    if nproc < 1 or nproc > 4096:
        raise TrainConfigError(f"--nproc-per-node must be in 1 … 4096, got {nproc}")
    if nnodes < 1:
        raise TrainConfigError(f"--nnodes must be at least 1, got {nnodes}")
    if not 0 <= node_rank < nnodes:
        raise TrainConfigError(f"--node-rank must be in 0 … {nnodes - 1} (--nnodes {nnodes}), got {node_rank}")
    if master_port is not None and not 1 <= master_port <= 65535:
        raise TrainConfigError(f"--master-port must be a port number (1 … 65535), got {master_port}")


def _die_with_parent() -> None:  # runs in the child before exec: Linux kills it if the launcher dies
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def launch(argv: list[str], nproc: int, nnodes: int = 1, node_rank: int = 0, master_addr: str | None = None,
           master_port: int | None = None) -> int:
    """Start ``nproc`` ranks of ``xpar-zoo ARGV`` (ARGV: the command line, ``train`` first) on this node and wait
    for them; forward SIGINT/SIGTERM; return the exit status (see the module docstring)."""
    check_launch(nproc, nnodes, node_rank, master_port)
    world = nproc * nnodes
    addr = master_addr or "127.0.0.1"
    port = master_port or (_free_port() if nnodes == 1 else 29500)
    procs: list[subprocess.Popen] = []
    for local in range(nproc):
        env = {**os.environ, LAUNCHED: "1", "RANK": str(node_rank * nproc + local), "LOCAL_RANK": str(local),
               "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": str(node_rank),
               "MASTER_ADDR": addr, "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen([sys.executable, "-m", "xpar_zoo", *argv], env=env, start_new_session=True,
                                      preexec_fn=_die_with_parent))
    received: list[int] = []

    def forward(signum, frame):
        received.append(signum)
        for p in procs:
            if p.poll() is None:
                try:
                    os.kill(p.pid, signum)
                except ProcessLookupError:
                    pass

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = _wait(procs, node_rank * nproc, received)
        return 128 + received[0] if received and code == 1 else code
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def _wait(procs: list[subprocess.Popen], first_rank: int, signals: list[int] | None = None) -> int:
    """Wait for the ranks; their exit status (see the module docstring). ``signals``: those this process forwarded
    (filled while it waits): a rank they ended is no failure to report."""
    failed_at = None
    first = None  # the first rank seen to fail: (index, status); ranks killed after it are not the news
    while True:
        codes = [p.poll() for p in procs]
        bad = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
        if bad and failed_at is None:
            failed_at = time.monotonic()
            first = next(((i, c) for i, c in bad if c not in (2, 130, 143)), None)
        if all(c is not None for c in codes):
            break
        grace = GRACE_S if not signals or len(signals) < 2 else AGAIN_GRACE_S  # asked twice: no long wait
        if failed_at is not None and time.monotonic() - failed_at > grace:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        time.sleep(0.1)
    codes = [p.returncode for p in procs]
    if all(c == 0 for c in codes):
        return 0
    for c in (2, 130, 143):  # bad input (said by the ranks), or stopped by a signal after saving (said, too)
        if all(code in (0, c) for code in codes):
            return c
    first = first or next((i, c) for i, c in enumerate(codes) if c not in (0, 2, 130, 143))
    how = (f"was killed by {signal.Signals(-first[1]).name}" if first[1] < 0
           else f"exited with status {first[1]}")
    if not signals:  # (a signal we forwarded explains it)
        print(f"xpar-zoo: error: rank {first_rank + first[0]} {how} (its output is above); the other ranks were "
              "stopped", file=sys.stderr, flush=True)
    return 1
