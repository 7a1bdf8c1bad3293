"""PEFT's own adapter files and tensors for parallelized models: :func:`save_adapter` (every rank calls; PEFT's
key names and layouts at global shapes), :func:`attach_adapter` (PEFT applied to a model on meta, with a fresh or a
saved adapter), the adapter configs a checkpoint records, and :class:`AdapterMerge` (the merged hub export)."""

from __future__ import annotations

import copy
import functools
import json
import math
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeGuard, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ..compat import lora_swapped_in_out
from ..errors import AdapterError, ModelStateError
from ..io.atomic_dir import StagingDir
from ..parallel.distributed import broadcast, exact_gathers, rank
from ..parallel.state import local_region
from ..styles.lora import (
    FRESH_INITS,
    adapter_names,
    base_of,
    check_supported,
    get_peft_model,
    is_expert_major,
    param_wrappers,
    relayout,
    require_peft,
    to_expert_major,
    to_peft_layout,
    unwrapped_name,
    uses_peft,
)
from ..zoo.plan import WRAPPED_ATTR
from ..zoo.registry import build_meta

if TYPE_CHECKING:  # PEFT is optional: imported where it runs
    from peft.tuners.lora import LoraLayer, ParamWrapper
    from transformers import PretrainedConfig

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
MAX_RANK = 1 << 16  # a LoRA rank past this is no low-rank adapter of any model xpar_zoo trains
MAX_ALPHA = 1e6


