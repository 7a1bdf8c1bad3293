"""PEFT LoRA on parallelized models: adapters on dense linears (``target_modules``) and on fused experts
(``target_parameters``), with a frozen base loaded shard-on-read, and PEFT's own adapter files.

- :func:`~xpar_zoo.hub.adapter_files.attach_adapter` applies PEFT to the meta model inside
  ``xpar_zoo.from_pretrained(peft_config=…, adapter=…)``; or call ``peft.get_peft_model`` on a model built on meta
  and give it to :func:`xpar_zoo.parallelize`.
- Expert adapters run inside the EP dispatch (:func:`xpar_zoo.styles.experts.install_expert_adapter`), stored expert-major
  (:func:`to_expert_major`) so the plan splits them with their experts.
- :func:`~xpar_zoo.hub.adapter_files.save_adapter` and ``adapter=`` use PEFT's own files, at global shapes
  (:mod:`xpar_zoo.hub.adapter_files`).

What is refused with an :class:`~xpar_zoo.errors.AdapterError` before any work, and why: ``docs/fine-tuning.md``
and ``docs/design.md``, "Integrations".
"""

from __future__ import annotations

import re
import types

import torch
from torch import nn

from ..compat import can_set_experts_implementation
from ..errors import AdapterError, ModelStateError
from ..parallel.collectives import to_local
from ..zoo.plan import WRAPPED_ATTR, ExtraPlan, Plan, match_parameters, matches

# Initialisations that need no base weights (PEFT's own reset_lora_parameters); the others read the base.
FRESH_INITS = (True, False, "gaussian")


def require_peft():
    try:
        import peft
    except ImportError:
        raise AdapterError("PEFT is not installed: pip install 'xpar_zoo[peft]'") from None
    return peft


def get_peft_model(model: nn.Module, config, **kwargs) -> nn.Module:
    """``peft.get_peft_model`` (errors as PEFT raises them) without transformers' ``is_gradient_checkpointing is
    deprecated`` warning, which PEFT's own constructor triggers by reading that property (no setting of ours can
    avoid it); ``model.name_or_path`` is the config's, so PEFT does not warn that the adapter's base was renamed."""
    import warnings

    model.name_or_path = getattr(model.config, "name_or_path", None) or getattr(model, "name_or_path", None)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`is_gradient_checkpointing` is deprecated",
                                category=FutureWarning)
        return require_peft().get_peft_model(model, config, **kwargs)


def uses_peft(model: nn.Module) -> bool:
    """Whether ``model`` is a PEFT model or holds PEFT tuner layers (PEFT is imported only then)."""
    return any(type(m).__module__.startswith("peft.") for m in model.modules())


def base_of(model: nn.Module) -> nn.Module:
    """The transformers model inside a ``PeftModel`` (``model`` itself otherwise)."""
    peft = require_peft()
    return model.get_base_model() if isinstance(model, peft.PeftModel) else model


def param_wrappers(model: nn.Module) -> dict[str, nn.Module]:
    from peft.tuners.lora import ParamWrapper

    return {n: m for n, m in model.named_modules() if isinstance(m, ParamWrapper)}


def unwrapped_name(fqn: str) -> str:
    """``fqn`` without the ``base_layer`` segments of adapter wrappers: the name transformers gives the tensor."""
    return re.sub(rf"(?:\.{WRAPPED_ATTR})+(?=\.)", "", fqn)


