"""Checkpoints: torch DCP at global shapes (every expert, every vocab row), reshardable onto any mesh or world size,
with the optimizer state, the RNG state and the user's JSON state, written atomically.

Layout of a checkpoint root (``save_checkpoint(root, ...)`` writes one ``step-N`` directory per call)::

    root/
      step-00000010/                 a complete checkpoint: loadable on any mesh, any world size, or without plans
        .metadata, __0_0.distcp, …   DCP, tensors only, at global shapes: "model.<fqn>", "optim.state.<fqn>.<name>"
        xpar_checkpoint.json         format, step, model_type, config, mesh, plans, versions, optimizer hyper-params
        extra_state.json             the user's ``extra_state`` (JSON)
        rng/rank-00000.safetensors   each saving rank's RNG state (torch CPU, CUDA when initialised, Python random)
        COMPLETE                     the commit marker (JSON: step, size and CRC-32 of every file), written last
      .tmp-step-00000012-<id>/       a save in progress, or one that was interrupted: never loaded
      .deleting-step-00000004-<id>/  a checkpoint being pruned (``keep_last``)

Every rank writes under ``.tmp-…``; when all ranks have finished, each checksums the files it wrote, and rank 0
renames the directory to ``step-N`` and then writes ``COMPLETE``. A process killed at any moment leaves every earlier
checkpoint untouched; whatever it was writing is reported (a :class:`CheckpointWarning` naming it), skipped by
:func:`latest_checkpoint`, refused by :func:`load_checkpoint` and removed by the next save. A failed save (a full
disk, a rank's error) removes its own ``.tmp-…``. One writer per root at a time. Directories are never followed
through symbolic links, and a ``step-N`` whose COMPLETE records another step is not a checkpoint.

Integrity: :func:`load_checkpoint` checks every file against its CRC-32 before it touches the model (the ranks
share the reading), then reads and checks every side file, then loads; :func:`verify_checkpoint` (``xpar-zoo
convert inspect --verify``) checks a checkpoint offline. ``save_checkpoint`` refuses NaN / inf values unless told
otherwise. Both calls meet the other ranks first (:mod:`xpar_zoo.rendezvous`): a rank that calls alone, or ranks
given different arguments, get a clear error within a bounded time instead of a hang.

:func:`iter_model_tensors` streams a checkpoint's full tensors (HF names, global shapes) in bounded memory, for
export; :func:`read_checkpoint_metadata` returns its JSON metadata.

Nothing is unpickled: non-tensor optimizer values and the user's state are JSON (tuples tagged, tag-like user dicts
escaped), RNG states are safetensors, DCP's tensor data is read with ``weights_only=True`` and its ``.metadata`` with
an unpickler that admits only DCP's own metadata classes, each by module and exact name.

RNG is saved per rank and restored on the rank with the same id; a rank that did not exist in the saving job keeps
its RNG (a different world size draws different random streams anyway). The root must be one filesystem that every
rank sees (a shared filesystem across nodes).

Optimizers: plain ``torch.optim.AdamW(model.parameters())`` steps a parallelized model exactly like single-process
training although its parameters are DTensors on different meshes (dense ``[fsdp]`` and ``[ep_fsdp, ep]``…): the
default (for-loop), ``foreach=True`` and ``fused=True`` paths all work on CPU (tests/test_checkpoint.py), so no
per-mesh parameter groups are needed; :func:`xpar_zoo.clip_grad_norm_` clips across the meshes, and the optimizer
state is saved by parameter name at global shapes (``get_state_dict``), so it reshards like the model.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import json
import math
import os
import pickle
import random
import re
import shutil
import threading
import uuid
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from .batching import byte_batches
from .errors import CheckpointError
from .integrity import (CHECKSUM, RecordingStream, checksum_files, disk_full, file_checksum, nonfinite_names,
                        verify_files)
from .rendezvous import meet

FORMAT = "xpar_zoo.checkpoint/1"
STEP_PREFIX = "step-"
TMP_PREFIX = ".tmp-"
DELETING_PREFIX = ".deleting-"
META_FILE = "xpar_checkpoint.json"
EXTRA_FILE = "extra_state.json"
COMPLETE_FILE = "COMPLETE"
RNG_DIR = "rng"
DCP_METADATA = ".metadata"
MODEL_KEY = "model"
OPTIM_KEY = "optim"
_STEP_RE = re.compile(r"^step-(\d+)$")
_SHOW = 12  # how many tensor names an error lists before "… and N more"


class CheckpointWarning(UserWarning):
    """An incomplete or broken checkpoint directory was found and skipped."""


def checkpoint_name(step: int) -> str:
    """The directory name of the checkpoint of ``step`` (``step-00000010``)."""
    return f"{STEP_PREFIX}{step:08d}"


def _reached(phase: str) -> None:
    """Fault-injection point for tests (a no-op): ``begin``, ``rng_written``, ``dcp_written``, ``before_rename``,
    ``before_marker``, ``committed``, ``pruning``."""


# ---- scanning a root --------------------------------------------------------------------------------------------
def _complete_record(ckpt: Path) -> dict:
    """The JSON of ``ckpt``'s COMPLETE marker (``{"format", "step", "files": {name: size}, "checksum",
    "checksums": {name: hex}}``); raises OSError / ValueError when it cannot be read."""
    record = json.loads((ckpt / COMPLETE_FILE).read_text())
    if not isinstance(record, dict) or not isinstance(record.get("files"), dict):
        raise ValueError("no files listed")
    return record


def _incomplete_reason(ckpt: Path, step: int | None = None) -> str | None:
    """Why ``ckpt`` is not a complete checkpoint (of ``step``, when given: the step its name says), or None when
    it is. Sizes only: checksums are verified by :func:`verify_checkpoint` and at load."""
    marker = ckpt / COMPLETE_FILE
    if not marker.is_file():
        return "no COMPLETE marker (the save never committed)"
    try:
        record = _complete_record(ckpt)
        files = record["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return "unreadable COMPLETE marker"
    if step is not None and record.get("step") != step:
        return f"{_RENAMED} {record.get('step')!r}, its name says {step} (renamed or copied)"
    for rel, size in files.items():
        f = ckpt / rel
        if not f.is_file():
            return f"file {rel} listed in COMPLETE is missing"
        if f.stat().st_size != size:
            return f"file {rel} has {f.stat().st_size} bytes, COMPLETE says {size}"
    for required in (DCP_METADATA, META_FILE):
        if required not in files:
            return f"COMPLETE does not list {required}"
    return None


_LINK_REASON = "a symbolic link: checkpoints are never read, pruned or cleaned up through links"
_RENAMED = "COMPLETE records step"


def _foreign(path: Path, why: str) -> bool:
    """Whether a directory skipped by :func:`_scan` is not ours to remove: a link, or a complete checkpoint under
    another step's name (a user's copy)."""
    return path.is_symlink() or why.startswith(_RENAMED)


def _scan(root: Path) -> tuple[list[tuple[int, Path]], list[tuple[Path, str]]]:
    """Complete checkpoints ``[(step, dir)]`` sorted by step, and broken directories ``[(dir, reason)]`` (links
    among them: never loaded, never removed)."""
    complete, broken = [], []
    if not root.is_dir():
        return complete, broken
    for child in sorted(root.iterdir()):
        if not child.name.startswith((TMP_PREFIX, DELETING_PREFIX, STEP_PREFIX)):
            continue
        if child.is_symlink():
            broken.append((child, _LINK_REASON))
        elif not child.is_dir():
            continue
        elif child.name.startswith(TMP_PREFIX):
            broken.append((child, "an unfinished save (interrupted, or still running)"))
        elif child.name.startswith(DELETING_PREFIX):
            broken.append((child, "left over from an interrupted pruning"))
        elif m := _STEP_RE.match(child.name):
            why = _incomplete_reason(child, int(m[1]))
            if why:
                broken.append((child, why))
            else:
                complete.append((int(m[1]), child))
    complete.sort()
    return complete, broken


def _warn_broken(broken: list[tuple[Path, str]]) -> None:
    for path, why in broken:
        warnings.warn(f"xpar_zoo: skipping incomplete checkpoint {path}: {why}", CheckpointWarning, stacklevel=3)


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint directory under ``root`` (highest step), or None. Incomplete or broken
    directories are reported with a :class:`CheckpointWarning` naming them, and skipped."""
    complete, broken = _scan(Path(root))
    _warn_broken(broken)
    return complete[-1][1] if complete else None


