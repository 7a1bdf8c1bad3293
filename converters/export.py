"""DCP checkpoint → the hub's own format: the original hub key layout (per-expert ``experts.{j}.…`` keys where the
hub has them, via transformers' own ``revert_weight_conversion``), sharded safetensors, ``model.safetensors.index.json``
and ``config.json`` (plus generation / tokenizer files from the source model when given).

Streaming: tensors are read from the checkpoint a shard's worth at a time, reverted tensor by tensor and written as
soon as a shard is full, so peak memory stays near two output shards whatever the model size. Everything is written
into a temporary directory beside the output and moved into place at the end: never a half-written output directory.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import struct
from dataclasses import dataclass, field
from pathlib import Path

import torch

from xpar_zoo.batching import byte_batches
from xpar_zoo.errors import CheckpointError, XparError
from xpar_zoo.loader import build_meta

from .hub_layout import TORCH_TO_SAFETENSORS, revert_groups
from .output_dir import StagingDir, check_apart, check_output

INDEX_FILE = "model.safetensors.index.json"
EXPORT_INFO_FILE = "xpar_export.json"
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


class ExportError(XparError, ValueError):
    """Bad export arguments or output: a dtype or size that does not parse, an output that exists or cannot be
    written, a checkpoint without the config to export it."""


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """``"bf16"``/``"bfloat16"``/``torch.bfloat16`` … → ``torch.dtype``; ``None`` keeps the checkpoint's dtypes."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    key = str(dtype).lower().removeprefix("torch.")
    if key not in DTYPES:
        raise ExportError(f"unknown dtype {dtype!r}; use one of {', '.join(sorted(DTYPES))}")
    return DTYPES[key]


def parse_size(size: str | int, what: str = "shard size") -> int:
    """``"5GB"``, ``"500MB"``, ``"64KiB"`` or an int → bytes; errors name ``what`` (the option it came from)."""
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]I?B|B)?\s*", str(size).upper())
        if not m:
            raise ExportError(f"cannot parse {what} {size!r}; use e.g. 5GB, 500MB, 64KiB or a number of bytes")
        value = int(float(m[1]) * _UNITS[m[2] or ""])
    if value <= 0:
        raise ExportError(f"{what} must be positive, got {size!r}")
    return value


def _config_from(meta: dict, source_dir: Path | None):
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if meta.get("config"):
        config = dict(meta["config"])
        model_type = config.get("model_type") or meta.get("model_type")
        if model_type not in CONFIG_MAPPING:
            raise ExportError(f"the checkpoint's model_type {model_type!r} is unknown to this transformers")
        return CONFIG_MAPPING[model_type].from_dict(config)
    if source_dir is not None:
        return AutoConfig.from_pretrained(source_dir)
    raise ExportError("the checkpoint records no config; pass --model NAME_OR_DIR to take it from the source model")


def _tied_duplicates(model, config) -> set[str]:
    """In-memory names that the hub does not store because they are tied to another tensor."""
    if not getattr(config, "tie_word_embeddings", False):
        return set()
    tied = getattr(model, "all_tied_weights_keys", None) or getattr(model, "_tied_weights_keys", None) or {}
    return set(tied) if isinstance(tied, dict) else set(tied)



@dataclass
class _Shard:
    file: str
    entries: list[tuple[str, tuple[int, ...], torch.dtype]] = field(default_factory=list)
    nbytes: int = 0


def plan_shards(hub_tensors: list[tuple[str, tuple[int, ...], torch.dtype]], max_bytes: int) -> list[_Shard]:
    """Split the hub tensors, in order, into shards of at most ``max_bytes`` (a larger tensor gets its own)."""
    nbytes = {entry: math.prod(entry[1]) * entry[2].itemsize for entry in hub_tensors}
    groups = byte_batches(nbytes.items(), max_bytes)
    return [_Shard(f"model-{i:05d}-of-{len(groups):05d}.safetensors", entries, sum(nbytes[e] for e in entries))
            for i, entries in enumerate(groups, 1)]


