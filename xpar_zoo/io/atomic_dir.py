"""Writing directories atomically: a reader sees the old output or the complete new one, never a half-written one.

- :class:`StagingDir` (the converters, ``save_pretrained``): write into a hidden staging directory beside the
  output, move it into place once complete (an existing output, with ``force``, is renamed aside first and removed
  after). A killed writer's staging directory ``.OUT.tmp-…`` is removed by the next writer to the same output when
  it is provably abandoned: the writer holds an exclusive ``flock`` on a lock file inside it while it writes, and
  only a directory whose lock can be taken (any host sharing the filesystem, any PID namespace) is removed. An old
  output renamed aside (``.OUT.deleting-…``) is never removed automatically: it may be the only copy left.
- :func:`durable_write`, :func:`fsync_dir`, :func:`remove_aside`: the primitives the checkpoint directory protocol
  (:mod:`xpar_zoo.checkpoint.layout`, several ranks writing one directory) is built on.
"""

from __future__ import annotations

import fcntl  # not filelock: _remove_if_abandoned must compare the lock file's inode with the held descriptor's
import glob
import os
import re
import shutil
import uuid
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path

from ..errors import ConvertError, LeftoverWarning, XparError

LOCK_FILE = ".xpar-writing.lock"


def durable_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` durably: a temporary name beside it, fsync, rename over ``path``."""
    tmp = path.with_name(path.name + ".part")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def fsync_dir(path: Path) -> None:
    """Make a rename or a new file in directory ``path`` durable (best effort: some filesystems refuse)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def remove_aside(path: Path, name: str) -> None:
    """Remove the directory ``path`` so that no half-removed copy is ever visible under its name: rename it to
    ``name`` beside it first (when possible), then delete it."""
    try:
        target = path.with_name(name)
        os.rename(path, target)
        fsync_dir(path.parent)
        path = target
    except OSError:
        pass
    shutil.rmtree(path, ignore_errors=True)


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


def check_apart(out_dir: Path, inputs: Iterable[str | os.PathLike], error: type[Exception] = ConvertError) -> None:
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


def check_output(out_dir: Path, force: bool, error: type[Exception] = ConvertError,
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


def _is_index(name: str) -> bool:
    return name.endswith(".index.json")


class StagingDir:
    """A new hidden directory beside ``out_dir`` to write into (``.path``), locked while this process writes:
    :meth:`commit` moves it into place, :meth:`discard` removes it. As a context manager (``with StagingDir(out)
    as tmp:``) it commits when the block completes and discards on any exception, the commit's own included; a
    full disk (or quota) becomes one ``error`` saying so."""

    def __init__(self, out_dir: Path, error: type[Exception] = ConvertError,
                 merge: Callable[[str], bool] | None = None, last: Callable[[str], bool] = _is_index) -> None:
        self.out_dir = out_dir
        self.error = error
        self.merge = merge
        self.last = last
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
        from .integrity import disk_full

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
        """Move the staged output into place (:func:`move_into_place`); with ``merge`` into an existing directory,
        file by file (:func:`merge_into_place`)."""
        self._unlock()
        if self.merge is not None and self.out_dir.is_dir():
            merge_into_place(self.path, self.out_dir, self.merge, self.last)
        else:
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


def merge_into_place(tmp: Path, out_dir: Path, stale: Callable[[str], bool], last: Callable[[str], bool] = _is_index
                     ) -> None:
    """Move every file of ``tmp`` into the existing ``out_dir`` (the files ``last`` names at the end: by default the
    index files, so that an index never names a file not yet there), remove the files of ``out_dir`` that ``stale`` names and the new output lacks (weight
    shards of an earlier save), then ``tmp``. The other files of ``out_dir`` stay (a tokenizer, a trainer's state)."""
    new = sorted(p.name for p in tmp.iterdir() if p.name != LOCK_FILE)
    for name in sorted(new, key=last):
        os.replace(tmp / name, out_dir / name)
    for old in out_dir.iterdir():
        if old.is_file() and stale(old.name) and old.name not in new:
            old.unlink()
    shutil.rmtree(tmp, ignore_errors=True)