def _resolve(path: Path) -> Path:
    """``path`` itself when it is a checkpoint directory (complete, or an error), else its newest complete one."""
    if not path.is_dir():
        raise CheckpointError(f"no checkpoint at {path} (not a directory)")
    if path.name.startswith((TMP_PREFIX, DELETING_PREFIX)):
        raise CheckpointError(f"{path} is an unfinished save or a checkpoint being deleted; it is never loaded")
    if any((path / f).exists() for f in (COMPLETE_FILE, META_FILE, DCP_METADATA)):
        if not (path / META_FILE).exists() and (path / DCP_METADATA).exists():
            raise CheckpointError(f"{path} is a DCP directory but not an xpar_zoo checkpoint (no {META_FILE})")
        m = _STEP_RE.match(path.name)
        why = _incomplete_reason(path, int(m[1]) if m else None)
        if why:
            raise CheckpointError(f"{path} is not a complete checkpoint: {why}; it is never loaded")
        return path
    complete, broken = _scan(path)
    _warn_broken(broken)
    if not complete:
        extra = f"; incomplete ones skipped: {', '.join(p.name for p, _ in broken)}" if broken else ""
        raise CheckpointError(f"no complete checkpoint under {path}{extra}")
    return complete[-1][1]


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """The checkpoint directory ``path`` names: itself (complete, or an error), or the newest complete one under a
    root. Resolve once when reading several parts of one checkpoint, so that they all come from the same step."""
    return _resolve(Path(path))


def read_checkpoint_metadata(path: str | os.PathLike) -> dict:
    """The ``xpar_checkpoint.json`` of a checkpoint directory (or of the newest complete one under a root):
    format, step, model_type, config, mesh, plans, versions, optimizer hyper-parameters."""
    return json.loads((_resolve(Path(path)) / META_FILE).read_text())


# ---- safe reading of DCP ------------------------------------------------------------------------------------------
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


class _MetadataUnpickler(pickle.Unpickler):
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


class _SafeReader(dcp.FileSystemReader):
    """A FileSystemReader whose ``.metadata`` goes through :class:`_MetadataUnpickler`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"{self.path}: its .metadata holds a {type(metadata).__name__}, not DCP metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _RecordingFileSystem(FileSystem):
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


def _writer(tmp: Path) -> tuple[dcp.FileSystemWriter, _RecordingFileSystem]:
    """A DCP writer into ``tmp`` (fsynced files) and its file system, which records checksums and failures."""
    writer = dcp.FileSystemWriter(str(tmp), sync_files=True)
    writer.fs = _RecordingFileSystem()
    return writer, writer.fs


class _SafeLoadPlanner(dcp.DefaultLoadPlanner):
    """Non-tensor DCP items (our checkpoints have none) are read with ``weights_only=True``."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        super().load_bytes(read_item, _bytes_of(obj))


def _bytes_of(obj: Any) -> io.BytesIO:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf


def _read_dcp_metadata(reader: _SafeReader, ckpt: Path) -> Metadata:
    try:
        return reader.read_metadata()
    except CheckpointError:
        raise
    except (OSError, EOFError, pickle.UnpicklingError, AttributeError, ValueError) as e:
        raise CheckpointError(f"{ckpt}: unreadable DCP metadata ({type(e).__name__}: {e})") from None


def model_tensor_specs(path: str | os.PathLike) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """``{in-memory HF name: (global shape, dtype)}`` of a checkpoint's model tensors, in saved order, from the DCP
    metadata alone (no tensor data)."""
    ckpt = _resolve(Path(path))
    prefix = f"{MODEL_KEY}."
    return {k[len(prefix):]: (tuple(v.size), v.properties.dtype)
            for k, v in _read_dcp_metadata(_SafeReader(str(ckpt)), ckpt).state_dict_metadata.items()
            if k.startswith(prefix) and isinstance(v, TensorStorageMetadata)}


