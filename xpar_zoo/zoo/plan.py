"""Plans as immutable data: which parameters each named extra plan splits on dim 0, how the owning module
computes with its slice (the *style*), which modules are FSDP units, and layout facts for docs and converters.

Patterns are dotted FQNs in which ``*`` matches exactly one segment (``model.layers.*.mlp.experts.down_proj``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from functools import lru_cache
from types import MappingProxyType

from torch import nn

from ..compat import no_split_modules
from ..errors import PlanError

# How a module computes with the dim-0 slice of its planned tensors.
#  experts:   fused experts module; tokens go to the ranks owning their experts (all-to-all), grouped GEMM, back.
#  embedding: vocab-parallel lookup; token ids go to the rank owning their rows and the vectors come back.
#  lm_head:   vocab-parallel logits and cross-entropy; full-vocab logits are never materialised.
#  gathered:  storage-only split; the slice is all-gathered over the plan group for compute (any module).
STYLES = ("experts", "embedding", "lm_head", "gathered")


@dataclass(frozen=True)
class ExtraPlan:
    """One named extra plan: parameter patterns split on dim 0, and the forward style of their modules."""

    params: tuple[str, ...]
    style: str
    dim0: str = ""  # what dim 0 counts, for docs: "experts", "vocab", …

    def __post_init__(self) -> None:
        if isinstance(self.params, str):
            object.__setattr__(self, "params", (self.params,))
        object.__setattr__(self, "params", tuple(self.params))
        if self.style not in STYLES:
            raise PlanError(f"unknown plan style {self.style!r}; styles: {', '.join(STYLES)}")
        if not self.params:
            raise PlanError("an extra plan needs at least one parameter pattern")


def experts(module: str, *params: str) -> ExtraPlan:
    """An expert-parallel plan over the fused experts module at ``module`` (pattern)."""
    params = params or ("gate_up_proj", "down_proj")
    return ExtraPlan(tuple(f"{module}.{p}" for p in params), "experts", "experts")


def fused_expert_layouts(module: str) -> dict[str, str]:
    """The usual fused layouts of an experts module: ``gate_up_proj [E, 2I, H]`` (gate then up) and
    ``down_proj [E, H, I]``."""
    return {f"{module}.gate_up_proj": "[E, 2I, H]", f"{module}.down_proj": "[E, H, I]"}


def is_fused_experts(module: nn.Module) -> bool:
    """Whether ``module`` is a fused experts module: its ``down_proj`` a 3-D parameter (``[E, H, I]``)."""
    return isinstance(down := getattr(module, "down_proj", None), nn.Parameter) and down.dim() == 3


def embedding(param: str = "model.embed_tokens.weight") -> ExtraPlan:
    """A vocab-parallel input embedding plan."""
    return ExtraPlan((param,), "embedding", "vocab")


def lm_head(param: str = "lm_head.weight") -> ExtraPlan:
    """A vocab-parallel output head plan (vocab-parallel cross-entropy)."""
    return ExtraPlan((param,), "lm_head", "vocab")


@dataclass(frozen=True)
class Plan:
    """Everything xpar_zoo needs to know about one architecture, as data."""

    model_type: str
    extra: Mapping[str, ExtraPlan]
    fsdp_units: tuple[str, ...] = ()  # module class names; empty: the model's own ``_no_split_modules``
    layouts: Mapping[str, str] = field(default_factory=dict)  # param pattern -> layout, e.g. "[E, 2I, H]"
    hub_ids: tuple[str, ...] = ()
    notes: str = ""
    auto: bool = False
    tiny: Mapping[str, object] = field(default_factory=dict)  # config overrides of a tiny test model (≥ 8 experts)

    def __post_init__(self) -> None:
        object.__setattr__(self, "extra", MappingProxyType(dict(self.extra)))
        object.__setattr__(self, "layouts", MappingProxyType(dict(self.layouts)))
        object.__setattr__(self, "tiny", MappingProxyType(dict(self.tiny)))
        object.__setattr__(self, "fsdp_units", tuple(self.fsdp_units))
        object.__setattr__(self, "hub_ids", tuple(self.hub_ids))

    def with_extra(self, name: str, extra_plan: ExtraPlan) -> Plan:
        """A new Plan with one more (or a replaced) named extra plan, e.g. a user's ``extra_parallel_1``."""
        if not name.isidentifier():
            raise PlanError(f"plan name {name!r} must be an identifier")
        return replace(self, extra={**self.extra, name: extra_plan})

    def unit_classes(self, model: nn.Module) -> tuple[str, ...]:
        """Class names of the modules that become FSDP units (decoder layers)."""
        return self.fsdp_units or no_split_modules(model)


@lru_cache(maxsize=256)
def _pattern_regex(pattern: str) -> re.Pattern:
    return re.compile("^" + r"[^.]+".join(re.escape(part) for part in pattern.split("*")) + "$")


def matches(pattern: str, fqn: str) -> bool:
    """Whether ``fqn`` matches ``pattern`` (``*`` = one dotted segment)."""
    return _pattern_regex(pattern).match(fqn) is not None


# Adapter wrappers (PEFT's tuner layers: LoRA's ``Linear``, ``ParamWrapper``, …) hold the module they wrap under this
# attribute; a wrapped module, its wrappers and their adapters compute and shard as one planned module.
WRAPPED_ATTR = "base_layer"


def owner_module(model: nn.Module, param_fqn: str) -> str:
    """The FQN of the module that computes with parameter ``param_fqn`` and becomes its planned module: the
    parameter's own module, or the outermost adapter wrapper around it (see :data:`WRAPPED_ATTR`)."""
    parts = param_fqn.split(".")[:-1]
    module = model
    for i, part in enumerate(parts):
        if i and isinstance(getattr(module, WRAPPED_ATTR, None), nn.Module):
            return ".".join(parts[:i])
        module = getattr(module, part)
    return ".".join(parts)


def match_parameters(model: nn.Module, patterns: Iterable[str]) -> list[str]:
    """FQNs of ``model``'s parameters that match any of ``patterns``, in ``named_parameters`` order."""
    patterns = tuple(patterns)
    return [n for n, _ in model.named_parameters(remove_duplicate=False) if any(matches(p, n) for p in patterns)]
