"""Writing a model in the hub's own format, streamed: shared by ``xpar-zoo convert to-hf`` (from a DCP checkpoint)
and ``save_pretrained`` on a parallelized model (from its live shards).

Every hub tensor and shard is planned first on meta tensors (names, shapes, dtypes: transformers' own
``revert_weight_conversion`` turns fused in-memory tensors back into the hub's keys, per-expert ``experts.{j}.…``
where the hub has them); then the model tensors are fed one at a time, reverted as soon as every tensor they revert
with has arrived, and written straight into their place in the pre-planned safetensors files: no shard is ever held
in memory.
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from ..compat import tied_weights_keys
from ..errors import ConvertError
from ..io.batching import byte_batches
from .layout import renumbered, revert_groups
from .safetensors_files import INDEX_FILE, SINGLE_FILE, TORCH_TO_SAFETENSORS

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
Spec = tuple[tuple[int, ...], torch.dtype]


def dtype_named(name: str) -> torch.dtype | None:
    """The torch dtype a name means (``"bf16"``, ``"bfloat16"``, ``"torch.float64"``, any case), else ``None``: the
    one reading of dtype names, for the exporter, the loader and the training settings."""
    key = str(name).strip().lower().removeprefix("torch.")
    value = DTYPES.get(key, getattr(torch, key, None))
    return value if isinstance(value, torch.dtype) else None


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """``"bf16"``/``"bfloat16"``/``torch.bfloat16`` … → ``torch.dtype``; ``None`` keeps the tensors' own dtypes."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if str(dtype).lower().removeprefix("torch.") not in DTYPES:
        raise ConvertError(f"unknown dtype {dtype!r}; use one of {', '.join(sorted(DTYPES))}")
    return dtype_named(dtype)


def parse_size(size: str | int, what: str = "shard size") -> int:
    """``"5GB"``, ``"500MB"``, ``"64KiB"`` or an int → bytes; errors name ``what`` (the option it came from).
    Ours, not huggingface_hub's ``parse_size_to_int``: that one refuses binary units (KiB, MiB, GiB)."""
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]I?B|B)?\s*", str(size).upper())
        if not m:
            raise ConvertError(f"cannot parse {what} {size!r}; use e.g. 5GB, 500MB, 64KiB or a number of bytes")
        value = int(float(m[1]) * _UNITS[m[2] or ""])
    if value <= 0:
        raise ConvertError(f"{what} must be positive, got {size!r}")
    return value


def tied_duplicates(model: nn.Module, config) -> set[str]:
    """In-memory names that the hub does not store because they are tied to another tensor."""
    if not getattr(config, "tie_word_embeddings", False):
        return set()
    tied = tied_weights_keys(model)
    return set(tied) if isinstance(tied, dict) else set(tied)