def iter_model_tensors(path: str | os.PathLike, names: list[str] | None = None, *, max_bytes: int = 1 << 30
                       ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(in-memory HF name, full CPU tensor at global shape)`` for the model tensors of a checkpoint
    directory (or the newest complete one under a root), reading at most ``max_bytes`` of tensors at a time
    (one tensor at least): bounded memory for export. Local file reads only (no process group): call it on one
    rank. ``names`` restricts and orders the output; an unknown name raises :class:`CheckpointError`."""
    ckpt = _resolve(Path(path))
    reader = _SafeReader(str(ckpt))
    prefix = f"{MODEL_KEY}."
    tensors = {k[len(prefix):]: v for k, v in _read_dcp_metadata(reader, ckpt).state_dict_metadata.items()
               if k.startswith(prefix) and isinstance(v, TensorStorageMetadata)}
    if names is None:
        names = list(tensors)
    unknown = [n for n in names if n not in tensors]
    if unknown:
        raise CheckpointError(f"{ckpt} has no model tensor(s) {_listing([prefix + n for n in unknown])}")

    def nbytes(name: str) -> int:
        md = tensors[name]
        return math.prod(md.size) * md.properties.dtype.itemsize

    for batch in byte_batches(((n, nbytes(n)) for n in names), max_bytes):
        state = {prefix + n: torch.empty(tuple(tensors[n].size), dtype=tensors[n].properties.dtype) for n in batch}
        with _quiet_single_process():
            dcp.load(state, storage_reader=_SafeReader(str(ckpt)), planner=_SafeLoadPlanner(), no_dist=True)
        for n in batch:
            yield n, state.pop(prefix + n)


# ---- JSON -------------------------------------------------------------------------------------------------------
_TUPLE_TAG, _DICT_TAG = "__tuple__", "__dict__"


def _to_json(value: Any, what: str) -> Any:
    """``value`` as JSON data; tuples are tagged (``{"__tuple__": [...]}``) so that they come back as tuples, and a
    user dict that looks like a tag is escaped (``{"__dict__": {...}}``) so that it comes back as itself."""
    if isinstance(value, tuple):
        return {_TUPLE_TAG: [_to_json(v, what) for v in value]}
    if isinstance(value, list):
        return [_to_json(v, what) for v in value]
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise CheckpointError(f"{what}: key {k!r} is not a string (JSON)")
            out[k] = _to_json(v, what)
        return {_DICT_TAG: out} if set(out) in ({_TUPLE_TAG}, {_DICT_TAG}) else out
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise CheckpointError(f"{what}: {type(value).__name__} value {value!r:.80} is not JSON-serialisable")


def _from_json(value: Any) -> Any:
    if isinstance(value, list):
        return [_from_json(v) for v in value]
    if isinstance(value, dict):
        if set(value) == {_TUPLE_TAG}:
            return tuple(_from_json(v) for v in value[_TUPLE_TAG])
        if set(value) == {_DICT_TAG} and isinstance(value[_DICT_TAG], dict):
            return {k: _from_json(v) for k, v in value[_DICT_TAG].items()}
        return {k: _from_json(v) for k, v in value.items()}
    return value


def _write_file(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` durably (temporary name, fsync, rename)."""
    tmp = path.with_name(path.name + ".part")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
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


# ---- RNG --------------------------------------------------------------------------------------------------------
def _rng_file(ckpt: Path, rank: int) -> Path:
    return ckpt / RNG_DIR / f"rank-{rank:05d}.safetensors"


def _save_rng(ckpt: Path, rank: int) -> None:
    from safetensors.torch import save

    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"cuda_{i}"] = state
    version, internal, gauss = random.getstate()
    tensors["python"] = torch.tensor(internal, dtype=torch.int64)
    meta = {"python_version": str(version), "python_gauss_next": json.dumps(gauss)}
    (ckpt / RNG_DIR).mkdir(exist_ok=True)
    _write_file(_rng_file(ckpt, rank), save(tensors, metadata=meta))


def _read_rng(ckpt: Path, rank: int) -> dict[str, Any] | None:
    """This rank's saved RNG state, read and checked (None when the saving job had no such rank); raises
    :class:`CheckpointError` naming the file when it is not a valid RNG state."""
    from safetensors import SafetensorError, safe_open

    path = _rng_file(ckpt, rank)
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        cpu = tensors["torch_cpu"]
        if cpu.dtype != torch.uint8 or cpu.shape != torch.get_rng_state().shape:
            raise ValueError(f"torch_cpu is {cpu.dtype} {list(cpu.shape)}, not the {list(torch.get_rng_state().shape)}"
                             " bytes of a CPU generator state")
        state: dict[str, Any] = {"torch_cpu": cpu, "cuda": [tensors[k] for k in sorted(tensors)
                                                            if k.startswith("cuda_")], "python": None}
        if "python" in tensors and "python_version" in meta:
            internal = tuple(int(x) for x in tensors["python"].tolist())
            gauss = json.loads(meta.get("python_gauss_next", "null"))
            state["python"] = (int(meta["python_version"]), internal, gauss)
            random.Random().setstate(state["python"])  # checks it without touching the global generator
    except (OSError, ValueError, KeyError, TypeError, SafetensorError) as e:
        raise CheckpointError(f"{path}: not a valid RNG state ({type(e).__name__}: {e})") from None
    return state


def _apply_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch_cpu"])
    cuda = state["cuda"]
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)
    if state["python"] is not None:
        random.setstate(state["python"])


@contextlib.contextmanager
def _quiet_single_process():
    """DCP warns that it 'assumes a single process' even when told so (``no_dist=True``)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is (disabled|unavailable)", category=UserWarning)
        yield


# ---- collectives --------------------------------------------------------------------------------------------------
def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _broadcast(obj: Any, group: dist.ProcessGroup | None = None) -> Any:
    """Rank 0's ``obj`` on every rank (our own small Python values between our own processes)."""
    if not _distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def _all_gather(obj: Any, group: dist.ProcessGroup | None = None) -> list:
    """Every rank's ``obj``, by rank."""
    if not _distributed():
        return [obj]
    values: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(values, obj, group=group)
    return values


