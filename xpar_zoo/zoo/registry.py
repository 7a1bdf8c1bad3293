"""The zoo's registry: curated plans (every module in ``xpar_zoo.plans`` that defines ``PLAN``), refused
architectures with their reasons (``plans/_refused.py``), and the automatic plan of every other transformers type
with fused experts, derived from transformers' own declarations.

Adding an architecture = adding one file to ``plans/`` (or nothing, when the automatic plan is right). The CLI's
``list`` and MODEL_CARDS.md are generated from here, so documentation cannot drift from code.
"""

from __future__ import annotations

import importlib
import pkgutil
from functools import lru_cache
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from ..compat import from_config
from ..errors import RefusedArchitectureError, UnknownArchitectureError
from .plan import ExtraPlan, Plan, embedding, lm_head

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

# transformers' auto mappings that name a trainable language model, in the order a text-only config tries them;
# a composite config (one with a ``text_config``) tries the multimodal ones first.
_LM_MAPPINGS = ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES",
                "MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES")


@lru_cache(maxsize=1)
def curated_plans() -> dict[str, Plan]:
    """``{model_type: PLAN}`` of every plan file in ``plans/`` (cached; treat as read-only)."""
    plans = importlib.import_module("..plans", __package__)  # the top-level plans/ folder, installed as xpar_zoo.plans

    found: dict[str, Plan] = {}
    for info in sorted(pkgutil.iter_modules(plans.__path__), key=lambda i: i.name):
        if info.name.startswith("_"):
            continue
        plan = getattr(importlib.import_module(f"{plans.__name__}.{info.name}"), "PLAN", None)
        if isinstance(plan, Plan):
            if plan.model_type in found:
                raise RuntimeError(f"two plan files declare model_type {plan.model_type!r}")
            found[plan.model_type] = plan
    return found


def refused_architectures() -> dict[str, str]:
    """``{model_type: reason}`` of the transformers types with fused experts that xpar_zoo refuses, sorted."""
    from ..plans._refused import REFUSED

    return dict(sorted(REFUSED.items()))


def model_class(config) -> type[PreTrainedModel]:
    """The transformers class that trains ``config`` as a language model: the config's own architecture
    (``config.architectures[0]``) where transformers has it, else the auto mappings' causal-LM class, or for a
    composite config (vision/audio + text) its image-text-to-text / multimodal-LM class. Raises
    :class:`UnknownArchitectureError` when there is none."""
    import transformers
    from transformers.models.auto import modeling_auto

    names = [n for n in (getattr(config, "architectures", None) or [])[:1]
             if any(n in getattr(modeling_auto, m).values() for m in _LM_MAPPINGS)]
    order = _LM_MAPPINGS[1:] + _LM_MAPPINGS[:1] if "text_config" in getattr(config, "sub_configs", {}) else _LM_MAPPINGS
    names += [getattr(modeling_auto, m).get(config.model_type) for m in order]
    for name in names:
        if name and hasattr(transformers, name):
            return getattr(transformers, name)
    raise UnknownArchitectureError(
        f"transformers has no language-model class for model_type {config.model_type!r} (no causal-LM, "
        "image-text-to-text or multimodal-LM class)")


def build_meta(config, dtype: torch.dtype) -> PreTrainedModel:
    """The transformers language model for ``config`` (:func:`model_class`: the causal LM, or
    the config's own multimodal class) with every parameter and buffer on the meta device."""
    cls = model_class(config)
    try:
        with torch.device("meta"):
            return from_config(cls, config, dtype=dtype)
    except AttributeError as e:  # the config's architectures name a class of another model type
        own = getattr(cls, "config_class", None)
        if own is None or isinstance(config, own):
            raise
        raise UnknownArchitectureError(
            f"the config's architectures name {cls.__name__} (a {getattr(own, 'model_type', own.__name__)!r} model) "
            f"but its model_type is {config.model_type!r} ({e}): fix config.json so that the two agree") from None



def _model_type(model: nn.Module) -> str:
    """The ``model_type`` of a transformers model's config (PEFT's wrappers forward the lookup to their model)."""
    return cast("PretrainedConfig", model.config).model_type  # nn.Module types attributes as tensors or modules


