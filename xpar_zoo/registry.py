"""The zoo's registry: every module in ``xpar_zoo.plans`` that defines ``PLAN`` registers one architecture.

Adding an architecture = adding one file to ``plans/``. The CLI's ``list``, MODEL_CARDS.md and the README table
are generated from here, so documentation cannot drift from code.
"""

from __future__ import annotations

import importlib
import pkgutil
from functools import lru_cache

from .errors import UnknownArchitectureError
from .plan import ExtraPlan, Plan, embedding, lm_head


@lru_cache(maxsize=1)
def _curated() -> dict[str, Plan]:
    from . import plans

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


def derive_plan(model_type: str) -> Plan | None:
    """An automatic plan for a transformers model type with fused experts, derived from transformers' own
    declarations: the config's ``base_model_ep_plan`` (``grouped_gemm`` entries are the expert tensors split on
    dim 0), the causal-LM's ``base_model_prefix``, and the usual ``embed_tokens`` / ``lm_head`` for the vocab plans.
    ``None`` when the type has no causal-LM class or no fused experts."""
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        return None
    config_class = CONFIG_MAPPING[model_type]
    model_class = AutoModelForCausalLM._model_mapping.get(config_class, None)
    ep_plan = getattr(config_class, "base_model_ep_plan", None) or {}
    tensors = [k for k, v in ep_plan.items() if v == "grouped_gemm"]
    if model_class is None or not tensors:
        return None
    prefix = getattr(model_class, "base_model_prefix", "model")
    modules = sorted({t.rpartition(".")[0] for t in tensors})
    extra = {"ep": ExtraPlan(tuple(f"{prefix}.{t}" for t in tensors), "experts", "experts"),
             "emb": embedding(f"{prefix}.embed_tokens.weight"), "head": lm_head()}
    return Plan(model_type=model_type, extra=extra, auto=True,
                notes=f"automatic: derived from {config_class.__name__}.base_model_ep_plan ({', '.join(modules)})")


def supported_architectures() -> list[str]:
    """The ``model_type`` names that have a curated plan, sorted (MoE types without one get an automatic plan from
    :func:`get_plan`)."""
    return sorted(_curated())


def get_plan(model_type: str) -> Plan:
    """The curated :class:`Plan` for ``model_type``, else an automatic one (:func:`derive_plan`); raises an error
    listing the supported types when there is neither."""
    plans = _curated()
    if model_type in plans:
        return plans[model_type]
    plan = derive_plan(model_type)
    if plan is None:
        raise UnknownArchitectureError(
            f"no xpar_zoo plan for model_type {model_type!r} (no curated plan, and transformers declares no fused "
            f"experts for it); curated: {', '.join(sorted(plans))}"
        )
    return plan
