"""Reading and writing the DCP part of a checkpoint safely: ``.metadata`` through an unpickler that admits only
DCP's own metadata classes (each by module and exact name), tensor data with ``weights_only=True``, every written
file checksummed as DCP writes it (and a failed write's real ``OSError`` kept); and streaming a checkpoint's full
tensors in bounded memory (export)."""

from __future__ import annotations

import contextlib
import io
import math
import os
import pickle
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import (
    Metadata,
    StorageMeta,
    TensorStorageMetadata,
)

from ..compat import dcp_metadata_path
from ..errors import CheckpointError
from ..io.batching import byte_batches
from ..io.integrity import RecordingStream
from .layout import resolve_checkpoint

MODEL_KEY = "model"
OPTIM_KEY = "optim"
NAMES_SHOWN = 12  # how many tensor names an error lists before "… and N more"


_TORCH_CONSTANTS = (torch.dtype, torch.layout, torch.memory_format)
# Every global a DCP .metadata may name, by module, as plain class names: never a dotted name (pickle protocol 4
# resolves "os.system" under any module that imports os), never a whole module.
_ALLOWED_GLOBALS: dict[str, frozenset[str]] = {
    "torch.distributed.checkpoint.metadata": frozenset({
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "ChunkStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING"}),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch.serialization": frozenset({"_get_layout"}),
    "pathlib": frozenset({"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"}),
    "collections": frozenset({"OrderedDict"}),
    "builtins": frozenset({"set", "frozenset", "slice", "complex"}),
}


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP ``.metadata`` only: its own dataclasses, torch sizes/dtypes/layouts, paths, builtin sets —
    each admitted by module and exact class name."""

    def find_class(self, module: str, name: str) -> Any:
        if "." not in name:
            if module == "torch":
                obj = getattr(torch, name, None)
                if name == "Size" or isinstance(obj, _TORCH_CONSTANTS):
                    return obj
            elif name in _ALLOWED_GLOBALS.get(module, ()):
                return super().find_class(module, name)
        raise CheckpointError(f"DCP .metadata refers to {module}.{name}, which a checkpoint never needs; refusing "
                              "to unpickle it")


class SafeReader(dcp.FileSystemReader):
    """A FileSystemReader whose ``.metadata`` goes through :class:`MetadataUnpickler`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        with self.fs.create_stream(dcp_metadata_path(self, kwargs.get("rank")), "rb") as f:
            metadata = MetadataUnpickler(f).load()
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"{self.path}: its .metadata holds a {type(metadata).__name__}, not DCP metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class RecordingFileSystem(FileSystem):
    """DCP's local file system, checksumming every file as it is written (``checksums``: ``{path: crc32}``, for
    files written in order) and keeping the OSError of every failed write (a full disk) in ``errors``: torch's zip
    writer, which DCP writes tensors with, replaces it with ``unexpected pos …``."""

    def __init__(self) -> None:
        super().__init__()
        self.errors: list[OSError] = []
        self.checksums: dict[str, str] = {}

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.IOBase]:
        if mode != "wb":
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        try:
            with super().create_stream(path, mode) as stream:
                recorded = RecordingStream(stream, path, self.errors)
                yield recorded
        except OSError as e:  # the final flush of close()
            if not any(e is seen for seen in self.errors):
                self.errors.append(e if e.filename else OSError(e.errno, e.strerror, os.fspath(path)))
            raise
        if recorded.checksum is not None:
            self.checksums[os.fspath(path)] = recorded.checksum


def dcp_writer(tmp: Path) -> tuple[dcp.FileSystemWriter, RecordingFileSystem]:
    """A DCP writer into ``tmp`` (fsynced files) and its file system, which records checksums and failures."""
    writer = dcp.FileSystemWriter(str(tmp), sync_files=True)
    writer.fs = RecordingFileSystem()
    return writer, writer.fs