# ---- the per-expert layout of expert adapters ---------------------------------------------------------------------
def to_expert_major(lora_a: torch.Tensor, lora_b: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """PEFT's expert factors ``lora_A [r·E, in]`` (expert-major rows) and ``lora_B [out, r·E]`` (column ``i·E + e``
    is rank ``i`` of expert ``e``) → ``[E, in, r]`` and ``[E, out, r]``, so that expert ``e``'s update is
    ``B[e] @ A[e]ᵀ`` in PEFT's ``(out, in)`` orientation."""
    rank = lora_a.shape[0] // experts
    a = lora_a.reshape(experts, rank, lora_a.shape[1]).transpose(1, 2).contiguous()
    b = lora_b.reshape(lora_b.shape[0], rank, experts).permute(2, 0, 1).contiguous()
    return a, b


def to_peft_layout(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of :func:`to_expert_major`: ``[E, in, r]``, ``[E, out, r]`` → PEFT's ``[r·E, in]``,
    ``[out, r·E]``."""
    experts, _, rank = a.shape
    return a.transpose(1, 2).reshape(experts * rank, -1), b.permute(1, 2, 0).reshape(b.shape[1], rank * experts)


def is_expert_major(wrapper: nn.Module, adapter: str) -> bool:
    return wrapper.lora_A[adapter].weight.dim() == 3


def relayout(wrapper: nn.Module) -> None:
    """Store a ``ParamWrapper``'s factors per expert (meta or real tensors)."""
    for name in list(wrapper.lora_A):
        if is_expert_major(wrapper, name):
            continue
        lin_a, lin_b = wrapper.lora_A[name], wrapper.lora_B[name]
        a, b = to_expert_major(lin_a.weight.detach(), lin_b.weight.detach(), wrapper.num_experts)
        lin_a.weight = nn.Parameter(a, requires_grad=lin_a.weight.requires_grad)
        lin_b.weight = nn.Parameter(b, requires_grad=lin_b.weight.requires_grad)


# ---- the forward ------------------------------------------------------------------------------------------------
def _expert_lora(wrapper: nn.Module):
    """The :data:`xpar_zoo.styles.experts.ExpertAdapter` of one ``ParamWrapper``: ``Σ s·(x A_eᵀ) B_eᵀ`` over its active
    adapters, in the rows' dtype (as PEFT folds the factors in the weight's), or ``None`` while disabled."""
    from .experts import grouped_linear

    def adapter(x: torch.Tensor, counts: torch.Tensor, first: int, num: int) -> torch.Tensor | None:
        if wrapper.disable_adapters:
            return None
        out = None
        for name in wrapper.active_adapters:
            if name not in wrapper.lora_A:
                continue
            a, b = to_local(wrapper.lora_A[name].weight), to_local(wrapper.lora_B[name].weight)
            if a.shape[0] != num:  # not EP-sharded: every expert is local
                a, b = a[first:first + num], b[first:first + num]
            delta = grouped_linear(grouped_linear(x, a.to(x.dtype), counts, transposed=True), b.to(x.dtype), counts)
            delta = delta * wrapper.scaling[name]
            out = delta if out is None else out + delta
        return out

    return adapter


def _wrapper_forward(self: nn.Module, *args, **kwargs):
    """A ``ParamWrapper``'s forward under xpar_zoo: the experts module itself, whose experts path adds the
    adapters (PEFT's parametrization would mix the sharded weight with plain factors)."""
    if self.merged:
        raise ModelStateError(f"{type(self).__name__} {self.parameter_name!r}: merged adapters do not run on a "
                              "parallelized model; export merged weights with `xpar-zoo convert to-hf --merge-adapter`")
    return self.get_base_layer()(*args, **kwargs)


# ---- checks -----------------------------------------------------------------------------------------------------
def adapter_names(model: nn.Module) -> list[str]:
    config = getattr(model, "peft_config", None)
    if config:
        return list(config)
    from peft.tuners.lora import LoraLayer

    return sorted({a for m in model.modules() if isinstance(m, LoraLayer) for a in m.lora_A})


def check_supported(model: nn.Module) -> None:
    """Raise :class:`AdapterError` for any adapter xpar_zoo does not run exactly (see the module docstring)."""
    peft = require_peft()
    from peft.tuners.lora import LoraLayer, ParamWrapper
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper

    configs = getattr(model, "peft_config", None) or {}
    for name, config in configs.items():
        if config.peft_type != peft.PeftType.LORA:
            raise AdapterError(f"adapter {name!r} is {config.peft_type.value}; xpar_zoo trains LoRA (LoraConfig)")
    names = adapter_names(model)
    if len(names) > 1:
        raise AdapterError(f"the model has {len(names)} adapters ({', '.join(names)}); xpar_zoo trains one at a time")
    hf = base_of(model)
    edges = set()
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        try:
            edge = getattr(hf, getter, lambda: None)()
        except (NotImplementedError, AttributeError):  # models without one
            edge = None
        if isinstance(edge, nn.Module):
            edges.add(id(edge))
    for fqn, module in hf.named_modules():
        if isinstance(module, AuxiliaryTrainingWrapper):
            raise AdapterError(f"{fqn}: modules_to_save / trainable_token_indices are not supported by xpar_zoo; "
                               "train adapters only")
        if isinstance(module, BaseTunerLayer) and not isinstance(module, LoraLayer):
            raise AdapterError(f"{fqn}: {type(module).__name__} is not a LoRA layer; xpar_zoo trains LoRA")
        if not isinstance(module, LoraLayer):
            continue
        if id(module) in edges or id(module.get_base_layer()) in edges:
            raise AdapterError(f"{fqn}: LoRA on the input embedding or the output head is not supported (their "
                               "vocab-parallel and fused-loss forwards read the weight itself); target other modules")
        if any(module.use_dora.values()):
            raise AdapterError(f"{fqn}: DoRA (use_dora=True) is not supported by xpar_zoo")
        if isinstance(module, ParamWrapper):
            base = module.get_base_layer()
            param = getattr(base, module.parameter_name)
            if param.dim() != 3 or not hasattr(base, "has_gate") or module.parameter_name not in (
                    "gate_up_proj", "up_proj", "down_proj"):
                raise AdapterError(
                    f"{fqn}: target_parameters {module.parameter_name!r} of {type(base).__name__} "
                    f"({list(param.shape)}); xpar_zoo runs LoRA on the fused expert weights (gate_up_proj, up_proj, "
                    "down_proj) of experts modules that use transformers' ExpertsInterface only"
                    + ("; PEFT's target_modules='all-linear' adds MoE routers' weights: list the modules instead"
                       if module.parameter_name == "weight" else ""))
            inner = [f"{fqn}.{n}" for n, _ in base.named_parameters() if "." in n]
            if inner:
                raise AdapterError(f"{fqn}: LoRA on experts that hold weights of their own inside them ({inner[0]}) is "
                                   "not supported by xpar_zoo")
    wrappers = param_wrappers(hf)
    if wrappers and not can_set_experts_implementation(hf):
        raise AdapterError(f"{type(hf).__name__} cannot set its experts implementation, so xpar_zoo cannot run "
                           f"LoRA on its experts ({', '.join(list(wrappers)[:3])})")


# ---- parallelize ------------------------------------------------------------------------------------------------
def _generalised(fqns: list[str]) -> tuple[str, ...]:
    """Patterns for exactly ``fqns``: layer indices as ``*`` where that still matches nothing else."""
    return tuple(dict.fromkeys(re.sub(r"(?<=\.)\d+(?=\.)", "*", f) for f in fqns))


def adapter_plan(model: nn.Module, plan: Plan) -> Plan:
    """``plan`` for a transformers model with PEFT layers (after :func:`prepare`): each experts plan splits its
    wrapped experts' tensors under their PEFT names together with their adapters' factors; a plan of another style
    whose tensors an adapter wraps is refused."""
    params = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    wrappers = param_wrappers(model)
    extra = {}
    for name, ep in plan.extra.items():
        base = [f for f in params if f != unwrapped_name(f) and any(matches(p, unwrapped_name(f)) for p in ep.params)]
        if not base:
            extra[name] = ep
            continue
        if ep.style != "experts":
            raise AdapterError(f"plan {name!r} ({ep.style}) splits {unwrapped_name(base[0])}, which a LoRA adapter "
                               "wraps; xpar_zoo runs adapters on dense and experts modules only")
        planned = [f for f in params if any(matches(p, unwrapped_name(f)) for p in ep.params)]
        for wfqn, wrapper in wrappers.items():
            inside = [f for f in planned if f.startswith(wfqn + ".")]
            if inside:
                planned += [f"{wfqn}.{lin}.{a}.weight" for a in wrapper.lora_A for lin in ("lora_A", "lora_B")]
        literal = tuple(dict.fromkeys(planned))
        patterns = _generalised(list(literal))
        if sorted(match_parameters(model, patterns)) != sorted(literal):
            patterns = literal
        extra[name] = ExtraPlan(patterns, ep.style, ep.dim0)
    return Plan(plan.model_type, extra, plan.fsdp_units, plan.layouts, plan.hub_ids, plan.notes, plan.auto, plan.tiny)


def prepare(model: nn.Module, plan: Plan) -> tuple[nn.Module, Plan]:
    """Make a model with PEFT layers ready for the core of ``parallelize``: checks (:func:`check_supported`), expert
    adapters stored per expert and run inside the experts path, the plan matched to PEFT's names
    (:func:`adapter_plan`). Returns the transformers model to parallelize and its plan."""
    from .experts import install_expert_adapter

    check_supported(model)
    hf = base_of(model)
    for wrapper in param_wrappers(hf).values():
        relayout(wrapper)
        wrapper.forward = types.MethodType(_wrapper_forward, wrapper)
        install_expert_adapter(wrapper.get_base_layer(), wrapper.parameter_name, _expert_lora(wrapper))
    return hf, adapter_plan(hf, plan)


def expert_parameters(plan: Plan) -> list[str]:
    """LoRA ``target_parameters`` for every fused expert tensor of ``plan``'s experts plans (e.g.
    ``mlp.experts.gate_up_proj``, ``mlp.experts.down_proj``)."""
    return sorted({p.rpartition("*.")[2] for ep in plan.extra.values() if ep.style == "experts" for p in ep.params})


# ---- the sizer's model ----------------------------------------------------------------------------------------
def lora_meta_model(model: nn.Module, plan: Plan, rank: int, modules: list[str] | str | None = None,
                    parameters: list[str] | None = None) -> tuple[nn.Module, Plan]:
    """A transformers model built on meta with LoRA of ``rank`` on ``modules`` (default: every linear but the head)
    and the fused expert tensors ``parameters`` (default: those of ``plan``'s experts plans), prepared as
    ``parallelize`` prepares it; and its plan. What ``xpar-zoo size --lora-rank`` sizes."""
    peft = require_peft()
    if not isinstance(rank, int) or rank < 1:
        raise AdapterError(f"the LoRA rank must be a positive integer, got {rank!r}")
    if parameters is None:
        parameters = expert_parameters(plan)
    if modules is None:  # PEFT's "all-linear" would add MoE routers' weights as target_parameters
        head = model.get_output_embeddings()
        modules = sorted({n.rpartition(".")[2] for n, m in model.named_modules()
                          if isinstance(m, nn.Linear) and m is not head})
    config = peft.LoraConfig(r=rank, lora_alpha=rank, target_modules=modules,
                             target_parameters=list(parameters) or None)
    try:
        peft_model = get_peft_model(model, config, low_cpu_mem_usage=True)
    except ValueError as e:
        raise AdapterError(f"LoRA on {modules} / {parameters}: {e}") from None
    return prepare(peft_model, plan)
