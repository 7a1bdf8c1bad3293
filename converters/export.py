"""DCP checkpoint → the hub's own format: the original hub key layout (per-expert ``experts.{j}.…`` keys where the
hub has them, via transformers' own ``revert_weight_conversion``), sharded safetensors, ``model.safetensors.index.json``
and ``config.json`` (plus generation / tokenizer files from the source model when given).

Streaming: tensors are read from the checkpoint a shard's worth at a time, reverted tensor by tensor and written as
soon as a shard is full, so peak memory stays near two output shards whatever the model size. Everything is written
into a temporary directory beside the output and moved into place at the end: never a half-written output directory.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from pathlib import Path

import torch
from safetensors.torch import save_file

from xpar_zoo.errors import XparError

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


def parse_size(size: str | int) -> int:
    """``"5GB"``, ``"500MB"``, ``"64KiB"`` or an int → bytes."""
    if isinstance(size, int):
        value = size
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]I?B|B)?\s*", str(size).upper())
        if not m:
            raise ExportError(f"cannot parse shard size {size!r}; use e.g. 5GB, 500MB, 64KiB or a number of bytes")
        value = int(float(m[1]) * _UNITS[m[2] or ""])
    if value <= 0:
        raise ExportError(f"shard size must be positive, got {size!r}")
    return value


def _check_output(out_dir: Path, force: bool) -> None:
    if out_dir.exists() and not force:
        raise ExportError(f"{out_dir} already exists; pass --force (force=True) to replace it")
    if out_dir.exists() and not out_dir.is_dir():
        raise ExportError(f"{out_dir} exists and is not a directory")
    parent = out_dir.parent
    if not parent.is_dir():
        raise ExportError(f"cannot write {out_dir}: {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ExportError(f"cannot write {out_dir}: {parent} is not writable")


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


def _meta_model(config):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def _tied_duplicates(model, config) -> set[str]:
    """In-memory names that the hub does not store because they are tied to another tensor."""
    if not getattr(config, "tie_word_embeddings", False):
        return set()
    tied = getattr(model, "all_tied_weights_keys", None) or getattr(model, "_tied_weights_keys", None) or {}
    return set(tied) if isinstance(tied, dict) else set(tied)


class _ShardWriter:
    """Collects hub tensors and writes a safetensors file whenever the next tensor would overflow the shard."""

    def __init__(self, directory: Path, max_bytes: int) -> None:
        self.directory, self.max_bytes = directory, max_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.files: list[tuple[str, list[str]]] = []
        self.total_bytes = 0
        self.seen: set[str] = set()

    def add(self, key: str, tensor: torch.Tensor) -> None:
        if key in self.seen:
            raise ExportError(f"two checkpoint tensors revert to the same hub key {key!r}")
        self.seen.add(key)
        nbytes = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + nbytes > self.max_bytes:
            self.flush()
        self.pending[key] = tensor
        self.pending_bytes += nbytes

    def flush(self) -> None:
        if not self.pending:
            return
        name = f"part-{len(self.files):05d}.safetensors"
        save_file({k: v.contiguous() for k, v in self.pending.items()}, str(self.directory / name),
                  metadata={"format": "pt"})
        self.files.append((name, list(self.pending)))
        self.total_bytes += self.pending_bytes
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> dict:
        """Rename the parts ``model-0000k-of-0000N.safetensors`` and return the index."""
        self.flush()
        n = len(self.files)
        weight_map = {}
        for i, (part, keys) in enumerate(self.files, 1):
            final = f"model-{i:05d}-of-{n:05d}.safetensors"
            (self.directory / part).rename(self.directory / final)
            weight_map.update({k: final for k in keys})
        return {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}


def export_to_hf(
    checkpoint: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    model: str | os.PathLike | None = None,
    dtype: str | torch.dtype | None = None,
    max_shard_size: str | int = "5GB",
    force: bool = False,
    progress: bool = True,
) -> Path:
    """Write the model tensors of an xpar_zoo checkpoint (a ``step-N`` directory, or the newest complete one under a
    root) to ``out_dir`` in the hub's own format. ``model`` (hub id or directory) supplies generation / tokenizer
    files (and the config if the checkpoint lacks one); ``dtype`` casts floating tensors. Returns ``out_dir``."""
    from tqdm.auto import tqdm
    from transformers.core_model_loading import revert_weight_conversion

    from xpar_zoo.checkpoint import iter_model_tensors, model_tensor_specs, read_checkpoint_metadata

    cast = parse_dtype(dtype)
    shard_bytes = parse_size(max_shard_size)
    out_dir = Path(out_dir).expanduser().absolute()
    _check_output(out_dir, force)
    meta = read_checkpoint_metadata(checkpoint)
    specs = model_tensor_specs(checkpoint)
    source_dir = None
    if model is not None:
        from xpar_zoo.hub import SIDE_FILES, resolve

        source_dir = resolve(model).directory
    config = _config_from(meta, source_dir)
    meta_model = _meta_model(config)
    skip = _tied_duplicates(meta_model, config)
    names = [n for n in specs if n not in skip]

    tmp = out_dir.parent / f".{out_dir.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        writer = _ShardWriter(tmp, shard_bytes)
        bar = tqdm(total=sum(torch.Size(specs[n][0]).numel() * specs[n][1].itemsize for n in names), unit="B",
                   unit_scale=True, desc="export to hub format", disable=not progress)
        for name, tensor in iter_model_tensors(checkpoint, names, max_bytes=shard_bytes):
            hub = revert_weight_conversion(meta_model, {name: tensor})
            if sum(t.numel() for t in hub.values()) != tensor.numel():
                raise ExportError(f"reverting {name} {tuple(tensor.shape)} to hub keys {sorted(hub)} does not "
                                  "preserve its elements; this layout needs a converter xpar_zoo does not have")
            for key, value in hub.items():
                if cast is not None and value.is_floating_point():
                    value = value.to(cast)
                writer.add(key, value)
            bar.update(tensor.numel() * tensor.element_size())
        bar.close()
        index = writer.finish()
        (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        if cast is not None:
            config.dtype = cast
        config.save_pretrained(tmp)
        if source_dir is not None:
            for pattern in SIDE_FILES:
                for f in source_dir.glob(pattern):
                    if f.is_file():
                        shutil.copyfile(f, tmp / f.name)
        info = {"source_checkpoint": str(Path(checkpoint).absolute()), "step": meta.get("step"),
                "model_type": config.model_type, "mesh": meta.get("mesh"), "plans": sorted(meta.get("plans") or {}),
                "xpar_zoo_version": meta.get("xpar_zoo_version"), "dtype": str(cast or "as saved"),
                "base_model": str(model) if model is not None else None}
        (tmp / EXPORT_INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
        _move_into_place(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _move_into_place(tmp: Path, out_dir: Path) -> None:
    """Rename ``tmp`` to ``out_dir``; an existing ``out_dir`` (``force``) is renamed aside first, then removed."""
    old = None
    if out_dir.exists():
        old = out_dir.parent / f".{out_dir.name}.deleting-{uuid.uuid4().hex[:8]}"
        out_dir.rename(old)
    tmp.rename(out_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