# ---- adapter records: checked before PEFT sees them -------------------------------------------------------------
def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> TypeGuard[float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _names(value) -> bool:
    return value is None or isinstance(value, str) or (isinstance(value, list) and all(isinstance(v, str) for v in value))


def _shown(value) -> str:
    return json.dumps(value, default=str)[:60]


def check_lora_record(values, where: str) -> None:
    """Raise :class:`AdapterError` in one line when a LoRA adapter record (``adapter_config.json``, a checkpoint's
    ``peft`` entry) is not one xpar_zoo can take as it is: another ``peft_type``, a rank ``r`` that is not a whole
    number in [1, 65536], a ``lora_alpha`` (or ``rank_pattern`` / ``alpha_pattern`` value) that is not finite and
    positive, a dropout outside [0, 1), module lists that are not names, flags that are not booleans, custom
    classes (an ``auto_mapping`` outside transformers). ``base_model_name_or_path`` is a name only, never read."""
    if not isinstance(values, dict):
        raise AdapterError(f"{where}: an adapter record is a JSON object, got {type(values).__name__}")
    peft_type = values.get("peft_type")
    if peft_type != "LORA":
        raise AdapterError(f"{where}: peft_type {_shown(peft_type)}; xpar_zoo takes LoRA adapters "
                           "(peft_type 'LORA') only")
    r = values.get("r")
    if not _is_int(r) or not 1 <= r <= MAX_RANK:
        raise AdapterError(f"{where}: r = {_shown(r)}; the LoRA rank is a whole number from 1 to {MAX_RANK}")
    alpha = values.get("lora_alpha")
    if not _is_number(alpha) or not 0 < alpha <= MAX_ALPHA:
        raise AdapterError(f"{where}: lora_alpha = {_shown(alpha)}; it scales the update (lora_alpha / r) and "
                           f"must be a finite number in (0, {MAX_ALPHA:g}]")
    for key, ok, what in (("rank_pattern", lambda v: _is_int(v) and 1 <= v <= MAX_RANK, f"ranks in [1, {MAX_RANK}]"),
                          ("alpha_pattern", lambda v: _is_number(v) and 0 < v <= MAX_ALPHA,
                           f"finite alphas in (0, {MAX_ALPHA:g}]")):
        pattern = values.get(key)
        if pattern is None:
            continue
        if not isinstance(pattern, dict) or not all(isinstance(k, str) and ok(v) for k, v in pattern.items()):
            raise AdapterError(f"{where}: {key} = {json.dumps(pattern, default=str)[:100]}; it maps module names to "
                               f"{what}")
    dropout = values.get("lora_dropout", 0.0)
    if not _is_number(dropout) or not 0 <= dropout < 1:
        raise AdapterError(f"{where}: lora_dropout = {_shown(dropout)}; a probability in [0, 1)")
    for key in ("target_modules", "target_parameters", "exclude_modules", "modules_to_save"):
        if not _names(values.get(key)):
            raise AdapterError(f"{where}: {key} = {json.dumps(values.get(key), default=str)[:100]}; a module name or "
                               "a list of names")
    for key in ("fan_in_fan_out", "use_rslora", "use_dora", "lora_bias", "inference_mode"):
        if key in values and not isinstance(values[key], bool):
            raise AdapterError(f"{where}: {key} = {_shown(values[key])}; true or false")
    if values.get("bias", "none") not in ("none", "all", "lora_only"):
        raise AdapterError(f"{where}: bias = {_shown(values.get('bias'))}; one of 'none', 'all', 'lora_only'")
    mapping = values.get("auto_mapping")
    if mapping and not (isinstance(mapping, dict) and set(mapping) <= {"base_model_class", "parent_library"}
                        and str(mapping.get("parent_library")).startswith("transformers.")
                        and str(mapping.get("base_model_class")).isidentifier()):
        raise AdapterError(f"{where}: auto_mapping names custom model classes ({_shown(mapping)}); xpar_zoo runs no "
                           "code from an adapter and trains transformers' own classes")
    base = values.get("base_model_name_or_path")
    if base is not None and (not isinstance(base, str) or len(base) > 4096 or any(ord(c) < 32 for c in base)):
        raise AdapterError(f"{where}: base_model_name_or_path = {_shown(base)}; a model name or path")


# ---- adapter tensors: names, values -----------------------------------------------------------------------------
def adapter_keys(model: nn.Module) -> dict[str, str]:
    """``{name in model: key in PEFT's adapter file}`` of every adapter tensor, named by PEFT's own
    ``get_peft_model_state_dict``."""
    from peft.utils import get_peft_model_state_dict

    adapter = _the_adapter(model)
    if adapter is None:
        raise AdapterError(f"{type(model).__name__} has no PEFT adapter")
    placeholders = {n: torch.empty(0) for n in model.state_dict(keep_vars=True)}
    by_id = {id(t): n for n, t in placeholders.items()}
    selected = get_peft_model_state_dict(model, state_dict=placeholders, adapter_name=adapter,
                                         save_embedding_layers=False)
    return {by_id[id(t)]: key for key, t in selected.items()}


def _the_adapter(model: nn.Module) -> str | None:
    """The name of ``model``'s one adapter, or None without one (several: ValueError, from the unpacking)."""
    names: list[str | None] = [*adapter_names(model)]
    (adapter,) = names or [None]
    return adapter


def _peft_configs(model: nn.Module) -> dict[str, Any]:
    """``{adapter name: PEFT config}`` of a PEFT model (its ``peft_config``); empty for another model."""
    return getattr(model, "peft_config", None) or {}


def _owner_wrapper(model: nn.Module, name: str) -> ParamWrapper | None:
    """The ``ParamWrapper`` whose factor ``name`` is (``…lora_A.<adapter>.weight``), or None."""
    from peft.tuners.lora import ParamWrapper

    owner = model.get_submodule(name.rsplit(".", 3)[0])
    return owner if isinstance(owner, ParamWrapper) else None


def _adapter_name_of(name: str) -> str:
    return name.rsplit(".", 2)[1]


def fill_adapter(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy into every local shard of ``model``'s adapter tensors its region of ``state`` (``{name in model: full
    tensor in PEFT's layout}``); expert factors are converted to the per-expert layout. Strict: every adapter
    tensor is filled."""

    params = dict(model.named_parameters())
    missing = [n for n in adapter_keys(model) if n not in state]
    if missing:
        raise AdapterError(f"no value for adapter tensor(s) {', '.join(missing[:6])}")
    converted: dict[str, torch.Tensor] = {}
    for name, value in state.items():
        wrapper = _owner_wrapper(model, name)
        if wrapper is not None and is_expert_major(wrapper, _adapter_name_of(name)):
            stem = name.rsplit(".", 3)[0]
            adapter = _adapter_name_of(name)
            a, b = to_expert_major(state[f"{stem}.lora_A.{adapter}.weight"], state[f"{stem}.lora_B.{adapter}.weight"],
                                   wrapper.num_experts)
            value = a if ".lora_A." in name else b
        converted[name] = value
    with torch.no_grad():
        for name, value in converted.items():
            param = params[name]
            if tuple(param.shape) != tuple(value.shape):
                raise AdapterError(f"{name}: adapter value {list(value.shape)}, model {list(param.shape)}")
            local, region = local_region(param)
            local.copy_(value[tuple(slice(a, b) for a, b in region)])


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Rank 0: ``{PEFT file key: full CPU tensor in PEFT's layout}`` of the adapter (expert factors at their global
    shape); other ranks ``{}``. A collective: every rank calls it."""
    keys = adapter_keys(model)
    params = dict(model.named_parameters())
    full = {}
    with exact_gathers():
        for name in params:  # the model's order on every rank: full_tensor is a collective
            if name in keys:
                t = params[name].detach()
                t = t.full_tensor() if isinstance(t, DTensor) else t
                if rank() == 0:
                    full[name] = t.cpu()
    if rank() != 0:
        return {}
    out = {}
    for name, value in full.items():
        wrapper = _owner_wrapper(model, name)
        if wrapper is not None and value.dim() == 3:
            stem, adapter = name.rsplit(".", 3)[0], _adapter_name_of(name)
            a, b = to_peft_layout(full[f"{stem}.lora_A.{adapter}.weight"], full[f"{stem}.lora_B.{adapter}.weight"])
            value = a if ".lora_A." in name else b
        out[keys[name]] = value.contiguous()
    return out


def _check_adapter_output(model: nn.Module, directory: Path, force: bool) -> str | None:
    """Why ``directory`` cannot take the adapter (checked before any gathering), or None: the base model's own
    directory (or inside it, or holding it), a file, an existing non-empty directory without ``force``, an
    unwritable parent."""
    from ..io.atomic_dir import check_apart

    base = getattr(getattr(base_of(model), "config", None), "name_or_path", None)
    recorded = [getattr(c, "base_model_name_or_path", None) for c in _peft_configs(model).values()]
    inputs = [p for p in (base, *recorded) if isinstance(p, str) and p and Path(p).expanduser().is_dir()]
    try:
        check_apart(directory, [Path(p).expanduser() for p in inputs], AdapterError)
    except AdapterError as e:
        return str(e).replace("replacing it with --force", "replacing it with force=True")
    if directory.exists() and not directory.is_dir():
        return f"{directory} exists and is not a directory"
    if directory.is_dir() and any(directory.iterdir()) and not force:
        return (f"{directory} already exists and is not empty; pass force=True to replace its adapter files once "
                "the new ones are complete (the other files stay)")
    parent = next((p for p in directory.parents if p.exists()), None)
    if parent is None or not os.access(parent, os.W_OK | os.X_OK):
        return f"cannot write {directory}: {parent} is not writable"
    return None


def save_adapter(model: nn.Module, directory: str | os.PathLike, *, force: bool = False) -> Path:
    """Write the LoRA adapter of a (parallelized) PEFT model to ``directory`` in PEFT's own format:
    ``adapter_config.json`` and ``adapter_model.safetensors`` with PEFT's key names, expert adapters at their global
    shape in PEFT's layout, so that ``PeftModel.from_pretrained(base_model, directory)`` loads it in one process.
    A collective: every rank calls it, rank 0 writes, into a staging directory moved into place at the end (nothing
    half-written). The output is checked first, before any tensor is gathered: never the base model's directory
    (or inside it); an existing non-empty directory only with ``force``, whose adapter files are then replaced once
    the new ones are complete (its other files stay). Returns the directory."""
    from safetensors.torch import save_file

    adapter, configs = _the_adapter(model), _peft_configs(model)
    if adapter is None or not configs:
        raise AdapterError(f"{type(model).__name__} has no PEFT adapter (peft_config) to save")
    directory = Path(directory).expanduser().absolute()
    refused = broadcast(_check_adapter_output(model, directory, force) if rank() == 0 else None)
    if refused:
        raise AdapterError(refused)
    state = adapter_state(model)
    error = None
    if rank() == 0:
        staging = None
        try:
            directory.parent.mkdir(parents=True, exist_ok=True)
            # into an existing directory file by file, the config last; other files there stay
            staging = StagingDir(directory, AdapterError, merge=lambda name: False,
                                 last=lambda name: name == ADAPTER_CONFIG)
            save_file(state, str(staging.path / ADAPTER_WEIGHTS), metadata={"format": "pt"})
            config = copy.deepcopy(configs[adapter])
            config.inference_mode = True  # as PEFT saves it
            config.save_pretrained(str(staging.path))
            staging.commit()
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
            if staging is not None:
                staging.discard()
    error = broadcast(error)
    if error:
        raise AdapterError(f"saving the adapter to {directory} failed (nothing was replaced): {error}")
    return directory


# ---- attaching to a model built on meta -------------------------------------------------------------------------
def _creation_order(model: nn.Module, adapter: str) -> list[LoraLayer]:
    """The LoRA layers in the order PEFT creates them: ``target_modules`` in module order, then each experts
    module's ``ParamWrapper`` chain from the inside out."""
    from peft.tuners.lora import LoraLayer, ParamWrapper

    layers = [m for m in model.modules() if isinstance(m, LoraLayer) and adapter in m.lora_A]
    dense = [m for m in layers if not isinstance(m, ParamWrapper)]
    inner = {id(getattr(m, WRAPPED_ATTR)) for m in layers if isinstance(m, ParamWrapper)}
    chains: list[LoraLayer] = []
    for m in layers:
        if isinstance(m, ParamWrapper) and id(m) not in inner:  # outermost of its chain
            chain: list[LoraLayer] = []
            while isinstance(m, ParamWrapper):
                chain.append(m)
                m = getattr(m, WRAPPED_ATTR)
            chains += reversed(chain)
    return dense + chains


def _fresh_adapter(peft_model: nn.Module, adapter: str) -> dict[str, torch.Tensor]:
    """Initial values of the adapter of a PEFT model built on meta, on the CPU as ``get_peft_model`` draws them on a
    real model (the same layers in the same order from the same RNG: rank 0's, so that every rank agrees); the
    adapter modules go back to meta."""
    init = _peft_configs(peft_model)[adapter].init_lora_weights
    if init not in FRESH_INITS:
        raise AdapterError(f"init_lora_weights={init!r} reads the base weights, which xpar_zoo loads only after "
                           f"parallelizing: initialise the adapter in one process with PEFT, save it, and pass "
                           f"adapter=PATH (supported here: {', '.join(map(repr, FRESH_INITS))})")
    rng = torch.get_rng_state()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast(rng, src=0)
    with torch.random.fork_rng(devices=[]):
        torch.set_rng_state(rng)
        for layer in _creation_order(peft_model, adapter):
            for lin in (layer.lora_A[adapter], layer.lora_B[adapter]):
                lin.to_empty(device="cpu")
                cast("nn.Linear", lin).reset_parameters()  # PEFT's factors: nn.Linear (or a conv, alike)
            if init:
                layer.reset_lora_parameters(adapter, init)
    names = adapter_keys(peft_model)
    state = {n: p.detach().clone() for n, p in peft_model.named_parameters() if n in names}
    for layer in _creation_order(peft_model, adapter):
        layer.lora_A[adapter].to("meta")
        layer.lora_B[adapter].to("meta")
    return state


def read_adapter(path: str | os.PathLike):
    """``(LoraConfig, {PEFT key: tensor})`` of a PEFT adapter directory (``adapter_config.json`` +
    ``adapter_model.safetensors``; pickle files are refused), the config set trainable."""
    peft = require_peft()
    from safetensors.torch import load_file

    directory = Path(path).expanduser()
    if not (directory / ADAPTER_CONFIG).is_file():
        raise AdapterError(f"{directory}: no {ADAPTER_CONFIG} (not a PEFT adapter directory)")
    if not (directory / ADAPTER_WEIGHTS).is_file():
        found = sorted(p.name for p in directory.glob("adapter_model.*"))
        raise AdapterError(f"{directory}: no {ADAPTER_WEIGHTS}" + (f" (found {', '.join(found)}: xpar_zoo never "
                           "unpickles weights; convert to safetensors in a trusted process)" if found else ""))
    try:
        record = json.loads((directory / ADAPTER_CONFIG).read_bytes())
    except (OSError, ValueError, RecursionError) as e:
        raise AdapterError(f"{directory / ADAPTER_CONFIG}: not a readable JSON file ({type(e).__name__}: "
                           f"{str(e)[:200]})") from None
    check_lora_record(record, str(directory / ADAPTER_CONFIG))
    try:
        config = peft.PeftConfig.from_pretrained(str(directory))
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise AdapterError(f"{directory / ADAPTER_CONFIG}: cannot read the adapter config ({e})") from None
    config.inference_mode = False
    try:
        tensors = load_file(str(directory / ADAPTER_WEIGHTS))
    except Exception as e:  # safetensors raises its own error types
        raise AdapterError(f"{directory / ADAPTER_WEIGHTS}: unreadable safetensors file ({e})") from None
    from ..io.integrity import nonfinite_names

    bad = nonfinite_names(sorted(tensors.items()))
    if bad:
        raise AdapterError(f"{directory / ADAPTER_WEIGHTS}: NaN or infinity in {', '.join(bad[:6])}"
                           + (f" and {len(bad) - 6} more" if len(bad) > 6 else "") + "; the adapter cannot train")
    return config, tensors


def attach_adapter(model: nn.Module, *, peft_config=None, adapter: str | os.PathLike | None = None,
                   name_or_path: str | None = None) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """Apply a LoRA adapter to a transformers model built on meta: a new one from ``peft_config`` or the PEFT
    adapter directory ``adapter`` (trainable). Returns the ``PeftModel`` (still on meta) and ``{name in it: full
    tensor in PEFT's layout}``, its initial adapter values, for :func:`fill_adapter` once parallelized and
    materialized. Every key of an adapter file must fit a tensor of the model, and every tensor must be filled."""
    peft = require_peft()
    if (peft_config is None) == (adapter is None):
        raise AdapterError("give exactly one of peft_config= (a new adapter) and adapter= (a saved one)")
    tensors = None
    if adapter is not None:
        peft_config, tensors = read_adapter(adapter)
    if not isinstance(peft_config, peft.LoraConfig):
        raise AdapterError(f"peft_config must be a peft.LoraConfig, got {type(peft_config).__name__}")
    peft_config = copy.deepcopy(peft_config)
    if name_or_path is not None and not peft_config.base_model_name_or_path:
        peft_config.base_model_name_or_path = name_or_path
    config = cast("PretrainedConfig", model.config)  # a transformers model's (nn.Module types attributes as modules)
    config.name_or_path = name_or_path or config.name_or_path
    try:
        peft_model = get_peft_model(model, peft_config, low_cpu_mem_usage=True)
    except (ValueError, TypeError, KeyError) as e:
        raise AdapterError(f"PEFT could not apply the adapter: {e}") from None
    check_supported(peft_model)
    if tensors is None:
        return peft_model, _fresh_adapter(peft_model, "default")
    assert adapter is not None  # the tensors are its files'
    keys = adapter_keys(peft_model)
    by_key = {k: n for n, k in keys.items()}
    unexpected = sorted(set(tensors) - set(by_key))
    missing = sorted(set(by_key) - set(tensors))
    if unexpected or missing:
        raise AdapterError(f"{Path(adapter) / ADAPTER_WEIGHTS} does not fit the model with its own config: "
                           + "; ".join(f"{what} ({len(ks)}): {', '.join(ks[:6])}" for what, ks in
                                       (("missing", missing), ("unexpected", unexpected)) if ks))
    params = dict(peft_model.named_parameters())
    wrong = [f"{k} {list(t.shape)} vs {list(params[by_key[k]].shape)}" for k, t in tensors.items()
             if tuple(t.shape) != tuple(params[by_key[k]].shape)]
    if wrong:
        raise AdapterError(f"{Path(adapter) / ADAPTER_WEIGHTS}: wrong shapes (file vs model): {'; '.join(wrong[:6])}")
    dtypes = {n: params[n].dtype for n in keys}
    return peft_model, {by_key[k]: t.to(dtypes[by_key[k]]) for k, t in tensors.items()}


# ---- checkpoint metadata ----------------------------------------------------------------------------------------
def config_json(config) -> dict:
    """A PEFT config as JSON data (sets sorted, enums by value): the same on every process."""

    def plain(value):
        if isinstance(value, (set, frozenset)):
            return sorted(value)
        if isinstance(value, dict):
            return {str(k): plain(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        return getattr(value, "value", value)  # enums

    return json.loads(json.dumps(plain(config.to_dict()), default=str))


def config_fingerprint(config) -> str:
    """A short digest of a PEFT config, the same on every process (to compare the ranks' arguments)."""
    import hashlib

    text = json.dumps(config_json(config), sort_keys=True) if hasattr(config, "to_dict") else repr(config)
    return f"{type(config).__name__} {hashlib.sha1(text.encode()).hexdigest()[:12]}"


def adapter_metadata(model: nn.Module) -> dict | None:
    """``{adapter name: PEFT config as JSON data}`` of a model with a PEFT adapter (for checkpoint metadata), or
    None."""
    configs = _peft_configs(model)
    if not configs or not uses_peft(model):
        return None
    return {name: config_json(config) for name, config in configs.items()}


# ---- merged export ----------------------------------------------------------------------------------------------
def _one_lora_record(adapters: dict, where: str):
    """``(adapter name, LoraConfig)`` of the one LoRA record a merge takes, every field checked first."""
    peft = require_peft()
    if not isinstance(adapters, dict) or len(adapters) != 1:
        raise AdapterError(f"{where} holds {len(adapters) if isinstance(adapters, dict) else 'no readable'} "
                           f"adapter records ({', '.join(map(str, adapters))[:200] if adapters else ''}); "
                           "xpar_zoo merges one")
    (adapter, values), = adapters.items()
    if not isinstance(adapter, str) or not adapter or "." in adapter:
        raise AdapterError(f"{where}: adapter name {str(adapter)[:60]!r} is not a module name")
    check_lora_record(values, f"{where}, adapter {adapter!r}")
    try:
        lora = peft.LoraConfig.from_peft_type(**values)
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise AdapterError(f"{where}, adapter {adapter!r}: PEFT refuses the record ({str(e)[:200]})") from None
    if lora.lora_bias or lora.use_dora:
        raise AdapterError("merging lora_bias / DoRA adapters is not supported by xpar_zoo")
    return adapter, lora


def _peft_meta_model(config, lora, adapter: str, where: str) -> nn.Module:
    """The transformers model of ``config`` on meta with the adapter applied by PEFT, fused experts laid out as
    ``parallelize`` lays them."""
    require_peft()
    try:
        model = get_peft_model(build_meta(config, torch.float32), lora, adapter_name=adapter, low_cpu_mem_usage=True)
    except (ValueError, TypeError, KeyError, AttributeError, RuntimeError) as e:
        first = (str(e).splitlines() or [""])[0][:200]
        raise AdapterError(f"{where}, adapter {adapter!r}: PEFT cannot apply the record to the model ({first})"
                           ) from None
    for wrapper in param_wrappers(model).values():
        relayout(wrapper)
    return model


def _check_tensors_fit(state: dict, specs: dict, lora, where: str) -> None:
    """Every tensor the record implies is in the checkpoint at the shape the record gives (a wrong ``r`` would merge
    a wrongly scaled update), and nothing else is."""
    names = set(state)
    if names != set(specs):
        missing, unexpected = sorted(names - set(specs)), sorted(set(specs) - names)
        raise AdapterError("the checkpoint does not fit its own adapter config: " + "; ".join(
            f"{what} ({len(ks)}): {', '.join(ks[:6])}" for what, ks in
            (("missing", missing), ("unexpected", unexpected)) if ks))
    wrong = [f"{n} {list(specs[n][0])}, the record gives {list(state[n].shape)}" for n in sorted(specs)
             if tuple(specs[n][0]) != tuple(state[n].shape)]
    if wrong:
        raise AdapterError(f"{where}: the adapter tensors disagree with the adapter record (r={lora.r}, "
                           f"lora_alpha={lora.lora_alpha}; a merge scales by lora_alpha / r, so a wrong r merges "
                           f"a wrongly scaled update): {'; '.join(wrong[:4])}")


def _deltas(model: nn.Module, adapter: str) -> tuple[dict[str, list[tuple[str, str, float, str]]], set[str]]:
    """``{base tensor: [(A, B, scaling, kind)]}`` of every LoRA layer of ``adapter``, and the adapter tensors' names."""
    from peft.tuners.lora import LoraLayer, ParamWrapper

    fqn_of = {id(m): n for n, m in model.named_modules()}
    deltas: dict[str, list[tuple[str, str, float, str]]] = {}
    adapter_names: set[str] = set()
    for fqn, layer in model.named_modules():
        if not isinstance(layer, LoraLayer) or adapter not in layer.lora_A:
            continue
        a, b = f"{fqn}.lora_A.{adapter}.weight", f"{fqn}.lora_B.{adapter}.weight"
        adapter_names |= {a, b}
        if isinstance(layer, ParamWrapper):
            base = f"{fqn_of[id(layer.get_base_layer())]}.{layer.parameter_name}"
            kind = "experts" if lora_swapped_in_out(layer) else "experts_transposed"
        else:
            base = f"{fqn_of[id(layer.get_base_layer())]}.weight"
            # LoraLayer declares no fan_in_fan_out: its linear layers set it
            kind = "transposed" if getattr(layer, "fan_in_fan_out") else "linear"  # noqa: B009
        deltas.setdefault(base, []).append((a, b, layer.scaling[adapter], kind))
    return deltas, adapter_names


class AdapterMerge:
    """Merged weights from the tensors of a checkpoint of a PEFT model (``xpar-zoo convert to-hf --merge-adapter``):
    every adapted tensor becomes ``W + s·ΔW`` as PEFT's ``merge_and_unload`` computes it (``ΔW = B @ A``, per
    expert for fused experts), under its transformers name; adapter tensors themselves are dropped.

    ``config``: the transformers config; ``adapters``: the checkpoint's ``peft`` metadata (:func:`adapter_metadata`);
    ``specs``: ``{checkpoint name: (shape, dtype)}`` of its model tensors. :attr:`outputs` lists ``(transformers
    name, shape, dtype)`` in order; :meth:`reads` the checkpoint names to stream into :meth:`merged`."""

    def __init__(self, config, adapters: dict, specs: dict[str, tuple[tuple[int, ...], torch.dtype]],
                 where: str = "the checkpoint") -> None:
        adapter, lora = _one_lora_record(adapters, where)
        model = _peft_meta_model(config, lora, adapter, where)
        if not any(n.startswith("base_model.model.") for n in specs):  # saved from the transformers model itself
            model = base_of(model)
        _check_tensors_fit(model.state_dict(), specs, lora, where)
        self._deltas, adapter_names = _deltas(model, adapter)
        prefix = "base_model.model." if any(n.startswith("base_model.model.") for n in specs) else ""
        self._hf_name = {n: unwrapped_name(n).removeprefix(prefix) for n in specs if n not in adapter_names}
        self._source = {hf: n for n, hf in self._hf_name.items()}
        self.outputs = [(self._hf_name[n], specs[n][0], specs[n][1]) for n in specs if n in self._hf_name]

    def reads(self, names: list[str]) -> list[str]:
        """The checkpoint tensors to stream into :meth:`merged` for the transformers tensors ``names``, in order."""
        return [r for hf in names for n in [self._source[hf]]
                for r in [*(x for a, b, _, _ in self._deltas.get(n, ()) for x in (a, b)), n]]

    def merged(self, stream: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """``(transformers name, merged tensor)`` for the ``(checkpoint name, tensor)`` pairs of :meth:`reads`."""
        held: dict[str, torch.Tensor] = {}
        for name, tensor in stream:
            if name not in self._hf_name:
                held[name] = tensor
                continue
            for a, b, scaling, kind in self._deltas.get(name, ()):
                lora_a, lora_b = held.pop(a).float(), held.pop(b).float()
                for factor, value in ((a, lora_a), (b, lora_b)):
                    if not bool(torch.isfinite(value).all()):
                        raise AdapterError(f"adapter tensor {factor} holds NaN or infinity; not merged")
                if kind.startswith("experts"):  # per expert: A [E, in, r]
                    lora_a = lora_a.transpose(-2, -1)
                delta = (lora_b @ lora_a) * scaling
                if kind in ("transposed", "experts_transposed"):
                    delta = delta.transpose(-2, -1)
                tensor = tensor + delta.to(tensor.dtype)
            yield self._hf_name[name], tensor


# ---- save_pretrained of a parallelized PeftModel -------------------------------------------------------
def finish(outer: nn.Module, hf: nn.Module) -> nn.Module:
    """After ``parallelize``: ``save_pretrained`` of a ``PeftModel`` writes its adapter (:func:`save_adapter`), and
    the transformers model inside refuses to save its PEFT-named tensors as a hub checkpoint."""
    def refuse(*args, **kwargs):
        raise ModelStateError("this model carries a PEFT adapter: save the adapter with xpar_zoo.save_adapter (or the "
                              "PeftModel's save_pretrained), or merged hub weights from a checkpoint with "
                              "`xpar-zoo convert to-hf --merge-adapter`")

    # setattr: nn.Module types attributes set with `.` as tensors or modules
    setattr(hf, "save_pretrained", refuse)  # noqa: B010
    if outer is not hf:
        setattr(outer, "save_pretrained", functools.partial(_save_pretrained, outer))  # noqa: B010
    return outer


def _save_pretrained(model: nn.Module, save_directory: str | os.PathLike, *, safe_serialization: bool = True,
                     is_main_process: bool = True, selected_adapters: list[str] | None = None,
                     save_embedding_layers: bool | str = "auto", state_dict: dict | None = None, **kwargs) -> Path:
    """``PeftModel.save_pretrained`` on a parallelized model: :func:`save_adapter` (a collective; rank 0 writes,
    ``is_main_process`` is accepted and ignored). Arguments it cannot honour from the live shards are refused."""
    given = sorted([*kwargs] + [name for name, bad in (("safe_serialization=False", not safe_serialization),
                                                       ("state_dict", state_dict is not None)) if bad])
    adapters = adapter_names(model)
    if selected_adapters not in (None, adapters):
        given.append(f"selected_adapters={selected_adapters}")
    if given:
        raise ModelStateError(f"save_pretrained on a parallelized PEFT model writes its adapter from the live shards "
                              f"(xpar_zoo.save_adapter) and does not take {given}")
    return save_adapter(model, save_directory, force=True)  # PEFT's save_pretrained replaces an adapter
