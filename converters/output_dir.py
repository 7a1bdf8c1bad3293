"""Atomic output directories for the converters: check the output before any work, write into a hidden staging
directory beside it, and move it into place only once complete (an existing output, with ``force``, is renamed aside
first and removed after). A process killed at any point leaves either the old output or none — never a half-written
one.

What a killed conversion leaves beside the output is dealt with by the next conversion to the same output:

- its staging directory ``.OUT.tmp-…`` is removed when it is provably abandoned: the writer holds an exclusive
  ``flock`` on a lock file inside it for as long as it writes, the kernel drops the lock when the process dies, and
  only a directory whose lock can be taken (on any host that shares the filesystem, in any PID namespace) is
  removed; one without a lock file, or on a filesystem without ``flock``, is only warned about;
- an old output renamed aside (``.OUT.deleting-…``) is never removed automatically: if the process died between
  the two renames it is the only copy of the previous output, and the warning says how to restore it.
"""

from __future__ import annotations

import fcntl
import glob
import os
import re
import shutil
import uuid
import warnings
from collections.abc import Iterable
from pathlib import Path

from xpar_zoo.errors import XparError

LOCK_FILE = ".xpar-writing.lock"


class OutputError(XparError, ValueError):
    """An output directory that exists (without ``force``) or cannot be written."""


class LeftoverWarning(UserWarning):
    """Staging directories of earlier, interrupted conversions sit beside the output."""


def _leftovers(out_dir: Path) -> list[Path]:
    """Staging (``tmp``) and renamed-aside (``deleting``) directories of conversions to ``out_dir``."""
    pattern = re.compile(re.escape(f".{out_dir.name}.") + r"(tmp|deleting)-[0-9a-f]{8}")
    return sorted(p for p in out_dir.parent.glob(f".{glob.escape(out_dir.name)}.*") if pattern.fullmatch(p.name))


def _remove_if_abandoned(staging: Path) -> bool:
    """Remove ``staging`` if the lock its writer held can be taken (the writer is gone); ``False`` otherwise."""
    lock = staging / LOCK_FILE
    try:
        fd = os.open(lock, os.O_RDWR)
    except OSError:  # no lock file (an older or foreign directory): not ours to judge
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if os.stat(lock).st_ino != os.fstat(fd).st_ino:  # the writer unlinked it on its way to commit
            return False
        shutil.rmtree(staging, ignore_errors=True)
        return True
    except OSError:  # held by a live writer, or no flock on this filesystem
        return False
    finally:
        os.close(fd)


def clear_leftovers(out_dir: Path) -> None:
    """Remove abandoned staging directories of conversions to ``out_dir``; warn (naming them) about the others."""
    if not out_dir.parent.is_dir():
        return
    removed, kept, aside = [], [], []
    for path in _leftovers(out_dir):
        if ".deleting-" in path.name:
            aside.append(path.name)
        elif _remove_if_abandoned(path):
            removed.append(path.name)
        else:
            kept.append(path.name)
    if removed:
        warnings.warn(f"removed {', '.join(removed)} from {out_dir.parent}: staging directories of interrupted "
                      "conversions whose process is gone", LeftoverWarning, stacklevel=4)
    if kept:
        warnings.warn(f"{', '.join(kept)} in {out_dir.parent}: staging directories of conversions still running "
                      "or interrupted before this version; remove them when no conversion is running",
                      LeftoverWarning, stacklevel=4)
    if aside:
        hint = (f"it holds the previous {out_dir.name} of an interrupted --force conversion: rename it back to "
                f"{out_dir.name} to keep it" if not out_dir.exists() else "the previous output, replaced: remove it")
        warnings.warn(f"{', '.join(aside)} in {out_dir.parent}: {hint}", LeftoverWarning, stacklevel=4)


def check_apart(out_dir: Path, inputs: Iterable[str | os.PathLike], error: type[Exception] = OutputError) -> None:
    """Raise ``error`` when ``out_dir`` is one of the ``inputs`` (paths that exist are compared; links resolved),
    contains one, or lies inside one: replacing it (``--force``) would delete the input, writing into it would
    change it."""
    out = Path(os.path.realpath(out_dir))
    for given in inputs:
        if not Path(given).exists():
            continue
        source = Path(os.path.realpath(given))
        if out == source:
            how = "is"
        elif out in source.parents:
            how = "contains"
        elif source in out.parents:
            how = "lies inside"
        else:
            continue
        raise error(f"the output {out_dir} {how} the input {given}: choose an output outside it (replacing it with "
                    "--force would delete the input)")


def check_output(out_dir: Path, force: bool, error: type[Exception] = OutputError,
                 inputs: Iterable[str | os.PathLike] = ()) -> None:
    """Raise ``error`` when ``out_dir`` is, contains or lies inside one of the ``inputs`` (:func:`check_apart`),
    exists without ``force``, is not a directory, or its parent is unwritable; then clear what interrupted
    conversions left beside it (:func:`clear_leftovers`)."""
    check_apart(out_dir, inputs, error)
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
    clear_leftovers(out_dir)


class StagingDir:
    """A new hidden directory beside ``out_dir`` to write into (``.path``), locked while this process writes:
    :meth:`commit` moves it into place, :meth:`discard` removes it. As a context manager (``with StagingDir(out)
    as tmp:``) it commits when the block completes and discards on any exception, the commit's own included; a
    full disk (or quota) becomes one ``error`` saying so."""

    def __init__(self, out_dir: Path, error: type[Exception] = OutputError) -> None:
        self.out_dir = out_dir
        self.error = error
        self.path = out_dir.parent / f".{out_dir.name}.tmp-{uuid.uuid4().hex[:8]}"
        self.path.mkdir()
        self._lock: int | None = os.open(self.path / LOCK_FILE, os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # no flock here: the directory stays, if abandoned, for the user to remove
            pass

    def __enter__(self) -> Path:
        return self.path

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            try:
                self.commit()
            except BaseException as e:
                self.discard()
                self._raise_if_disk_full(e)
                raise
        else:
            self.discard()
            self._raise_if_disk_full(exc)

    def _raise_if_disk_full(self, exc: BaseException) -> None:
        from xpar_zoo.integrity import disk_full

        if isinstance(exc, (KeyboardInterrupt, SystemExit, XparError)):
            return
        full = disk_full(exc, self.out_dir.parent)
        if full:
            raise self.error(f"writing {self.out_dir} failed: {full}; nothing was written") from None

    def _unlock(self) -> None:
        if self._lock is not None:
            (self.path / LOCK_FILE).unlink(missing_ok=True)  # before the lock drops: see _remove_if_abandoned
            os.close(self._lock)
            self._lock = None

    def commit(self) -> None:
        """Move the staged output into place (:func:`move_into_place`)."""
        self._unlock()
        move_into_place(self.path, self.out_dir)

    def discard(self) -> None:
        """Remove the staged output."""
        self._unlock()
        shutil.rmtree(self.path, ignore_errors=True)


def move_into_place(tmp: Path, out_dir: Path) -> None:
    """Rename ``tmp`` to ``out_dir``; an existing ``out_dir`` (``force``) is renamed aside first, then removed. If
    the second rename fails (or is interrupted), the old output is renamed back."""
    old = None
    if out_dir.exists():
        old = out_dir.parent / f".{out_dir.name}.deleting-{uuid.uuid4().hex[:8]}"
        out_dir.rename(old)
    try:
        tmp.rename(out_dir)
    except BaseException:
        if old is not None and not out_dir.exists():
            old.rename(out_dir)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
