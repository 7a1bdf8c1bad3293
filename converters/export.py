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
import shutil
from pathlib import Path

import torch

from xpar_zoo.checkpoint import (
    iter_model_tensors,
    model_tensor_specs,
    read_checkpoint_metadata,
    resolve_checkpoint,
    verify_checkpoint,
)
from xpar_zoo.errors import CheckpointError, ConvertError
from xpar_zoo.hub.resolve import SIDE_FILES, resolve
from xpar_zoo.hub.writer import HubWriter, parse_dtype, parse_size
from xpar_zoo.io.atomic_dir import StagingDir, check_apart, check_output
from xpar_zoo.zoo.configs import read_config_json
from xpar_zoo.zoo.registry import build_meta

EXPORT_INFO_FILE = "xpar_export.json"


def _config_from(meta: dict, source_dir: Path | None):
    from xpar_zoo.zoo.configs import config_from_dict, load_config

    if meta.get("config"):
        config = dict(meta["config"])
        config.setdefault("model_type", meta.get("model_type"))
        return config_from_dict(config, "the checkpoint's config", ConvertError)
    if source_dir is not None:
        return load_config(source_dir, ConvertError)
    raise ConvertError("the checkpoint records no config; pass --model NAME_OR_DIR to take it from the source model")


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
    (:class:`xpar_zoo.hub.adapter_files.AdapterMerge`). Returns ``out_dir``."""
    cast = parse_dtype(dtype)
    shard_bytes = parse_size(max_shard_size)
    out_dir = Path(out_dir).expanduser().absolute()
    local_model = [model] if model is not None and Path(model).expanduser().is_dir() else []
    check_output(out_dir, force, ConvertError, inputs=[checkpoint, *local_model])
    checkpoint = resolve_checkpoint(checkpoint)  # once: a root that is still being saved into cannot mix steps
    check_apart(out_dir, [checkpoint], ConvertError)
    damage = verify_checkpoint(checkpoint)["problems"]
    if damage:
        raise CheckpointError(f"{checkpoint} is damaged, not exported: damaged files: {'; '.join(damage)}")
    meta = read_checkpoint_metadata(checkpoint)
    source_dir = resolve(model, weights=False).directory if model is not None else None  # config, side files
    if source_dir is not None:
        read_config_json(source_dir, ConvertError)  # its custom code (auto_map), checked even where unused
    config = _config_from(meta, source_dir)
    if meta.get("trainable_only"):
        raise ConvertError(f"{checkpoint} holds only the trained parameters (a LoRA run's adapters, not the base): "
                           "export with `xpar-zoo train --export-hf DIR` (merged) or --export-adapter DIR")
    specs = model_tensor_specs(checkpoint)
    if meta.get("peft") and not merge_adapter:
        raise ConvertError(f"{checkpoint} holds a PEFT adapter ({', '.join(meta['peft'])}): pass --merge-adapter for "
                           "merged hub weights, or save the adapter itself with xpar_zoo.save_adapter")
    if merge_adapter and not meta.get("peft"):
        raise ConvertError(f"--merge-adapter: {checkpoint} holds no PEFT adapter")
    merge = None
    if merge_adapter:
        from xpar_zoo.hub.adapter_files import AdapterMerge

        merge = AdapterMerge(config, meta["peft"], specs, where=str(checkpoint))
        specs = {name: (shape, dt) for name, shape, dt in merge.outputs}
    hub = HubWriter(build_meta(config, torch.float32), config, specs, cast=cast, max_shard_bytes=shard_bytes)

    with StagingDir(out_dir, ConvertError) as tmp:  # moved into place when complete, removed on any error
        _write_tensors(hub, tmp, checkpoint, merge, shard_bytes, progress)
        if source_dir is not None:
            _copy_side_files(source_dir, tmp)
        # No local path: this file is published with the folder (the checkpoint by its name only).
        info = {"source_checkpoint": checkpoint.name, "step": meta.get("step"),
                "model_type": config.model_type, "mesh": meta.get("mesh"), "plans": sorted(meta.get("plans") or {}),
                "xpar_zoo_version": meta.get("xpar_zoo_version"), "dtype": str(cast or "as saved"),
                "base_model": str(model) if model is not None and not local_model else None,
                "merged_adapter": bool(merge)}
        (tmp / EXPORT_INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
    return out_dir


def _write_tensors(hub: HubWriter, tmp: Path, checkpoint: Path, merge, shard_bytes: int, progress: bool) -> None:
    """Stream the checkpoint's model tensors (merged with the adapter when ``merge``) into ``hub``'s files in
    ``tmp``."""
    from tqdm.auto import tqdm

    hub.start(tmp)
    try:
        with tqdm(total=hub.total_bytes, unit="B", unit_scale=True, desc="export to hub format",
                  disable=not progress) as bar:  # closed (a line of its own) on errors too
            # A quarter shard read at a time: memory stays a fraction of a shard above the baseline.
            budget = max(1, shard_bytes // 4)
            stream = (merge.merged(iter_model_tensors(checkpoint, merge.reads(hub.names), max_bytes=budget))
                      if merge else iter_model_tensors(checkpoint, hub.names, max_bytes=budget))
            for name, tensor in stream:
                bar.update(hub.add(name, tensor))
                del tensor
        hub.finish()
    finally:
        hub.close()


def _copy_side_files(source_dir: Path, tmp: Path) -> None:
    """The source model's generation and tokenizer files (:data:`SIDE_FILES`) into ``tmp``."""
    for pattern in SIDE_FILES:
        for f in source_dir.glob(pattern):
            if f.is_file():
                shutil.copyfile(f, tmp / f.name)