def _every_error(message: str | None, group: dist.ProcessGroup | None = None) -> str | None:
    """Every rank's error message (or None) gathered: one line per distinct message, naming its ranks (a single
    process: its own message), or None when all ranks succeeded. The same text on every rank."""
    if not _distributed():
        return message
    return _join_errors(_all_gather(message, group))


def _describe_error(e: BaseException) -> str:
    """One line for an error: our own message, each rank's failure of a DCP ``CheckpointException``, or the type
    and text of anything else."""
    if isinstance(e, CheckpointError):
        return str(e)
    failures = getattr(e, "failures", None)
    if isinstance(e, CheckpointException) and isinstance(failures, dict) and failures:
        causes = {r: f[0] if isinstance(f, tuple) else f for r, f in failures.items()}  # {rank: (exception, tb)}
        return _join_errors([_describe_error(causes[r]) if r in causes else None for r in range(max(causes) + 1)])
    return f"{type(e).__name__}: {e}"


def _join_errors(messages: list[str | None]) -> str | None:
    """Per-rank messages (None: no error) as lines, ranks with the same message on one line; None when none."""
    by_text: dict[str, list[int]] = {}
    for r, m in enumerate(messages):
        if m:
            by_text.setdefault(m, []).append(r)
    if len(messages) == 1:
        return messages[0]
    return "\n".join(f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {m}"
                     for m, rs in by_text.items()) or None


# ---- state dicts --------------------------------------------------------------------------------------------------
def _state_dicts(model: nn.Module, optimizer: torch.optim.Optimizer | None):
    """``(model state dict, optimizer state dict or None)``: sharded DTensors at global shapes, HF names."""
    if optimizer is None:
        return get_model_state_dict(model), None
    return get_state_dict(model, optimizer)


def _split_optimizer(osd: dict) -> tuple[dict, dict, list]:
    """Optimizer state dict → (tensors ``{fqn: {name: tensor}}``, other values ``{fqn: {name: value}}``,
    param_groups)."""
    tensors: dict[str, dict[str, torch.Tensor]] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for fqn, state in osd["state"].items():
        for name, value in state.items():
            if isinstance(value, torch.Tensor):
                tensors.setdefault(fqn, {})[name] = value
            else:
                scalars.setdefault(fqn, {})[name] = value
    return tensors, scalars, osd["param_groups"]


def _dcp_state(msd: dict, osd: dict | None) -> dict:
    state: dict[str, Any] = {MODEL_KEY: msd}
    if osd is not None:
        state[OPTIM_KEY] = {"state": _split_optimizer(osd)[0]}
    return state


def _expected_shapes(msd: dict, osd: dict | None) -> dict[str, tuple[int, ...]]:
    """``{DCP key: global shape}`` of every tensor the model (and optimizer) will load."""
    out = {f"{MODEL_KEY}.{k}": tuple(v.shape) for k, v in msd.items() if isinstance(v, torch.Tensor)}
    if osd is not None:
        for fqn, state in _split_optimizer(osd)[0].items():
            out.update({f"{OPTIM_KEY}.state.{fqn}.{n}": tuple(v.shape) for n, v in state.items()})
    return out


def _plain_name(key: str) -> str:
    if key.startswith(f"{MODEL_KEY}."):
        return key[len(MODEL_KEY) + 1:]
    if key.startswith(f"{OPTIM_KEY}.state."):
        return f"optimizer state {key[len(OPTIM_KEY) + 7:]}"
    return key


def _listing(keys: list[str]) -> str:
    shown = ", ".join(_plain_name(k) for k in keys[:_SHOW])
    return shown + (f", … and {len(keys) - _SHOW} more" if len(keys) > _SHOW else "")


def _check_compatible(ckpt: Path, saved: dict[str, tuple[int, ...]], meta: dict, model: nn.Module,
                      expected: dict[str, tuple[int, ...]], with_optimizer: bool,
                      param_groups: list | None = None) -> None:
    """Raise :class:`CheckpointError` naming every mismatch between checkpoint and model, before loading."""
    problems = []
    saved_type = meta.get("model_type")
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if saved_type and model_type and saved_type != model_type:
        problems.append(f"architecture: the checkpoint holds a {saved_type!r} model, this model is {model_type!r}")
    if with_optimizer:
        group_problem = _param_group_problem(_from_json((meta.get("optimizer") or {}).get("param_groups")),
                                             param_groups or [])
        if group_problem:
            problems.append(group_problem)
    if with_optimizer and not any(k.startswith(f"{OPTIM_KEY}.") for k in saved) and any(
            k.startswith(f"{OPTIM_KEY}.") for k in expected):
        problems.append("the checkpoint has no optimizer state (saved without optimizer=)")
        expected = {k: v for k, v in expected.items() if not k.startswith(f"{OPTIM_KEY}.")}
    shapes = [k for k in expected if k in saved and saved[k] != expected[k]]
    if shapes:
        problems.append(f"shape mismatch ({len(shapes)}), checkpoint vs model: " + "; ".join(
            f"{_plain_name(k)} {list(saved[k])} vs {list(expected[k])}" for k in shapes[:_SHOW])
            + (f"; … and {len(shapes) - _SHOW} more" if len(shapes) > _SHOW else ""))
    missing = [k for k in expected if k not in saved]
    if missing:
        problems.append(f"missing from the checkpoint ({len(missing)}): {_listing(missing)}")
    scope = (f"{MODEL_KEY}.", f"{OPTIM_KEY}.") if with_optimizer else (f"{MODEL_KEY}.",)
    unexpected = [k for k in saved if k.startswith(scope) and k not in expected]
    if unexpected:
        problems.append(f"not in the model{'/optimizer' if with_optimizer else ''} ({len(unexpected)}): "
                        f"{_listing(unexpected)}")
    if problems:
        raise CheckpointError(f"checkpoint {ckpt} does not fit {_model_class(model)}:\n  " + "\n  ".join(problems))


