"""``model.save_pretrained(dir)`` on a parallelized model: the hub's own format written from the live shards.

Every rank calls it (a collective); rank 0 writes. Tensors are gathered one at a time in the model's order
(``DTensor.full_tensor``) and streamed into the hub's files by :class:`~xpar_zoo.hub.writer.HubWriter`, as
``xpar-zoo convert to-hf`` does: memory stays near the largest tensor plus a fraction of a shard, and the result loads
with plain ``AutoModelForCausalLM.from_pretrained``. Written into a staging directory and moved into place at the
end (into an existing directory file by file, stale weight shards removed, as transformers does): a failed save
leaves no half-written output.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..errors import ModelStateError
from ..io.atomic_dir import StagingDir
from ..parallel import distributed
from ..parallel.materialize import check_materialized
from .safetensors_files import INDEX_FILE, SINGLE_FILE
from .writer import HubWriter, parse_dtype, parse_size


def _is_weight_file(name: str) -> bool:
    return name in (SINGLE_FILE, INDEX_FILE) or (name.startswith("model-") and name.endswith(".safetensors"))


def save_pretrained(model: nn.Module, save_directory: str | os.PathLike, *, max_shard_size: str | int = "5GB",
                    dtype: str | torch.dtype | None = None, safe_serialization: bool = True,
                    is_main_process: bool = True, state_dict: dict | None = None, push_to_hub: bool = False,
                    progress: bool = True, merge=None, **kwargs) -> Path:
    """Write a parallelized ``model`` to ``save_directory`` in the hub's own format (config, generation config,
    safetensors files + index) from its live shards; ``dtype`` casts floating tensors. A collective: every rank
    calls it, rank 0 writes (``is_main_process`` is accepted and ignored). ``merge``: an
    :class:`~xpar_zoo.hub.adapter_files.AdapterMerge` of the model's live tensors, whose merged weights are
    written instead (a PEFT model). Returns the directory."""
    from ..zoo.registry import build_meta

    if not safe_serialization or push_to_hub or state_dict is not None or kwargs:
        given = sorted(k for k, v in {"safe_serialization=False": not safe_serialization, "push_to_hub": push_to_hub,
                                      "state_dict": state_dict is not None, **{k: True for k in kwargs}}.items() if v)
        raise ModelStateError(f"save_pretrained on a parallelized model writes safetensors from the live shards and "
                              f"does not take {given}; publish with `xpar-zoo publish`")
    check_materialized(model)
    live = model.state_dict()  # sharded DTensors at global shapes, HF names, persistent buffers included
    specs = ({n: (tuple(shape), dt) for n, shape, dt in merge.outputs} if merge is not None
             else {n: (tuple(t.shape), t.dtype) for n, t in live.items()})
    hub = HubWriter(build_meta(model.config, torch.float32), model.config, specs, cast=parse_dtype(dtype),
                    max_shard_bytes=parse_size(max_shard_size))
    directory = Path(save_directory).expanduser().absolute()
    writing = distributed.rank() == 0
    staging, error = _start(hub, directory) if writing else (None, None)
    error = _write_tensors(hub, live, merge, writing, error, progress)
    if writing and staging is not None:
        error = _finish(hub, staging, model, error)
    error = distributed.broadcast(error)
    if error:
        raise ModelStateError(f"save_pretrained to {directory} failed (nothing was written): {error}")
    return directory



def _start(hub: HubWriter, directory: Path) -> tuple[StagingDir | None, str | None]:
    """Rank 0: a staging directory beside ``directory`` with the writer started in it, or the error."""
    try:
        directory.parent.mkdir(parents=True, exist_ok=True)
        staging = StagingDir(directory, ModelStateError, merge=_is_weight_file)
        hub.start(staging.path)
        return staging, None
    except Exception as e:
        return None, distributed.describe_error(e)


def _write_tensors(hub: HubWriter, live: dict, merge, writing: bool, error: str | None, progress: bool) -> str | None:
    """Every rank gathers each tensor in the writer's order (merged under ``merge``); rank 0 writes it. A failed
    writer keeps gathering, so that no rank is left waiting. Returns rank 0's error, if any."""
    from tqdm.auto import tqdm

    def gathered(names):
        for name in names:
            value = live[name]
            yield name, (value.full_tensor() if isinstance(value, DTensor) else value)  # every rank, in order

    with tqdm(total=hub.total_bytes, unit="B", unit_scale=True, desc="save_pretrained",
              disable=not progress or not writing) as bar, distributed.exact_gathers():
        stream = merge.merged(gathered(merge.reads(hub.names))) if merge is not None else gathered(hub.names)
        for name, full in stream:
            if writing and error is None:
                try:
                    bar.update(hub.add(name, full.cpu()))
                except Exception as e:
                    error = f"{name}: {distributed.describe_error(e)}"
            del full
    return error


def _finish(hub: HubWriter, staging: StagingDir, model: nn.Module, error: str | None) -> str | None:
    """Rank 0: the index and generation config written and the directory committed, or everything discarded."""
    try:
        if error is None:
            hub.finish()
            if model.can_generate() and getattr(model, "generation_config", None) is not None:
                model.generation_config.save_pretrained(staging.path)
            staging.commit()
    except Exception as e:
        error = distributed.describe_error(e)
    finally:
        hub.close()
        if error is not None:
            staging.discard()
    return error


def install_save_pretrained(model: nn.Module) -> None:
    """Make ``model.save_pretrained(dir, ...)`` :func:`save_pretrained` (transformers' own cannot save sharded
    DTensors)."""
    model.save_pretrained = functools.partial(save_pretrained, model)
