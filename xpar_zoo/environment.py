"""The environment variables the library reads below its entry points: facts about the process that others set,
never a setting of xpar_zoo's (those are :class:`~xpar_zoo.parallel.options.ParallelOptions`, whose environment
defaults only :meth:`~xpar_zoo.parallel.options.ParallelOptions.from_env` reads, at the entry points). A launcher's
identity of this process (torchrun's ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``), Triton's interpreter switch, and
whether a network proxy is configured."""

from __future__ import annotations

import os

from .errors import MeshError

PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")


def _whole(name: str, default: int) -> int:
    """The whole number in variable ``name``, ``default`` where it is unset or empty; :class:`MeshError` (one line)
    for anything else."""
    raw = (os.environ.get(name) or "").strip()
    if not raw:
        return default
    if not raw.isdigit():
        raise MeshError(f"{name}={raw[:40]!r}: expected a whole number (the launcher sets it for each process)")
    return int(raw)


def launcher_rank() -> int:
    """The global rank a launcher gave this process (``RANK``; 0 when none did)."""
    return _whole("RANK", 0)


def says_for_every_rank() -> bool:
    """Whether this process prints what every rank of a launch would print: rank 0, or a process whose ``RANK`` is
    not a number (its one line is then never lost)."""
    try:
        return launcher_rank() == 0
    except MeshError:
        return True


def launcher_local_rank(default: int) -> int:
    """This process's rank on its node as the launcher gave it (``LOCAL_RANK``), else ``default``."""
    return _whole("LOCAL_RANK", default)


def launcher_world_size() -> int:
    """The number of processes a launcher started (``WORLD_SIZE``; 1 when none did)."""
    return _whole("WORLD_SIZE", 1)


def launched_world() -> int | None:
    """The world size when a launcher (torchrun) started this process (``RANK`` and ``WORLD_SIZE`` set), else
    ``None``."""
    if "RANK" not in os.environ or not (os.environ.get("WORLD_SIZE") or "").strip():
        return None
    return launcher_world_size()


def triton_interpreter() -> bool:
    """Whether Triton's interpreter is switched on (``TRITON_INTERPRET=1``: Triton kernels run on the CPU)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def proxy_configured() -> bool:
    """Whether an HTTP(S) proxy is configured for this process (the proxy then decides what is reachable)."""
    return any(os.environ.get(k) for k in PROXY_VARIABLES)
