"""The model's and the optimizer's state as a checkpoint holds it: sharded DTensors at global shapes under HF
names (``get_state_dict``), optimizer tensors apart from its JSON scalars, the metadata record, and the checks that
a checkpoint fits a model before anything is loaded."""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
)

from ..errors import CheckpointError, counted
from ..io.integrity import nonfinite_names
from ..parallel import distributed
from ..parallel.state import parallel_state
from .dcp_io import MODEL_KEY, NAMES_SHOWN, OPTIM_KEY, listing, plain_name
from .json_state import from_json, to_json
from .layout import FORMAT


def state_options(trainable_only: bool = False) -> StateDictOptions:
    """torch's state-dict options of a checkpoint: every tensor, or (``trainable_only``) the trainable parameters and
    the persistent buffers, the frozen parameters left to the model's own weights."""
    return StateDictOptions(ignore_frozen_params=trainable_only, strict=not trainable_only)


def state_dicts(model: nn.Module, optimizer: torch.optim.Optimizer | None, trainable_only: bool = False):
    """``(model state dict, optimizer state dict or None)``: sharded DTensors at global shapes, HF names
    (``trainable_only``: without the frozen parameters)."""
    options = state_options(trainable_only)
    if optimizer is None:
        return get_model_state_dict(model, options=options), None
    return get_state_dict(model, optimizer, options=options)


def split_optimizer(osd: dict) -> tuple[dict, dict, list]:
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


def dcp_state(msd: dict, osd: dict | None) -> dict:
    """What DCP saves and loads: the model under ``model.``, the optimizer's tensors under ``optim.state.``."""
    state: dict[str, Any] = {MODEL_KEY: msd}
    if osd is not None:
        state[OPTIM_KEY] = {"state": split_optimizer(osd)[0]}
    return state


def expected_shapes(msd: dict, osd: dict | None) -> dict[str, tuple[int, ...]]:
    """``{DCP key: global shape}`` of every tensor the model (and optimizer) will load."""
    out = {f"{MODEL_KEY}.{k}": tuple(v.shape) for k, v in msd.items() if isinstance(v, torch.Tensor)}
    if osd is not None:
        for fqn, state in split_optimizer(osd)[0].items():
            out.update({f"{OPTIM_KEY}.state.{fqn}.{n}": tuple(v.shape) for n, v in state.items()})
    return out


def check_compatible(ckpt: Path, saved: dict[str, tuple[int, ...]], meta: dict, model: nn.Module,
                      expected: dict[str, tuple[int, ...]], with_optimizer: bool,
                      param_groups: list | None = None) -> None:
    """Raise :class:`CheckpointError` naming every mismatch between checkpoint and model, before loading."""
    problems = []
    saved_type = meta.get("model_type")
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if saved_type and model_type and saved_type != model_type:
        problems.append(f"architecture: the checkpoint holds a {saved_type!r} model, this model is {model_type!r}")
    if with_optimizer:
        group_problem = param_group_problem(from_json((meta.get("optimizer") or {}).get("param_groups")),
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
            f"{plain_name(k)} {list(saved[k])} vs {list(expected[k])}" for k in shapes[:NAMES_SHOWN])
            + (f"; … and {len(shapes) - NAMES_SHOWN} more" if len(shapes) > NAMES_SHOWN else ""))
    missing = [k for k in expected if k not in saved]
    if missing:
        problems.append(f"missing from the checkpoint ({len(missing)}): {listing(missing)}")
    scope = (f"{MODEL_KEY}.", f"{OPTIM_KEY}.") if with_optimizer else (f"{MODEL_KEY}.",)
    unexpected = [k for k in saved if k.startswith(scope) and k not in expected]
    if unexpected:
        problems.append(f"not in the model{'/optimizer' if with_optimizer else ''} ({len(unexpected)}): "
                        f"{listing(unexpected)}")
    if problems:
        raise CheckpointError(f"checkpoint {ckpt} does not fit {model_class(model)}:\n  " + "\n  ".join(problems))