def _param_group_problem(saved: list | None, current: list) -> str | None:
    """How the optimizer's parameter groups differ from the checkpoint's (count, or the parameters of a group),
    as ``torch.optim.Optimizer.load_state_dict`` refuses them; None when they agree."""
    if saved is None:
        return None
    if len(saved) != len(current):
        return (f"the checkpoint's optimizer has {len(saved)} parameter group(s), this optimizer has {len(current)}:"
                " build it with the same groups")
    for i, (s, c) in enumerate(zip(saved, current)):
        want, have = list(s.get("params", [])), list(c.get("params", []))
        if set(want) != set(have):
            missing, extra = [p for p in want if p not in have], [p for p in have if p not in want]
            return (f"parameter group {i} holds {len(want)} parameters in the checkpoint, {len(have)} in this "
                    "optimizer" + (f"; only in the checkpoint: {', '.join(missing[:_SHOW])}" if missing else "")
                    + (f"; only in this optimizer: {', '.join(extra[:_SHOW])}" if extra else ""))
    return None


def _model_class(model: nn.Module) -> str:
    from torch.distributed.fsdp import FSDPModule

    cls = next((c for c in type(model).__mro__ if not issubclass(c, FSDPModule)), type(model))
    return cls.__name__


def _metadata(model: nn.Module, step: int, optimizer, scalars: dict, param_groups: list | None) -> dict:
    from . import __version__

    try:
        import transformers
        tf_version = transformers.__version__
    except ImportError:  # pragma: no cover
        tf_version = None
    config = getattr(model, "config", None)
    xpar = getattr(model, "_xpar", None)
    plans: dict[str, list[str]] = {}
    if xpar is not None:
        for fqn, name in xpar.planned_params().items():
            plans.setdefault(name, []).append(fqn)
    return {
        "format": FORMAT,
        "step": step,
        "created_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "world_size": dist.get_world_size() if _distributed() else 1,
        "xpar_zoo_version": __version__,
        "torch_version": torch.__version__,
        "transformers_version": tf_version,
        "model_class": _model_class(model),
        "model_type": getattr(config, "model_type", None),
        "config": json.loads(config.to_json_string(use_diff=False)) if config is not None else None,
        "mesh": xpar.mesh.describe() if xpar is not None else None,
        "plan_model_type": xpar.plan.model_type if xpar is not None else None,
        "plans": plans,
        "peft": _adapter_metadata(model),
        "tensors": "DCP at global shapes; planned tensors hold every expert / vocab row in global order",
        "rng": "per rank: rng/rank-NNNNN.safetensors (torch CPU, CUDA when initialised, Python random)",
        "optimizer": None if optimizer is None else {
            "class": type(optimizer).__name__,
            "param_groups": _to_json(param_groups, "optimizer param_groups"),
            "non_tensor_state": _to_json(scalars, "optimizer state"),
        },
    }


def _adapter_metadata(model: nn.Module) -> dict | None:
    """The PEFT adapter configs of a model that carries one (``xpar-zoo convert to-hf --merge-adapter`` reads them)."""
    from .parallelize import uses_peft

    if not uses_peft(model):
        return None
    from .integrations.peft import adapter_metadata

    return adapter_metadata(model)


# ---- committing -------------------------------------------------------------------------------------------------
def _choose_step(root: Path, step: int | None, extra_state: Mapping) -> int:
    if step is None and isinstance(extra_state.get("step"), int) and not isinstance(extra_state["step"], bool):
        step = extra_state["step"]
    if step is None:
        complete, _ = _scan(root)
        step = complete[-1][0] + 1 if complete else 0
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CheckpointError(f"step must be a non-negative integer, got {step!r}")
    return step


def _remove(path: Path) -> None:
    """Delete a checkpoint directory so that no half-deleted ``step-N`` is ever visible: rename, then delete."""
    if not path.name.startswith(DELETING_PREFIX):
        target = path.with_name(f"{DELETING_PREFIX}{path.name.removeprefix(TMP_PREFIX)}-{uuid.uuid4().hex[:8]}")
        os.rename(path, target)
        _fsync_dir(path.parent)
        path = target
    _reached("pruning")
    shutil.rmtree(path, ignore_errors=True)


def _discard(tmp: Path) -> None:
    """Remove the directory of a failed save (renamed aside first, as :func:`_remove` does)."""
    try:
        target = tmp.with_name(f"{DELETING_PREFIX}{tmp.name.removeprefix(TMP_PREFIX)}-{uuid.uuid4().hex[:8]}")
        os.rename(tmp, target)
        tmp = target
    except OSError:
        pass
    shutil.rmtree(tmp, ignore_errors=True)


def _clear_leftovers(root: Path) -> None:
    """Rank 0, at the start of a save (one writer per root): remove what interrupted saves and prunings left
    (``.tmp-…``, ``.deleting-…``; never through a link), naming them in a :class:`CheckpointWarning`."""
    removed = []
    for path, why in _scan(root)[1]:
        if path.name.startswith((TMP_PREFIX, DELETING_PREFIX)) and not _foreign(path, why):
            _discard(path)
            removed.append(path.name)
    if removed:
        warnings.warn(f"xpar_zoo: removed {', '.join(removed)} from {root}: left by interrupted saves",
                      CheckpointWarning, stacklevel=3)


def _prune(root: Path, keep_last: int, keep: Path) -> None:
    """Keep the ``keep_last`` newest complete checkpoints (always ``keep``, the one just committed); remove older
    ones and leftovers of interrupted saves or prunings (never a link, nor a renamed copy)."""
    complete, broken = _scan(root)
    victims = [p for _, p in complete[:-keep_last] if p != keep] + [p for p, why in broken if not _foreign(p, why)]
    for path in victims:
        _remove(path)


def _commit(tmp: Path, final: Path, keep_last: int | None, checksums: Mapping[str, str]) -> None:
    """Rank 0, once every rank's data is on disk: rename ``tmp`` to ``final``, then write the COMPLETE marker."""
    _reached("before_rename")
    if final.exists():  # an incomplete leftover of the same step (a complete one was refused before writing)
        _remove(final)
    os.rename(tmp, final)
    _fsync_dir(final.parent)
    _reached("before_marker")
    write_complete_marker(final, int(final.name[len(STEP_PREFIX):]), checksums)
    _reached("committed")
    if keep_last is not None:
        _prune(final.parent, keep_last, final)


