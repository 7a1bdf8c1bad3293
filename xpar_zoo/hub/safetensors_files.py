"""Reading a safetensors checkpoint's files without their data: the index, every file's header, checked as
``safe_open`` checks them (dtypes, byte ranges, truncation, overlaps), and the dtype table. The header is parsed by
hand because the loader and ``convert to-dcp`` need each tensor's byte offsets, which ``safe_open`` does not expose;
tensor data itself is always read through ``safe_open`` or into place at those offsets."""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from ..compat import SAFETENSORS_TYPES
from ..errors import CheckpointMismatchError

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# safetensors dtype names -> torch dtypes: safetensors' own table, plus F8_E8M0, which the
# format defines and safetensors 0.8's torch table lacks. The data is little-endian, as torch's everywhere we run.
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {**SAFETENSORS_TYPES, "F8_E8M0": torch.float8_e8m0fnu}
TORCH_TO_SAFETENSORS = {v: k for k, v in SAFETENSORS_DTYPES.items()}
DTYPE_SIZES = {k: v.itemsize for k, v in SAFETENSORS_DTYPES.items()}  # bytes per element
# Bits per element of every dtype the safetensors format defines (sub-byte ones included; torch lacks some).
DTYPE_BITS = {**{k: 8 * n for k, n in DTYPE_SIZES.items()}, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "C64": 64}
_MAX_HEADER = 100 * 1024 * 1024
LIST_LIMIT = 20


@dataclass(frozen=True)
class TensorInfo:
    """One checkpoint tensor as its safetensors header describes it."""

    key: str
    file: str
    shape: tuple[int, ...]
    dtype: str
    offsets: tuple[int, int]  # byte range inside the file's data section

    @property
    def nbytes(self) -> int:
        return self.offsets[1] - self.offsets[0]


def read_header(path: str | Path) -> dict[str, TensorInfo]:
    """The tensors of one ``.safetensors`` file, from its JSON header only, checked as ``safe_open`` checks them:
    every dtype known, every tensor's byte range as long as its shape and dtype need, the ranges contiguous from the
    start of the data section to the end of the file (no gap, no overlap, nothing after)."""
    path = Path(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise CheckpointMismatchError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        (size,) = struct.unpack("<Q", raw)
        if size > _MAX_HEADER:
            raise CheckpointMismatchError(f"{path}: not a safetensors file (header of {size} bytes)")
        file_size = os.fstat(f.fileno()).st_size
        if 8 + size > file_size:
            raise CheckpointMismatchError(f"{path}: truncated safetensors file (header of {size} bytes, file of "
                                          f"{file_size} bytes)")
        try:
            header = json.loads(f.read(size))
            header.pop("__metadata__", None)
            infos = {key: TensorInfo(key, path.name, _ints(entry["shape"]), str(entry["dtype"]),
                                     _ints(entry["data_offsets"], 2)) for key, entry in header.items()}
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointMismatchError(f"{path}: unreadable safetensors header ({type(e).__name__}: {e})") from None
    end = max((i.offsets[1] for i in infos.values()), default=0)
    if 8 + size + end > file_size:
        last = max(infos.values(), key=lambda i: i.offsets[1])
        raise CheckpointMismatchError(f"{path}: truncated safetensors file: its header needs {8 + size + end} bytes "
                                      f"(up to the end of {last.key}), the file has {file_size}")
    _check_offsets(path, infos, file_size - 8 - size)
    return infos


def _ints(values, length: int | None = None) -> tuple[int, ...]:
    """A header's list of non-negative integers (of ``length``) as a tuple; TypeError for anything else."""
    if not isinstance(values, list) or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                                               for v in values) or length not in (None, len(values)):
        raise TypeError(f"{values!r} is not a list of {length or 'some'} non-negative integers")
    return tuple(values)