def derive_plan(model: nn.Module) -> Plan | None:
    """The automatic plan of a transformers model, from transformers' own declarations on the instance: its resolved
    ``ep_plan`` (``grouped_gemm`` entries are the fused expert tensors, split on dim 0 by ``ep``; a multimodal
    model's carries the language model's prefix), and its input / output embeddings (``emb`` / ``head``).
    ``None`` when the model declares no fused experts."""
    tensors = [k for k, v in (getattr(model, "ep_plan", None) or {}).items() if v == "grouped_gemm"]
    if not tensors:
        return None
    names = {id(m): n for n, m in model.named_modules()}
    extra = {"ep": ExtraPlan(tuple(tensors), "experts", "experts")}
    for plan_name, getter, kind, make in (("emb", "get_input_embeddings", nn.Embedding, embedding),
                                          ("head", "get_output_embeddings", nn.Linear, lm_head)):
        try:
            module = getattr(model, getter)()
        except (NotImplementedError, AttributeError):
            module = None
        if isinstance(module, kind) and id(module) in names:
            extra[plan_name] = make(f"{names[id(module)]}.weight")
    modules = sorted({t.rpartition(".")[0] for t in tensors})
    return Plan(model_type=_model_type(model), extra=extra, auto=True,
                notes=f"automatic: derived from {type(model).__name__}.ep_plan ({', '.join(modules)})")


def _static_plan(model_type: str) -> Plan | None:
    """The automatic plan of a text-only causal LM from its classes alone (the config class's
    ``base_model_ep_plan`` under the causal LM's ``base_model_prefix``): for types whose default config transformers
    cannot build."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    config_class = CONFIG_MAPPING[model_type]
    # transformers types the auto mappings' values as its tokenizer pairs; a model mapping's are model classes
    model_cls = cast("type[PreTrainedModel] | None", MODEL_FOR_CAUSAL_LM_MAPPING.get(config_class, None))
    tensors = [k for k, v in (getattr(config_class, "base_model_ep_plan", None) or {}).items() if v == "grouped_gemm"]
    if model_cls is None or not tensors or getattr(config_class, "sub_configs", {}):
        return None
    prefix = model_cls.base_model_prefix
    modules = sorted({t.rpartition(".")[0] for t in tensors})
    extra = {"ep": ExtraPlan(tuple(f"{prefix}.{t}" for t in tensors), "experts", "experts"),
             "emb": embedding(f"{prefix}.embed_tokens.weight"), "head": lm_head()}
    return Plan(model_type=model_type, extra=extra, auto=True,
                notes=f"automatic: derived from {config_class.__name__}.base_model_ep_plan ({', '.join(modules)})")


@lru_cache(maxsize=None)
def _default_plan(model_type: str) -> Plan | None:
    from transformers import AutoConfig

    try:
        config = AutoConfig.for_model(model_type)
        with torch.device("meta"):
            model = from_config(model_class(config), config)
    except Exception:  # transformers cannot build this type's default config (e.g. a field left None)
        return _static_plan(model_type)
    return derive_plan(model)


def supported_architectures() -> list[str]:
    """The ``model_type`` names that have a curated plan, sorted (MoE types without one get an automatic plan from
    :func:`get_plan`; MODEL_CARDS.md lists those proved)."""
    return sorted(curated_plans())


def _unknown(model_type: str) -> UnknownArchitectureError:
    return UnknownArchitectureError(
        f"no xpar_zoo plan for model_type {model_type!r} (no curated plan, and transformers declares no fused "
        f"experts for it); curated: {', '.join(sorted(curated_plans()))}"
    )


def check_supported(model_type: str) -> None:
    """Raise :class:`RefusedArchitectureError` with the reason when xpar_zoo refuses ``model_type``."""
    reason = refused_architectures().get(model_type)
    if reason is not None:
        raise RefusedArchitectureError(f"xpar_zoo refuses model_type {model_type!r}: {reason}")


def get_plan(model_type: str, config=None) -> Plan:
    """The curated :class:`Plan` for ``model_type``, else its automatic plan (:func:`derive_plan`, on a meta-device
    instance of ``config``, default: transformers' default config of the type). Raises
    :class:`RefusedArchitectureError` with the reason for a refused type, :class:`UnknownArchitectureError` listing
    the curated types when there is no plan."""
    plans = curated_plans()
    if model_type in plans:
        return plans[model_type]
    check_supported(model_type)
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        raise _unknown(model_type)
    if config is None:
        plan = _default_plan(model_type)
    else:
        with torch.device("meta"):
            plan = derive_plan(from_config(model_class(config), config))
    if plan is None:
        raise _unknown(model_type)
    return plan


def plan_for(model: nn.Module) -> Plan:
    """The plan ``parallelize`` applies to ``model`` by default: the curated plan of its ``model_type``, else its
    automatic plan (:func:`derive_plan` on the model itself); refused and unknown types raise as in
    :func:`get_plan`."""
    model_type = _model_type(model)
    plans = curated_plans()
    if model_type in plans:
        return plans[model_type]
    check_supported(model_type)
    plan = derive_plan(model)
    if plan is None:
        raise _unknown(model_type)
    return plan