def write_complete_marker(ckpt: Path, step: int, checksums: Mapping[str, str] | None = None) -> None:
    """Commit the checkpoint directory ``ckpt`` of ``step``: write its ``COMPLETE`` marker listing the size and
    the checksum of every file in it (call it last, once every file is on disk). ``checksums`` already computed
    (by the ranks that wrote the files) are recorded as given; the others are computed here."""
    names = [str(p.relative_to(ckpt)) for p in sorted(ckpt.rglob("*"))
             if p.is_file() and not p.is_symlink() and p.name != COMPLETE_FILE]
    given = dict(checksums or {})
    record = {"format": FORMAT, "step": step, "files": {n: (ckpt / n).stat().st_size for n in names},
              "checksum": CHECKSUM, "checksums": {n: given.get(n) or file_checksum(ckpt / n) for n in names}}
    _write_file(ckpt / COMPLETE_FILE, json.dumps(record, indent=1).encode())
    _fsync_dir(ckpt)


def _own_files(tmp: Path, rank: int) -> list[str]:
    """The files of the save in ``tmp`` that ``rank`` wrote: its DCP data files (DCP names them ``__<rank>_…``) and
    RNG file; rank 0 also the metadata files."""
    names = [p.name for p in tmp.glob(f"__{rank}_*.distcp")]
    if _rng_file(tmp, rank).is_file():
        names.append(str(_rng_file(tmp, rank).relative_to(tmp)))
    if rank == 0:
        names += [n for n in (DCP_METADATA, META_FILE, EXTRA_FILE) if (tmp / n).is_file()]
    return names


def _finish_save(tmp: Path, final: Path, keep_last: int | None, error: str | None,
                 group: dist.ProcessGroup | None, written: Mapping[str, str]) -> str | None:
    """Every rank, once the DCP data is written (or failed with ``error``): the checksums of the files this rank
    wrote (``written``: taken while DCP wrote them; the others read back, in parallel with the other ranks); then
    rank 0 commits (rename, COMPLETE with every checksum, pruning), or removes ``tmp`` when any rank failed.
    Returns the error, the same text on every rank, or None."""
    rank = _rank()
    sums: dict[str, str] = {}
    if error is None:
        try:
            taken = {str(Path(p).relative_to(tmp)): c for p, c in written.items()}
            sums = {**taken, **checksum_files(tmp, [n for n in _own_files(tmp, rank) if n not in taken])}
        except Exception as e:
            error = _write_error(e, final.parent)
    gathered = _all_gather((error, sums), group)
    outcome = None
    if rank == 0:
        outcome = _join_errors([e for e, _ in gathered])
        if outcome:
            _discard(tmp)
        else:
            try:
                _commit(tmp, final, keep_last, {n: c for _, part in gathered for n, c in part.items()})
            except Exception as e:
                outcome = f"committing {final} failed: {_write_error(e, final.parent)}"
    return _broadcast(outcome, group)


def _write_error(e: BaseException, directory: Path, seen: list[OSError] | None = None) -> str:
    """A failed write into ``directory`` as one line: a full disk (or quota) as such, naming the file, else the
    error. ``seen``: OSErrors the writer recorded."""
    full = disk_full(e, directory, seen or ())
    return f"{full}; make room (space, quota or file size limit) and save again" if full else _describe_error(e)


class _Control:
    """Per-model checkpoint bookkeeping: the side process group of async saves and the save in flight."""

    def __init__(self) -> None:
        self.group: dist.ProcessGroup | None = None
        self.pending: CheckpointFuture | None = None


def _control(model: nn.Module) -> _Control:
    ctl = model.__dict__.get("_xpar_checkpoint")
    if ctl is None:
        ctl = _Control()
        model.__dict__["_xpar_checkpoint"] = ctl
    return ctl


def _wait_pending(ctl: _Control) -> None:
    """Wait for the model's async save in flight, if any (raising its error)."""
    if ctl.pending is not None:
        pending, ctl.pending = ctl.pending, None
        pending.result()


class CheckpointFuture:
    """An asynchronous save in flight. Once every rank's data is written, every rank checksums its own files and
    rank 0 commits (rename, then COMPLETE), whether or not anyone waits. ``result()`` waits for the commit and
    returns the checkpoint directory, raising :class:`CheckpointError` (the same on every rank) if any rank
    failed; ``save_checkpoint``/``load_checkpoint`` call it on the previous save of the same model."""

    def __init__(self, tmp: Path, final: Path, keep_last: int | None, group: dist.ProcessGroup | None,
                 written: _RecordingFileSystem) -> None:
        self.path = final
        self._tmp, self._keep_last, self._group, self._written = tmp, keep_last, group, written
        self._finished = threading.Event()
        self._error: str | None = None

    def _on_saved(self, fut) -> None:  # the saving thread, once the DCP save of every rank is done
        error = None
        try:
            fut.result()
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            error = _write_error(e, self.path.parent, self._written.errors)
        try:
            self._error = _finish_save(self._tmp, self.path, self._keep_last, error, self._group,
                                       self._written.checksums)
        except BaseException as e:
            self._error = _describe_error(e)
        finally:
            self._finished.set()

    def done(self) -> bool:
        """Whether this rank's part has finished (rank 0: written and committed)."""
        return self._finished.is_set()

    def result(self, timeout: float | None = None) -> Path:
        """Wait until the checkpoint is committed; return its directory."""
        if not self._finished.wait(timeout):
            raise TimeoutError(f"checkpoint {self.path} not written within {timeout} s")
        if self._error:
            raise CheckpointError(f"saving {self.path} failed:\n{self._error}")
        return self.path


# ---- public API -------------------------------------------------------------------------------------------------
DEFAULT_RENDEZVOUS_TIMEOUT = 600.0