def _check_offsets(path: Path, infos: Mapping[str, TensorInfo], data_size: int) -> None:
    """Raise :class:`CheckpointMismatchError` unless every tensor's dtype is known, its byte range holds exactly
    its elements, and the ranges tile the ``data_size`` bytes of the data section in order."""
    position, previous = 0, None
    for info in sorted(infos.values(), key=lambda i: tuple(i.offsets)):
        where = f"{path}: tensor {info.key}"
        if info.dtype not in DTYPE_BITS:
            raise CheckpointMismatchError(f"{where} has dtype {info.dtype!r}, which safetensors does not define "
                                          f"(known: {', '.join(DTYPE_BITS)})")
        bits = math.prod(info.shape) * DTYPE_BITS[info.dtype]
        if bits % 8 or info.nbytes != bits // 8:
            raise CheckpointMismatchError(f"{where}: data_offsets {list(info.offsets)} hold {info.nbytes} bytes, its "
                                          f"shape {list(info.shape)} of {info.dtype} needs {bits / 8:g}")
        if info.offsets[0] != position:
            what = "overlaps" if info.offsets[0] < position else "leaves a gap after"
            after = f"the data of {previous.key} (ends at byte {position})" if previous else "the start of the data"
            raise CheckpointMismatchError(f"{where}: data_offsets {list(info.offsets)} {what} {after}: a corrupt or "
                                          "crafted file")
        position, previous = info.offsets[1], info
    if position != data_size:
        raise CheckpointMismatchError(f"{path}: {data_size - position} bytes after the last tensor's data (the header "
                                      f"describes {position} bytes of data, the file holds {data_size})")


def read_weight_map(index_path: str | Path) -> dict[str, str]:
    """The ``weight_map`` of a ``model.safetensors.index.json`` (``{key: file}``); raises
    :class:`CheckpointMismatchError` naming the file when it is not JSON or has no such mapping."""
    index_path = Path(index_path)
    try:
        index = json.loads(index_path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointMismatchError(f"{index_path}: not a valid JSON index ({type(e).__name__}: {e})") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str) and v
                                                   for k, v in weight_map.items()):
        raise CheckpointMismatchError(f"{index_path}: no \"weight_map\" of tensor names to file names")
    bad = sorted({f for f in weight_map.values() if Path(f).is_absolute() or ".." in Path(f).parts})
    if bad:
        raise CheckpointMismatchError(f"{index_path}: lists files outside its directory: {', '.join(bad[:4])}")
    return weight_map


def checkpoint_files(directory: str | Path) -> tuple[list[str], dict[str, str] | None]:
    """The safetensors files of a checkpoint directory (from its index, else the single file) and the index's
    ``weight_map`` (``None`` without an index)."""
    directory = Path(directory)
    index_path = directory / INDEX_FILE
    if index_path.is_file():
        weight_map = read_weight_map(index_path)
        return sorted(set(weight_map.values())), weight_map
    if (directory / SINGLE_FILE).is_file():
        return [SINGLE_FILE], None
    found = sorted(p.name for p in directory.glob("*.safetensors"))
    if not found:
        pickles = sorted(p.name for pat in ("*.bin", "*.pt", "*.pth", "*.ckpt") for p in directory.glob(pat))
        hint = (f"; found only pickle weights {pickles}, which xpar_zoo never unpickles: convert them to safetensors "
                "first (e.g. transformers' save_pretrained(safe_serialization=True) in a trusted process)"
                if pickles else "")
        raise CheckpointMismatchError(f"{directory}: no {INDEX_FILE}, no {SINGLE_FILE} and no *.safetensors file"
                                      + hint)
    if len(found) > 1:
        raise CheckpointMismatchError(f"{directory}: several safetensors files {found} but no {INDEX_FILE}")
    return found, None


def read_checkpoint_headers(directory: str | Path) -> dict[str, TensorInfo]:
    """Every tensor of the checkpoint in ``directory``; checks the index against the file headers."""
    directory = Path(directory)
    files, weight_map = checkpoint_files(directory)
    tensors: dict[str, TensorInfo] = {}
    for name in files:
        if not (directory / name).is_file():
            raise CheckpointMismatchError(f"{directory / INDEX_FILE} lists {name}, which is not in {directory}")
        for key, info in read_header(directory / name).items():
            if key in tensors:
                raise CheckpointMismatchError(f"{key} is in two files: {tensors[key].file} and {name}")
            tensors[key] = info
    if weight_map is not None:
        wrong = [f"{k} (index: {f}, found in: {tensors[k].file if k in tensors else 'no file'})"
                 for k, f in weight_map.items() if k not in tensors or tensors[k].file != f]
        if wrong:
            raise CheckpointMismatchError(f"{INDEX_FILE} disagrees with the file headers: {listing(wrong)}")
    return tensors


def listing(items: Iterable[str]) -> str:
    """Sorted items, one per line, the first ``LIST_LIMIT`` of them and how many more."""
    items = sorted(items)
    more = f" … and {len(items) - LIST_LIMIT} more" if len(items) > LIST_LIMIT else ""
    return "\n  " + "\n  ".join(items[:LIST_LIMIT]) + more
