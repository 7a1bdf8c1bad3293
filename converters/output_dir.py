"""Atomic output directories for the converters: check the output before any work, write into a hidden staging
directory beside it, and move it into place only once complete (an existing output, with ``force``, is renamed aside
first and removed after). A process killed at any point leaves either the old output or none — never a half-written
one; its hidden ``.OUT.tmp-…`` staging directory stays behind for the user to remove."""

from __future__ import annotations

import os
import shutil
import uuid
import warnings
from pathlib import Path

from xpar_zoo.errors import XparError


class OutputError(XparError, ValueError):
    """An output directory that exists (without ``force``) or cannot be written."""


class LeftoverWarning(UserWarning):
    """Staging directories of earlier, interrupted conversions sit beside the output."""


def check_output(out_dir: Path, force: bool, error: type[Exception] = OutputError) -> None:
    """Raise ``error`` when ``out_dir`` exists without ``force``, is not a directory, or its parent is unwritable;
    warn (naming them) about staging directories that interrupted conversions left beside it."""
    if out_dir.parent.is_dir():
        leftovers = sorted(p.name for p in out_dir.parent.glob(f".{out_dir.name}.tmp-*"))
        if leftovers:
            warnings.warn(f"interrupted conversions left {', '.join(leftovers)} in {out_dir.parent}; remove them "
                          "when no conversion is running", LeftoverWarning, stacklevel=3)
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
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    return tmp


def move_into_place(tmp: Path, out_dir: Path) -> None:
    """Rename ``tmp`` to ``out_dir``; an existing ``out_dir`` (``force``) is renamed aside first, then removed."""
    old = None
    if out_dir.exists():
        old = out_dir.parent / f".{out_dir.name}.deleting-{uuid.uuid4().hex[:8]}"
        out_dir.rename(old)
    tmp.rename(out_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