def _nonfinite_message(msd: dict, osd: dict | None) -> str | None:
    """Which of this rank's model / optimizer tensors hold NaN or inf, as one line; None when none does."""
    names = nonfinite_names(msd.items())
    if osd is not None:
        names += nonfinite_names((f"optimizer state {fqn}.{n}", v) for fqn, state in osd["state"].items()
                                 for n, v in state.items())
    if not names:
        return None
    return (f"non-finite values (NaN or inf) in {', '.join(names[:_SHOW])}"
            + (f", … and {len(names) - _SHOW} more" if len(names) > _SHOW else ""))


def save_checkpoint(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    extra_state: Mapping[str, Any] | None = None,
    *,
    step: int | None = None,
    async_save: bool = False,
    keep_last: int | None = None,
    allow_nonfinite: bool = False,
    rendezvous_timeout: float = DEFAULT_RENDEZVOUS_TIMEOUT,
) -> Path | CheckpointFuture:
    """Save ``model`` (and ``optimizer``, the RNG state and the JSON-able ``extra_state``) as the checkpoint
    ``path/step-N`` — DCP at global shapes, loadable on any mesh or world size — atomically: written under a
    temporary name and committed (renamed, then marked COMPLETE with every file's size and CRC-32) only when every
    rank has finished. ``step`` defaults to ``extra_state["step"]``, else one past the newest checkpoint under
    ``path``. ``keep_last=N`` then removes all but the N newest complete checkpoints; every save removes what
    interrupted saves left under ``path`` (``.tmp-…``). Parameters or optimizer states holding NaN or inf are
    refused unless ``allow_nonfinite=True``. With ``async_save=True`` the state is copied and written in the
    background: returns a :class:`CheckpointFuture` (else the checkpoint directory).

    A collective, guarded: before the first collective, each rank waits at most ``rendezvous_timeout`` seconds
    (default 600, below the process group's own timeout; set it above the longest time your ranks can drift
    apart) for the others to call too, then all ranks check that they were given the same optimizer (class or
    none), ``step``, ``async_save``, ``keep_last`` and ``allow_nonfinite`` — a rank that calls alone, or ranks that
    disagree, get a :class:`CheckpointError` instead of a hang (:mod:`xpar_zoo.rendezvous`). ``path`` and
    ``extra_state`` are rank 0's."""
    root = Path(path)
    extra = dict(extra_state or {})
    meet("save_checkpoint", {"optimizer": None if optimizer is None else type(optimizer).__name__,
                             "step": step if step is not None else extra.get("step"), "async_save": bool(async_save),
                             "keep_last": keep_last, "allow_nonfinite": bool(allow_nonfinite)},
         CheckpointError, rendezvous_timeout)
    if keep_last is not None and (not isinstance(keep_last, int) or isinstance(keep_last, bool) or keep_last < 1):
        raise CheckpointError(f"keep_last must be a positive integer or None, got {keep_last!r}")
    ctl = _control(model)
    _wait_pending(ctl)
    rank = _rank()
    msd, osd = _state_dicts(model, optimizer)  # collective

    error = None
    try:  # checks of this rank's values, before anything is written
        extra_json = _to_json(extra, "extra_state")
        if not allow_nonfinite and (bad := _nonfinite_message(msd, osd)):
            raise CheckpointError(f"{bad}; pass allow_nonfinite=True to save them anyway")
    except Exception as e:
        error = _describe_error(e)
    error = _every_error(error)
    if error:
        raise CheckpointError(f"not saving under {root}:\n{error}")

    decision: tuple[str, Any, Any] = ("", None, None)
    if rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            _clear_leftovers(root)
            n = _choose_step(root, step, extra)
            final = root / checkpoint_name(n)
            if final.exists() and _incomplete_reason(final) is None:
                raise CheckpointError(f"checkpoint {final} already exists; pass another step or remove it")
            tmp = root / f"{TMP_PREFIX}{final.name}-{uuid.uuid4().hex[:12]}"
            tmp.mkdir()
            decision = ("ok", n, str(tmp))
        except Exception as e:
            decision = ("error", _write_error(e, root if root.is_dir() else root.parent), None)
    decision = _broadcast(decision)
    if decision[0] == "error":
        raise CheckpointError(decision[1])
    n, tmp = decision[1], Path(decision[2])
    final = root / checkpoint_name(n)
    _reached("begin")

    error = None
    try:
        _save_rng(tmp, rank)
        _reached("rng_written")
        if rank == 0:
            scalars, groups = ({}, None) if osd is None else _split_optimizer(osd)[1:]
            _write_file(tmp / META_FILE, json.dumps(_metadata(model, n, optimizer, scalars, groups),
                                                    indent=1).encode())
            _write_file(tmp / EXTRA_FILE, json.dumps(extra_json, indent=1).encode())
    except Exception as e:
        error = _write_error(e, root)
    error = _every_error(error)
    if error:
        if rank == 0:
            _discard(tmp)
        raise CheckpointError(f"saving {final} failed before writing tensors (nothing was kept):\n{error}")

    writer, written = _writer(tmp)
    state = _dcp_state(msd, osd)
    if async_save:
        if _distributed() and ctl.group is None:
            ctl.group = dist.new_group(backend="gloo")
        handle = CheckpointFuture(tmp, final, keep_last, ctl.group, written)
        with _quiet_single_process():
            fut = dcp.async_save(state, storage_writer=writer, process_group=ctl.group, no_dist=not _distributed())
        fut.add_done_callback(handle._on_saved)
        ctl.pending = handle
        return handle

    error = None
    try:
        with _quiet_single_process():  # returns on every rank once every rank's files are written
            dcp.save(state, storage_writer=writer, no_dist=not _distributed())
        _reached("dcp_written")
    except (Exception, CheckpointException) as e:  # DCP raises the same failure on every rank
        error = _write_error(e, root, written.errors)
    error = _finish_save(tmp, final, keep_last, error, None, written.checksums)
    if error:
        raise CheckpointError(f"saving {final} failed (nothing was kept):\n{error}")
    return final