class SafeLoadPlanner(dcp.DefaultLoadPlanner):
    """Non-tensor DCP items (our checkpoints have none) are read with ``weights_only=True``."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        super().load_bytes(read_item, _bytes_of(obj))


def _bytes_of(obj: Any) -> io.BytesIO:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf


def read_dcp_metadata(reader: SafeReader, ckpt: Path) -> Metadata:
    """The checkpoint's DCP metadata through :class:`MetadataUnpickler`; :class:`CheckpointError` when unreadable."""
    try:
        return reader.read_metadata()
    except CheckpointError:
        raise
    except (OSError, EOFError, pickle.UnpicklingError, AttributeError, ValueError) as e:
        raise CheckpointError(f"{ckpt}: unreadable DCP metadata ({type(e).__name__}: {e})") from None


def model_tensor_specs(path: str | os.PathLike) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """``{in-memory HF name: (global shape, dtype)}`` of a checkpoint's model tensors, in saved order, from the DCP
    metadata alone (no tensor data)."""
    ckpt = resolve_checkpoint(path)
    prefix = f"{MODEL_KEY}."
    return {k[len(prefix):]: (tuple(v.size), v.properties.dtype)
            for k, v in read_dcp_metadata(SafeReader(str(ckpt)), ckpt).state_dict_metadata.items()
            if k.startswith(prefix) and isinstance(v, TensorStorageMetadata)}


def iter_model_tensors(path: str | os.PathLike, names: list[str] | None = None, *, max_bytes: int = 1 << 30
                       ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(in-memory HF name, full CPU tensor at global shape)`` for the model tensors of a checkpoint
    directory (or the newest complete one under a root), reading at most ``max_bytes`` of tensors at a time
    (one tensor at least): bounded memory for export. Local file reads only (no process group): call it on one
    rank. ``names`` restricts and orders the output; an unknown name raises :class:`CheckpointError`."""
    ckpt = resolve_checkpoint(path)
    reader = SafeReader(str(ckpt))
    prefix = f"{MODEL_KEY}."
    tensors = {k[len(prefix):]: v for k, v in read_dcp_metadata(reader, ckpt).state_dict_metadata.items()
               if k.startswith(prefix) and isinstance(v, TensorStorageMetadata)}
    if names is None:
        names = list(tensors)
    unknown = [n for n in names if n not in tensors]
    if unknown:
        raise CheckpointError(f"{ckpt} has no model tensor(s) {listing([prefix + n for n in unknown])}")

    def nbytes(name: str) -> int:
        md = tensors[name]
        return math.prod(md.size) * md.properties.dtype.itemsize

    for batch in byte_batches(((n, nbytes(n)) for n in names), max_bytes):
        state = {prefix + n: torch.empty(tuple(tensors[n].size), dtype=tensors[n].properties.dtype) for n in batch}
        with quiet_single_process():
            dcp.load(state, storage_reader=SafeReader(str(ckpt)), planner=SafeLoadPlanner(), no_dist=True)
        for n in batch:
            yield n, state.pop(prefix + n)


@contextlib.contextmanager
def quiet_single_process():
    """DCP warns that it 'assumes a single process' even when told so (``no_dist=True``)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is (disabled|unavailable)", category=UserWarning)
        yield




def plain_name(key: str) -> str:
    """A DCP key as the user knows it: the model's parameter name, or "optimizer state <fqn>.<name>"."""
    if key.startswith(f"{MODEL_KEY}."):
        return key[len(MODEL_KEY) + 1:]
    if key.startswith(f"{OPTIM_KEY}.state."):
        return f"optimizer state {key[len(OPTIM_KEY) + 7:]}"
    return key


def listing(keys: list[str]) -> str:
    """The first few keys (:func:`plain_name`), and how many more."""
    shown = ", ".join(plain_name(k) for k in keys[:NAMES_SHOWN])
    return shown + (f", … and {len(keys) - NAMES_SHOWN} more" if len(keys) > NAMES_SHOWN else "")