def revert_to_hub(meta_model: nn.Module, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The hub tensors of model tensors that revert together (one group of :func:`~.hub_layout.revert_groups`),
    by transformers' own ``revert_weight_conversion``; refused when the elements are not preserved."""
    from transformers.core_model_loading import revert_weight_conversion

    hub = revert_weight_conversion(meta_model, dict(tensors))
    if sum(t.numel() for t in hub.values()) != sum(t.numel() for t in tensors.values()):
        shapes = ", ".join(f"{n} {tuple(t.shape)}" for n, t in tensors.items())
        raise ConvertError(f"reverting {shapes} to hub keys {sorted(hub)} does not preserve their elements; this "
                           "layout needs a converter xpar_zoo does not have")
    return hub


def revert_rows_to_hub(meta_model: nn.Module, name: str, rows: torch.Tensor, start: int) -> dict[str, torch.Tensor]:
    """The hub tensors of rows ``[start, start + len(rows))`` of model tensor ``name`` (experts of a fused tensor
    whose hub keys are per expert), keyed as the whole tensor's revert keys them."""
    hub = revert_to_hub(meta_model, {name: rows})
    return {renumbered(meta_model, key, start): t for key, t in hub.items()}


def rows_revert(meta_model: nn.Module, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> bool:
    """Whether model tensor ``name`` (``shape``) reverts to the hub row by row on dim 0 (:func:`revert_rows_to_hub`:
    a fused experts tensor whose hub keys are per expert): checked on meta tensors against the whole revert."""
    if len(shape) < 2 or shape[0] < 2:
        return False
    whole = revert_to_hub(meta_model, {name: torch.empty(shape, dtype=dtype, device="meta")})
    one = revert_to_hub(meta_model, {name: torch.empty((1, *shape[1:]), dtype=dtype, device="meta")})
    if len(whole) != shape[0] * len(one):
        return False
    keys = {renumbered(meta_model, k, j) for j in range(shape[0]) for k in one}
    return keys == set(whole) and all(
        whole[renumbered(meta_model, k, 0)].shape == t.shape for k, t in one.items())


def shard_files(hub_tensors: list[tuple[str, tuple[int, ...], torch.dtype]], max_bytes: int
                ) -> dict[str, list[tuple[str, tuple[int, ...], torch.dtype]]]:
    """``{file name: its (key, shape, dtype) entries}``: the hub tensors, in order, in files of at most ``max_bytes``
    (a larger tensor gets a file of its own), named as transformers names them (``model.safetensors`` alone).
    Ours, not huggingface_hub's ``split_torch_state_dict_into_shards``: that one files a tensor larger than a shard
    ahead of the shard being filled, out of order, which breaks writing the tensors as they arrive."""
    nbytes = {entry: math.prod(entry[1]) * entry[2].itemsize for entry in hub_tensors}
    groups = byte_batches(nbytes.items(), max_bytes)
    if len(groups) == 1:
        return {SINGLE_FILE: groups[0]}
    return {f"model-{i:05d}-of-{len(groups):05d}.safetensors": entries for i, entries in enumerate(groups, 1)}


class HubWriter:
    """The hub files of a model whose tensors are ``specs`` (``{in-memory name: (shape, dtype)}``), planned on meta
    tensors: :attr:`names` (the order to feed them in), :attr:`total_bytes`. :meth:`start` a directory, :meth:`add`
    every tensor of :attr:`names`, :meth:`finish`."""

    def __init__(self, meta_model: nn.Module, config, specs: Mapping[str, Spec], *, cast: torch.dtype | None = None,
                 max_shard_bytes: int) -> None:
        self.meta_model, self.config, self.cast = meta_model, config, cast
        skip = tied_duplicates(meta_model, config)
        groups = revert_groups(meta_model, [n for n in specs if n not in skip])
        self.names = [n for group in groups for n in group]  # tensors one hub tensor was split into, together
        self._group_of = {n: group for group in groups for n in group}
        hub: dict[str, torch.Tensor] = {}
        for group in groups:
            metas = {n: torch.empty(specs[n][0], dtype=specs[n][1], device="meta") for n in group}
            for key, t in revert_to_hub(meta_model, metas).items():
                if key in hub:
                    raise ConvertError(f"two model tensors revert to the same hub key {key!r}")
                dtype = cast if cast is not None and t.is_floating_point() else t.dtype
                hub[key] = torch.empty(t.shape, dtype=dtype, device="meta")
        self.files = shard_files([(k, tuple(t.shape), t.dtype) for k, t in hub.items()], max_shard_bytes)
        self.sharded = len(self.files) > 1
        self.total_bytes = sum(math.prod(shape) * dtype.itemsize for e in self.files.values() for _, shape, dtype in e)
        self.index = {"metadata": {"total_size": self.total_bytes},
                      "weight_map": {key: f for f, entries in self.files.items() for key, _, _ in entries}}
        self._queue = [(f, entry) for f, entries in self.files.items() for entry in entries]
        self._position, self._handle, self._file, self._pending = 0, None, None, {}

    def start(self, directory: Path) -> None:
        """Write into ``directory`` (existing, empty)."""
        self.directory = directory

    def add(self, name: str, tensor: torch.Tensor) -> int:
        """Feed model tensor ``name`` (in :attr:`names` order); its hub tensors are written as soon as its revert
        group is complete. Returns the bytes written now."""
        self._pending[name] = tensor.detach()
        if len(self._pending) < len(self._group_of[name]):
            return 0
        written = 0
        for key, value in revert_to_hub(self.meta_model, self._pending).items():
            if self.cast is not None and value.is_floating_point():
                value = value.to(self.cast)
            self._write(key, value)
            written += value.numel() * value.element_size()
        self._pending.clear()
        return written

    def finish(self) -> None:
        """Close the last file and write the index (when sharded) and the config (in the cast dtype)."""
        if self._handle is not None:
            self._handle.close()
            self._handle = None
        if self._position != len(self._queue):
            raise ConvertError(f"writing stopped after {self._position} of {len(self._queue)} hub tensors")
        if self.sharded:
            (self.directory / INDEX_FILE).write_text(json.dumps(self.index, indent=2) + "\n")
        config = self.config.__class__.from_dict(self.config.to_dict())
        if self.cast is not None:
            config.dtype = self.cast
        config.save_pretrained(self.directory)

    def close(self) -> None:
        """Release the open file (after an error)."""
        if self._handle is not None:
            self._handle.close()
            self._handle = None

    def _open(self, file: str) -> None:
        self.close()
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for key, shape, dtype in self.files[file]:
            n = math.prod(shape) * dtype.itemsize
            header[key] = {"dtype": TORCH_TO_SAFETENSORS[dtype], "shape": list(shape),
                           "data_offsets": [offset, offset + n]}
            offset += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # align the data section to 8 bytes, as safetensors does
        self._handle = open(self.directory / file, "wb", buffering=0)  # large writes: no extra copy
        self._handle.write(struct.pack("<Q", len(raw)) + raw)
        self._file = file

    def _write(self, key: str, tensor: torch.Tensor) -> None:
        if self._position >= len(self._queue):
            raise ConvertError(f"unexpected extra hub tensor {key!r}")
        file, (want_key, shape, dtype) = self._queue[self._position]
        if (key, tuple(tensor.shape), tensor.dtype) != (want_key, shape, dtype):
            raise ConvertError(f"hub tensor {key} {tuple(tensor.shape)} {tensor.dtype} does not match the planned "
                               f"{want_key} {shape} {dtype}")
        if file != self._file:
            self._open(file)
        data = tensor.contiguous().view(-1).view(torch.uint8).numpy()
        self._handle.write(memoryview(data))
        self._position += 1