def verify_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Check every file of a checkpoint directory (or of the newest complete one under a root) against the
    checksums its COMPLETE marker records: ``{"path", "checksum": "crc32" (None when the checkpoint records
    none: saved before checksums were recorded), "files": how many were checked, "problems": one line per damaged
    file}``. Reads every byte."""
    ckpt = _resolve(Path(path))
    record = _complete_record(ckpt)
    sums = record.get("checksums")
    if not isinstance(sums, dict):
        return {"path": str(ckpt), "checksum": None, "files": 0, "problems": []}
    return {"path": str(ckpt), "checksum": record.get("checksum", CHECKSUM), "files": len(sums),
            "problems": verify_files(ckpt, sums, record["files"])}


def _verify_share(ckpt: Path, rank: int, world: int) -> None:
    """Verify this rank's share (every ``world``-th file) of the checkpoint's checksums; raise naming the damage."""
    record = _complete_record(ckpt)
    sums = record.get("checksums")
    if not isinstance(sums, dict):
        return  # saved before checksums were recorded
    names = sorted(sums)[rank::world]
    problems = verify_files(ckpt, {n: sums[n] for n in names}, record["files"])
    if problems:
        raise CheckpointError(f"damaged files: {'; '.join(problems)}; load an earlier checkpoint (`xpar-zoo convert "
                              "inspect --verify ROOT` checks them all)")


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: unreadable ({type(e).__name__}: {e})") from None


def _read_side_files(ckpt: Path, rank: int, restore_rng: bool) -> tuple[dict, dict, dict | None, Metadata]:
    """Everything a load needs besides the tensor data, read and checked before the model is touched:
    ``(xpar_checkpoint.json, extra_state, this rank's RNG state or None, DCP metadata)``."""
    meta = _read_json(ckpt / META_FILE)
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise CheckpointError(f"{ckpt / META_FILE}: unknown checkpoint format {found!r} (expected {FORMAT!r})")
    opt = meta.get("optimizer")
    if opt is not None and not (isinstance(opt, dict) and isinstance(opt.get("param_groups", []), list)
                                and isinstance(opt.get("non_tensor_state", {}), dict)):
        raise CheckpointError(f"{ckpt / META_FILE}: its optimizer record is malformed")
    extra = _from_json(_read_json(ckpt / EXTRA_FILE))
    if not isinstance(extra, dict):
        raise CheckpointError(f"{ckpt / EXTRA_FILE}: not a JSON object (got {type(extra).__name__})")
    rng = _read_rng(ckpt, rank) if restore_rng else None
    return meta, extra, rng, _read_dcp_metadata(_SafeReader(str(ckpt)), ckpt)


def load_checkpoint(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    restore_rng: bool = True,
    verify: bool = True,
    check_finite: bool = False,
    rendezvous_timeout: float = DEFAULT_RENDEZVOUS_TIMEOUT,
) -> dict[str, Any]:
    """Load a checkpoint into ``model`` (and ``optimizer``) on any mesh or world size, or into a plain
    single-process model (no process group needed), and return its ``extra_state``. ``path`` is a checkpoint
    directory or a root, of which the newest complete checkpoint is taken (incomplete ones are reported and
    skipped). Before the model is touched: every file is checked against its recorded checksum (``verify``; the
    ranks share the reading), the side files (metadata, ``extra_state``, RNG) are read and checked, and every
    tensor's name and global shape and the optimizer's parameter groups are checked against the checkpoint — a
    damaged checkpoint, or one of another architecture, shapes or groups, raises :class:`CheckpointError` naming
    them. ``check_finite=True`` then raises naming every loaded tensor that holds NaN or inf. A collective when
    distributed, guarded as :func:`save_checkpoint` is (``rendezvous_timeout``; the ranks must agree on the
    optimizer class, ``restore_rng``, ``verify`` and ``check_finite``)."""
    from .materialize import check_materialized

    check_materialized(model, CheckpointError)  # built on meta: xpar_zoo.materialize(model) first
    meet("load_checkpoint", {"optimizer": None if optimizer is None else type(optimizer).__name__,
                             "restore_rng": bool(restore_rng), "verify": bool(verify),
                             "check_finite": bool(check_finite)}, CheckpointError, rendezvous_timeout)
    _wait_pending(_control(model))
    rank = _rank()
    found: tuple[str, str] = ("", "")
    if rank == 0:
        try:
            found = ("ok", str(_resolve(Path(path))))
        except Exception as e:
            found = ("error", _describe_error(e))
    found = _broadcast(found)
    if found[0] == "error":
        raise CheckpointError(found[1])
    ckpt = Path(found[1])

    error, side = None, None
    try:
        if verify:
            _verify_share(ckpt, rank, dist.get_world_size() if _distributed() else 1)
        side = _read_side_files(ckpt, rank, restore_rng)
    except Exception as e:
        error = _describe_error(e)
    error = _every_error(error)
    if error:
        raise CheckpointError(f"{ckpt} cannot be loaded (nothing was loaded):\n{error}")
    meta, extra, rng, dcp_meta = side
    saved = {k: tuple(v.size) for k, v in dcp_meta.state_dict_metadata.items()
             if isinstance(v, TensorStorageMetadata)}
    msd, osd = _state_dicts(model, optimizer)  # collective; initialises an optimizer that has no state yet
    _check_compatible(ckpt, saved, meta, model, _expected_shapes(msd, osd), optimizer is not None,
                      None if osd is None else osd["param_groups"])

    with _quiet_single_process():
        dcp.load(_dcp_state(msd, osd), storage_reader=_SafeReader(str(ckpt)), planner=_SafeLoadPlanner(),
                 no_dist=not _distributed())
    if osd is None:
        set_model_state_dict(model, msd)
    else:
        saved_opt = meta.get("optimizer") or {}
        osd = {"state": {fqn: dict(state) for fqn, state in osd["state"].items()},
               "param_groups": _from_json(saved_opt.get("param_groups", osd["param_groups"]))}
        for fqn, values in _from_json(saved_opt.get("non_tensor_state", {})).items():
            osd["state"].setdefault(fqn, {}).update(values)
        set_state_dict(model, optimizer, model_state_dict=msd, optim_state_dict=osd)
    if check_finite:
        bad = _every_error(_nonfinite_message(msd, osd))
        if bad:
            raise CheckpointError(f"{ckpt} holds non-finite values (the model now holds them too):\n{bad}")
    if rng is not None:
        _apply_rng(rng)
    return extra
