"""Atomic output directories for the converters: check the output before any work, write into a hidden staging
directory beside it, and move it into place only once complete (an existing output, with ``force``, is renamed aside
first and removed after). A process killed at any point leaves either the old output or none — never a half-written
one. Its hidden ``.OUT.tmp-<host>-<pid>-…`` staging directory (or ``.OUT.deleting-…``, an old output renamed aside)
stays behind until the next conversion to the same output: that one removes those whose process is provably gone
(same host, pid no longer running) and only warns about the others (another host, or a process still running)."""

from __future__ import annotations

import os
import re
import shutil
import socket
import uuid
import warnings
from pathlib import Path

from xpar_zoo.errors import XparError


class OutputError(XparError, ValueError):
    """An output directory that exists (without ``force``) or cannot be written."""


class LeftoverWarning(UserWarning):
    """Staging directories of earlier, interrupted conversions sit beside the output."""


def _owner_tag() -> str:
    """``<host>-<pid>`` of this process, as staging names carry it."""
    return f"{re.sub(r'[^A-Za-z0-9.]', '_', socket.gethostname())}-{os.getpid()}"


def _abandoned(name: str) -> bool:
    """Whether the staging directory ``name`` belongs to a process of this host that is no longer running."""
    m = re.search(r"\.(?:tmp|deleting)-(.+)-(\d+)-[0-9a-f]{8}$", name)
    if not m or m[1] != _owner_tag().rsplit("-", 1)[0]:
        return False
    try:
        os.kill(int(m[2]), 0)
    except ProcessLookupError:
        return True
    except OSError:  # e.g. another user's process: it exists
        return False
    return False


def clear_leftovers(out_dir: Path) -> None:
    """Remove what interrupted conversions to ``out_dir`` left beside it when their process is provably gone;
    warn (naming them) about the others."""
    if not out_dir.parent.is_dir():
        return
    names = sorted({p.name for pattern in (".tmp-*", ".deleting-*")
                    for p in out_dir.parent.glob(f".{out_dir.name}{pattern}")})
    removed = [n for n in names if _abandoned(n)]
    for name in removed:
        shutil.rmtree(out_dir.parent / name, ignore_errors=True)
    kept = [n for n in names if n not in removed]
    if removed:
        warnings.warn(f"removed {', '.join(removed)} from {out_dir.parent}: left by interrupted conversions whose "
                      "process is gone", LeftoverWarning, stacklevel=4)
    if kept:
        warnings.warn(f"interrupted or running conversions left {', '.join(kept)} in {out_dir.parent}; remove them "
                      "when no conversion is running", LeftoverWarning, stacklevel=4)


def check_output(out_dir: Path, force: bool, error: type[Exception] = OutputError) -> None:
    """Raise ``error`` when ``out_dir`` exists without ``force``, is not a directory, or its parent is unwritable;
    clear what interrupted conversions left beside it (:func:`clear_leftovers`)."""
    clear_leftovers(out_dir)
    if out_dir.exists() and not force:
        raise error(f"{out_dir} already exists; pass --force (force=True) to replace it")
    if out_dir.exists() and not out_dir.is_dir():
        raise error(f"{out_dir} exists and is not a directory")
    parent = out_dir.parent
    if not parent.is_dir():
        why = "is not a directory" if parent.exists() else "does not exist"
        raise error(f"cannot write {out_dir}: {parent} {why}")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise error(f"cannot write {out_dir}: {parent} is not writable")


def staging_dir(out_dir: Path) -> Path:
    """A new hidden directory beside ``out_dir`` to write into."""
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{_owner_tag()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    return tmp


def move_into_place(tmp: Path, out_dir: Path) -> None:
    """Rename ``tmp`` to ``out_dir``; an existing ``out_dir`` (``force``) is renamed aside first, then removed."""
    old = None
    if out_dir.exists():
        old = out_dir.parent / f".{out_dir.name}.deleting-{_owner_tag()}-{uuid.uuid4().hex[:8]}"
        out_dir.rename(old)
    tmp.rename(out_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