class _StreamingShardWriter:
    """Writes planned safetensors shards tensor by tensor: the header (all offsets known from the plan) first, then
    each tensor's bytes as it arrives — no shard is ever held in memory. Checks every tensor against the plan."""

    def __init__(self, directory: Path, shards: list[_Shard]) -> None:
        self.directory = directory
        self.queue = [(shard, entry) for shard in shards for entry in shard.entries]
        self.position = 0
        self.handle = None
        self.current: _Shard | None = None

    def _open(self, shard: _Shard) -> None:
        if self.handle is not None:
            self.handle.close()
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for key, shape, dtype in shard.entries:
            n = math.prod(shape) * dtype.itemsize
            header[key] = {"dtype": TORCH_TO_SAFETENSORS[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
            offset += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # align the data section to 8 bytes, as safetensors does
        self.handle = open(self.directory / shard.file, "wb", buffering=0)  # large writes: no extra copy
        self.handle.write(struct.pack("<Q", len(raw)) + raw)
        self.current = shard

    def write(self, key: str, tensor: torch.Tensor) -> None:
        if self.position >= len(self.queue):
            raise ExportError(f"unexpected extra hub tensor {key!r}")
        shard, (want_key, shape, dtype) = self.queue[self.position]
        if (key, tuple(tensor.shape), tensor.dtype) != (want_key, shape, dtype):
            raise ExportError(f"hub tensor {key} {tuple(tensor.shape)} {tensor.dtype} does not match the planned "
                              f"{want_key} {shape} {dtype}")
        if shard is not self.current:
            self._open(shard)
        data = tensor.detach().contiguous().view(-1).view(torch.uint8).numpy()
        self.handle.write(memoryview(data))
        self.position += 1

    def close(self) -> None:
        if self.handle is not None:
            self.handle.close()
        if self.position != len(self.queue):
            raise ExportError(f"export stopped after {self.position} of {len(self.queue)} hub tensors")


def _revert(meta_model, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The hub tensors of model tensors that revert together (:func:`~.hub_layout.revert_groups`)."""
    from transformers.core_model_loading import revert_weight_conversion

    hub = revert_weight_conversion(meta_model, dict(tensors))
    if sum(t.numel() for t in hub.values()) != sum(t.numel() for t in tensors.values()):
        shapes = ", ".join(f"{n} {tuple(t.shape)}" for n, t in tensors.items())
        raise ExportError(f"reverting {shapes} to hub keys {sorted(hub)} does not preserve their elements; this "
                          "layout needs a converter xpar_zoo does not have")
    return hub


def export_to_hf(
    checkpoint: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    model: str | os.PathLike | None = None,
    dtype: str | torch.dtype | None = None,
    max_shard_size: str | int = "5GB",
    force: bool = False,
    progress: bool = True,
    merge_adapter: bool = False,
) -> Path:
    """Write the model tensors of an xpar_zoo checkpoint (a ``step-N`` directory, or the newest complete one under a
    root) to ``out_dir`` in the hub's own format. ``model`` (hub id or directory) supplies generation / tokenizer
    files (and the config if the checkpoint lacks one); ``dtype`` casts floating tensors. A checkpoint of a PEFT
    model needs ``merge_adapter=True``: its adapter is merged into the weights
    (:class:`xpar_zoo.integrations.peft.AdapterMerge`). Returns ``out_dir``."""
    from tqdm.auto import tqdm

    from xpar_zoo.checkpoint import (iter_model_tensors, model_tensor_specs, read_checkpoint_metadata,
                                     resolve_checkpoint, verify_checkpoint)

    cast = parse_dtype(dtype)
    shard_bytes = parse_size(max_shard_size)
    out_dir = Path(out_dir).expanduser().absolute()
    local_model = [model] if model is not None and Path(model).expanduser().is_dir() else []
    check_output(out_dir, force, ExportError, inputs=[checkpoint, *local_model])
    checkpoint = resolve_checkpoint(checkpoint)  # once: a root that is still being saved into cannot mix steps
    check_apart(out_dir, [checkpoint], ExportError)
    damage = verify_checkpoint(checkpoint)["problems"]
    if damage:
        raise CheckpointError(f"{checkpoint} is damaged, not exported: damaged files: {'; '.join(damage)}")
    meta = read_checkpoint_metadata(checkpoint)
    specs = model_tensor_specs(checkpoint)
    source_dir = None
    if model is not None:
        from xpar_zoo.hub import SIDE_FILES, resolve

        source_dir = resolve(model, weights=False).directory  # its config and side files, not its weights
    config = _config_from(meta, source_dir)
    meta_model = build_meta(config, torch.float32)
    skip = _tied_duplicates(meta_model, config)
    if meta.get("peft") and not merge_adapter:
        raise ExportError(f"{checkpoint} holds a PEFT adapter ({', '.join(meta['peft'])}): pass --merge-adapter for "
                          "merged hub weights, or save the adapter itself with xpar_zoo.save_adapter")
    if merge_adapter and not meta.get("peft"):
        raise ExportError(f"--merge-adapter: {checkpoint} holds no PEFT adapter")
    merge = None
    if merge_adapter:
        from xpar_zoo.integrations.peft import AdapterMerge

        merge = AdapterMerge(config, meta["peft"], specs)
        specs = {name: (shape, dt) for name, shape, dt in merge.outputs}
    groups = revert_groups(meta_model, [n for n in specs if n not in skip])
    names = [n for group in groups for n in group]
    group_of = {n: group for group in groups for n in group}

    # Plan every hub tensor and shard on meta tensors first (no data), then stream the data into place.
    hub_tensors, seen = [], set()
    for group in groups:
        metas = {n: torch.empty(specs[n][0], dtype=specs[n][1], device="meta") for n in group}
        for key, t in _revert(meta_model, metas).items():
            if key in seen:
                raise ExportError(f"two checkpoint tensors revert to the same hub key {key!r}")
            seen.add(key)
            out_dtype = cast if cast is not None and t.is_floating_point() else t.dtype
            hub_tensors.append((key, tuple(t.shape), out_dtype))
    shards = plan_shards(hub_tensors, shard_bytes)
    index = {"metadata": {"total_size": sum(s.nbytes for s in shards)},
             "weight_map": {key: s.file for s in shards for key, _, _ in s.entries}}

    with StagingDir(out_dir, ExportError) as tmp:  # moved into place when complete, removed on any error
        writer = _StreamingShardWriter(tmp, shards)
        with tqdm(total=index["metadata"]["total_size"], unit="B", unit_scale=True, desc="export to hub format",
                  disable=not progress) as bar:  # closed (a line of its own) on errors too
            # Read a quarter shard at a time: memory stays a fraction of a shard above the baseline.
            pending: dict[str, torch.Tensor] = {}  # members of a revert group read so far
            budget = max(1, shard_bytes // 4)
            stream = (merge.merged(iter_model_tensors(checkpoint, merge.reads(names), max_bytes=budget)) if merge
                      else iter_model_tensors(checkpoint, names, max_bytes=budget))
            for name, tensor in stream:
                pending[name] = tensor
                del tensor
                if len(pending) < len(group_of[name]):
                    continue
                for key, value in _revert(meta_model, pending).items():
                    if cast is not None and value.is_floating_point():
                        value = value.to(cast)
                    writer.write(key, value)
                    bar.update(value.numel() * value.element_size())
                pending.clear()
            writer.close()
        (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        if cast is not None:
            config.dtype = cast
        config.save_pretrained(tmp)
        if source_dir is not None:
            for pattern in SIDE_FILES:
                for f in source_dir.glob(pattern):
                    if f.is_file():
                        shutil.copyfile(f, tmp / f.name)
        # No local path: this file is published with the folder (the checkpoint by its name only).
        info = {"source_checkpoint": checkpoint.name, "step": meta.get("step"),
                "model_type": config.model_type, "mesh": meta.get("mesh"), "plans": sorted(meta.get("plans") or {}),
                "xpar_zoo_version": meta.get("xpar_zoo_version"), "dtype": str(cast or "as saved"),
                "base_model": str(model) if model is not None and not local_model else None,
                "merged_adapter": bool(merge)}
        (tmp / EXPORT_INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
    return out_dir


