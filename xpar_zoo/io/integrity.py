"""Integrity of what xpar_zoo writes and reads: file checksums (recorded at save, verified at load and by
``xpar-zoo convert inspect --verify``), non-finite tensor values, and what a failed write means (a full disk).

Checksums are CRC-32 (``zlib.crc32``): they catch flipped bits, torn writes and truncation, not deliberate
tampering (whoever can rewrite a data file can rewrite the record too). Chosen over SHA-256 for speed (figures:
docs/design.md, "Checkpoints").
"""

from __future__ import annotations

import errno
import os
import shutil
import zlib
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

CHECKSUM = "crc32"
_CHUNK = 16 << 20
_DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def file_checksum(path: str | os.PathLike) -> str:
    """The CRC-32 of a file's bytes, as 8 hex digits (read in 16 MiB chunks)."""
    crc = 0
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            crc = zlib.crc32(view[:n], crc)
    return f"{crc:08x}"


def checksum_files(directory: Path, names: Iterable[str]) -> dict[str, str]:
    """``{name: checksum}`` of the files ``names`` (relative to ``directory``)."""
    return {name: file_checksum(directory / name) for name in names}


def verify_files(directory: Path, checksums: Mapping[str, str], sizes: Mapping[str, int] | None = None
                 ) -> list[str]:
    """Problems (one line each, naming the file) of the files whose recorded ``checksums`` (and ``sizes``) are
    given: missing, another size, another checksum. An empty list when every file is intact."""
    problems = []
    for name, want in checksums.items():
        path = directory / name
        if not path.is_file():
            problems.append(f"{name}: missing")
            continue
        if sizes is not None and name in sizes and path.stat().st_size != sizes[name]:
            problems.append(f"{name}: {path.stat().st_size} bytes, {sizes[name]} recorded")
            continue
        got = file_checksum(path)
        if got != want:
            problems.append(f"{name}: {CHECKSUM} {got}, {want} recorded (the file is corrupt)")
    return problems


def nonfinite_names(named: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """The names of the floating-point tensors (local shards of DTensors) holding a NaN or an infinity."""
    from ..parallel.collectives import to_local

    bad = []
    for name, t in named:
        local = to_local(t) if isinstance(t, torch.Tensor) else t
        if isinstance(local, torch.Tensor) and local.is_floating_point() and local.numel() \
                and not bool(torch.isfinite(local).all()):
            bad.append(name)
    return bad


def _os_errors(exc: BaseException) -> Iterable[OSError]:
    """OSErrors in ``exc``, its cause/context chain, and the per-rank failures of a DCP ``CheckpointException``."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError):
            yield e
        todo += [e.__cause__, e.__context__]
        for failure in (getattr(e, "failures", None) or {}).values():  # DCP: {rank: (exception, traceback)}
            todo.append(failure[0] if isinstance(failure, tuple) else failure)


def disk_full(exc: BaseException, directory: Path, seen: Iterable[OSError] = ()) -> str | None:
    """What stopped the failed write ``exc`` into ``directory`` when it ran out of room: ``"No space left on
    device"`` (or the quota / file size limit), with the file when known; None for any other failure. ``seen``:
    OSErrors recorded by the writer itself — torch's zip writer replaces the OSError of a full disk with
    ``unexpected pos …``, so the filesystem is asked too: less than 1 MiB free counts as full."""
    for e in [*seen, *_os_errors(exc)]:
        if e.errno in _DISK_ERRNOS:
            return os.strerror(e.errno) + (f" (writing {e.filename})" if e.filename else "")
    try:
        free = shutil.disk_usage(directory).free if directory.exists() else None
    except OSError:
        free = None
    if free is not None and free < (1 << 20):
        return f"{os.strerror(errno.ENOSPC)} ({free} bytes free on the filesystem of {directory})"
    return None


class RecordingStream:
    """A writable file that checksums the bytes written through it as they pass (so a save need not read its files
    back) and keeps the OSError of a failed write or flush in ``errors`` (with the file's name) before raising it,
    for callers whose writer loses it (torch's zip writer does). ``checksum`` is None once the file was written
    out of order (a seek): then the file must be read back."""

    def __init__(self, stream, path: str | os.PathLike, errors: list[OSError]) -> None:
        self._stream, self._path, self._errors = stream, os.fspath(path), errors
        self._crc: int | None = 0

    @property
    def checksum(self) -> str | None:
        return None if self._crc is None else f"{self._crc:08x}"

    def _recorded(self, method: str, *args):
        try:
            return getattr(self._stream, method)(*args)
        except OSError as e:
            self._errors.append(e if e.filename else OSError(e.errno, e.strerror, self._path))
            raise

    def write(self, data) -> int:
        written = self._recorded("write", data)
        if self._crc is not None:
            view = memoryview(data).cast("B")
            self._crc = zlib.crc32(view if written is None or written == len(view) else view[:written], self._crc)
        return written

    def flush(self) -> None:
        return self._recorded("flush")

    def seek(self, *args) -> int:
        self._crc = None
        return self._stream.seek(*args)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)
