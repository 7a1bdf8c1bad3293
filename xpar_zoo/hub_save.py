"""``model.save_pretrained(dir)`` on a parallelized model: the hub's own format written from the live shards.

Every rank calls it (it is a collective); rank 0 writes. Tensors are gathered one at a time in the model's order
(``DTensor.full_tensor``), reverted to the hub's key layout with transformers' own ``revert_weight_conversion``
(per-expert ``experts.{j}.…`` keys where the hub has them) and streamed into pre-planned safetensors shards, so memory
stays near the largest tensor plus a fraction of a shard, as ``xpar-zoo convert to-hf`` does. The result loads with
plain ``AutoModelForCausalLM.from_pretrained``. Files are written into a staging directory and moved into place at
the end: a failed save leaves no half-written output (into an existing directory, the new files replace the old
ones and stale weight shards are removed, as transformers does).
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from .errors import ModelStateError
from .materialize import check_materialized

_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _broadcast(obj):
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _is_weight_file(name: str) -> bool:
    return name in _WEIGHT_FILES or (name.startswith("model-") and name.endswith(".safetensors"))


def _move_into(staging: Path, directory: Path) -> None:
    """Move every file of ``staging`` into ``directory`` (weights first, the index last) and remove weight shards
    of an earlier save that the new one does not have; then remove ``staging``."""
    new = sorted(p.name for p in staging.iterdir())
    for name in sorted(new, key=lambda n: n.endswith(".index.json")):
        os.replace(staging / name, directory / name)
    for old in directory.iterdir():
        if old.is_file() and _is_weight_file(old.name) and old.name not in new:
            old.unlink()
    shutil.rmtree(staging, ignore_errors=True)


def save_pretrained(model: nn.Module, save_directory: str | os.PathLike, *, max_shard_size: str | int = "5GB",
                    dtype: str | torch.dtype | None = None, safe_serialization: bool = True,
                    is_main_process: bool = True, state_dict: dict | None = None, push_to_hub: bool = False,
                    progress: bool = True, **kwargs) -> Path:
    """Write a parallelized ``model`` to ``save_directory`` in the hub's own format (config, generation config,
    safetensors shards + index) from its live shards; ``dtype`` casts floating tensors. A collective: every rank
    calls it, rank 0 writes (``is_main_process`` is accepted and ignored). Returns the directory."""
    from tqdm.auto import tqdm

    from .converters.export import (INDEX_FILE, _revert, _StreamingShardWriter, _tied_duplicates, parse_dtype,
                                    parse_size, plan_shards)
    from .converters.hub_layout import revert_groups
    from .loader import build_meta

    if not safe_serialization or push_to_hub or state_dict is not None or kwargs:
        given = sorted(k for k, v in {"safe_serialization=False": not safe_serialization, "push_to_hub": push_to_hub,
                                      "state_dict": state_dict is not None, **{k: True for k in kwargs}}.items() if v)
        raise ModelStateError(f"save_pretrained on a parallelized model writes safetensors from the live shards and "
                              f"does not take {given}; publish with `xpar-zoo publish`")
    check_materialized(model)
    cast, shard_bytes = parse_dtype(dtype), parse_size(max_shard_size)
    config = model.config
    meta_model = build_meta(config, torch.float32)
    live = model.state_dict()  # sharded DTensors at global shapes, HF names, persistent buffers included
    groups = revert_groups(meta_model, [n for n in live if n not in _tied_duplicates(meta_model, config)])
    names = [n for group in groups for n in group]  # the tensors one hub tensor was split into revert together
    group_of = {n: group for group in groups for n in group}

    hub_tensors = []
    for group in groups:
        metas = {n: torch.empty(live[n].shape, dtype=live[n].dtype, device="meta") for n in group}
        for key, t in _revert(meta_model, metas).items():
            hub_tensors.append((key, tuple(t.shape), cast if cast is not None and t.is_floating_point() else t.dtype))
    shards = plan_shards(hub_tensors, shard_bytes)
    index = {"metadata": {"total_size": sum(s.nbytes for s in shards)},
             "weight_map": {key: s.file for s in shards for key, _, _ in s.entries}}

    directory = Path(save_directory).expanduser().absolute()
    rank = _rank()
    error = None
    staging = directory.parent / f".{directory.name}.tmp-{uuid.uuid4().hex[:8]}"
    if rank == 0:
        try:
            staging.mkdir(parents=True)
            writer = _StreamingShardWriter(staging, shards)
        except OSError as e:
            error = f"{type(e).__name__}: {e}"
    bar = tqdm(total=index["metadata"]["total_size"], unit="B", unit_scale=True, desc="save_pretrained",
               disable=not progress or rank != 0)
    pending: dict[str, torch.Tensor] = {}  # members of a revert group gathered so far
    for name in names:
        value = live[name]
        full = value.full_tensor() if isinstance(value, DTensor) else value  # a collective: every rank, same order
        if rank != 0 or error is not None:  # a failed writer keeps gathering, so that no rank is left waiting
            del full
            continue
        pending[name] = full.detach().cpu()
        del full
        if len(pending) < len(group_of[name]):
            continue
        try:
            for key, tensor in _revert(meta_model, pending).items():
                if cast is not None and tensor.is_floating_point():
                    tensor = tensor.to(cast)
                writer.write(key, tensor)
                bar.update(tensor.numel() * tensor.element_size())
        except Exception as e:
            error = f"{name}: {type(e).__name__}: {e}"
        pending.clear()
    bar.close()
    if rank == 0 and error is None:
        try:
            writer.close()
            (staging / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
            out_config = config.__class__.from_dict(config.to_dict())
            if cast is not None:
                out_config.dtype = cast
            out_config.save_pretrained(staging)
            if model.can_generate() and getattr(model, "generation_config", None) is not None:
                model.generation_config.save_pretrained(staging)
            if directory.is_dir():
                _move_into(staging, directory)
            else:
                os.replace(staging, directory)
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
    if rank == 0 and error is not None:
        shutil.rmtree(staging, ignore_errors=True)
    error = _broadcast(error)
    if error:
        raise ModelStateError(f"save_pretrained to {directory} failed (nothing was written): {error}")
    return directory


def install_save_pretrained(model: nn.Module) -> None:
    """Make ``model.save_pretrained(dir, ...)`` :func:`save_pretrained` (the transformers method cannot save
    sharded DTensors)."""
    import functools

    model.save_pretrained = functools.partial(save_pretrained, model)