def param_group_problem(saved: list | None, current: list) -> str | None:
    """How the optimizer's parameter groups differ from the checkpoint's (count, or the parameters of a group),
    as ``torch.optim.Optimizer.load_state_dict`` refuses them; None when they agree."""
    if saved is None:
        return None
    if len(saved) != len(current):
        return (f"the checkpoint's optimizer has {counted(len(saved), 'parameter group')}, this optimizer has {len(current)}:"
                " build it with the same groups")
    for i, (s, c) in enumerate(zip(saved, current)):
        want, have = list(s.get("params", [])), list(c.get("params", []))
        if set(want) != set(have):
            missing, extra = [p for p in want if p not in have], [p for p in have if p not in want]
            return (f"parameter group {i} holds {len(want)} parameters in the checkpoint, {len(have)} in this "
                    "optimizer" + (f"; only in the checkpoint: {', '.join(missing[:NAMES_SHOWN])}" if missing else "")
                    + (f"; only in this optimizer: {', '.join(extra[:NAMES_SHOWN])}" if extra else ""))
    return None


def model_class(model: nn.Module) -> str:
    """The model's own class name (not FSDP's wrapper class)."""
    from torch.distributed.fsdp import FSDPModule

    cls = next((c for c in type(model).__mro__ if not issubclass(c, FSDPModule)), type(model))
    return cls.__name__


def metadata_record(model: nn.Module, step: int, optimizer, scalars: dict, param_groups: list | None,
                    trainable_only: bool = False) -> dict:
    """The checkpoint's ``xpar_checkpoint.json``: format, step, versions, model class and config, mesh and plans,
    the optimizer's class, parameter groups and scalar state."""
    from ..version import __version__

    try:
        import transformers
        tf_version = transformers.__version__
    except ImportError:  # pragma: no cover
        tf_version = None
    config = getattr(model, "config", None)
    xpar = parallel_state(model)
    plans: dict[str, list[str]] = {}
    if xpar is not None:
        for fqn, name in xpar.planned_params().items():
            plans.setdefault(name, []).append(fqn)
    return {
        "format": FORMAT,
        "step": step,
        "created_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "world_size": distributed.world_size(),
        "xpar_zoo_version": __version__,
        "torch_version": torch.__version__,
        "transformers_version": tf_version,
        "model_class": model_class(model),
        "model_type": getattr(config, "model_type", None),
        "config": json.loads(config.to_json_string(use_diff=False)) if config is not None else None,
        "mesh": xpar.mesh.describe() if xpar is not None else None,
        "plan_model_type": xpar.plan.model_type if xpar is not None else None,
        "plans": plans,
        "peft": _adapter_metadata(model),
        "trainable_only": trainable_only,
        "tensors": "DCP at global shapes; planned tensors hold every expert / vocab row in global order",
        "rng": "per rank: rng/rank-NNNNN.safetensors (torch CPU, CUDA when initialised, Python random)",
        "optimizer": None if optimizer is None else {
            "class": type(optimizer).__name__,
            "param_groups": to_json(param_groups, "optimizer param_groups"),
            "non_tensor_state": to_json(scalars, "optimizer state"),
        },
    }


def _adapter_metadata(model: nn.Module) -> dict | None:
    """The PEFT adapter configs of a model that carries one (``xpar-zoo convert to-hf --merge-adapter`` reads them)."""
    from ..styles.lora import uses_peft

    if not uses_peft(model):
        return None
    from ..hub.adapter_files import adapter_metadata

    return adapter_metadata(model)


def nonfinite_message(msd: dict, osd: dict | None) -> str | None:
    """Which of this rank's model / optimizer tensors hold NaN or inf, as one line; None when none does."""
    names = nonfinite_names(msd.items())
    if osd is not None:
        names += nonfinite_names((f"optimizer state {fqn}.{n}", v) for fqn, state in osd["state"].items()
                                 for n, v in state.items())
    if not names:
        return None
    return (f"non-finite values (NaN or inf) in {', '.join(names[:NAMES_SHOWN])}"
            + (f", … and {len(names) - NAMES_SHOWN} more" if len(names) > NAMES_SHOWN else ""))
