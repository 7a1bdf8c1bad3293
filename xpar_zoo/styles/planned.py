"""Which modules each active plan splits, every size and style checked before any work: the one matching that
``parallelize`` applies and the sizer sizes (on a meta model, no process group needed)."""

from __future__ import annotations

from collections import defaultdict

from torch import nn

from ..errors import PlanError
from ..parallel.fsdp_layout import PlannedModule, planned_shard_dim
from ..zoo.plan import ExtraPlan, Plan, match_parameters, owner_module
from .vocab import check_embedding, check_head


def check_plan_names(names, plan: Plan) -> None:
    """Raise :class:`PlanError` when a mesh names plans that ``plan`` does not define (the sizer checks alike)."""
    unknown = [n for n in names if n not in plan.extra]
    if unknown:
        raise PlanError(
            f"mesh uses plan(s) {unknown} that the {plan.model_type!r} plan does not define; "
            f"its plans: {', '.join(plan.extra) or 'none'}"
        )


def match_plan(model: nn.Module, plan: Plan, active: dict[str, int], shard_size: int) -> list[PlannedModule]:
    """The planned modules of ``model`` for plans of sizes ``active`` (each > 1) over ``shard_size`` FSDP ranks,
    every size checked; no process group needed (the sizer calls it on a meta model)."""
    check_plan_names(active, plan)
    claimed = _claimed_parameters(model, plan, active, shard_size)
    planned = [_planned_module(model, plan, mod_fqn, name, names) for (mod_fqn, name), names in claimed.items()]
    modules = [p.fqn for p in planned]
    if len(set(modules)) != len(modules):
        raise PlanError(f"a module is planned by two plans: {sorted(m for m in modules if modules.count(m) > 1)}")
    return planned


def _claimed_parameters(model: nn.Module, plan: Plan, active: dict[str, int],
                        shard_size: int) -> dict[tuple[str, str], list[str]]:
    """``{(module fqn, plan name): [the module's local parameter names the plan splits]}``, each parameter claimed
    by one plan only and splittable at its plan's size."""
    params = dict(model.named_parameters(remove_duplicate=False))
    names_of: dict[int, list[str]] = defaultdict(list)
    for n, p in params.items():
        names_of[id(p)].append(n)
    owner: dict[str, str] = {}
    by_module: dict[tuple[str, str], list[str]] = defaultdict(list)
    for name, size in active.items():
        extra = plan.extra[name]
        fqns = match_parameters(model, extra.params)
        if not fqns:
            raise PlanError(f"plan {name!r} matched no parameter of {type(model).__name__} (patterns {extra.params})")
        for fqn in fqns:
            if fqn in owner:
                raise PlanError(f"{fqn} is claimed by two plans: {owner[fqn]!r} and {name!r}")
            owner[fqn] = name
            tied = [n for n in names_of[id(params[fqn])] if n != fqn]
            _check_splittable(name, extra, fqn, tuple(params[fqn].shape), tied, size, shard_size // size)
            module_fqn = owner_module(model, fqn)
            by_module[(module_fqn, name)].append(fqn[len(module_fqn) + 1:] if module_fqn else fqn)
    return by_module


def _check_splittable(name: str, extra: ExtraPlan, fqn: str, shape: tuple[int, ...], tied: list[str], size: int,
                      fsdp: int) -> None:
    """Raise :class:`PlanError` unless plan ``name`` of ``size`` can split the tensor ``fqn`` on dim 0 and its
    ``fsdp`` ranks can shard the slice."""
    if tied:
        raise PlanError(
            f"plan {name!r}: {fqn} is tied to {', '.join(tied)} (e.g. tie_word_embeddings=True); a split "
            "tensor can have only one compute style: untie the weights or leave this plan out of the mesh"
        )
    if len(shape) < 2:
        raise PlanError(f"plan {name!r}: {fqn} has shape {shape}; planned tensors need ≥ 2 dims")
    if shape[0] % size:
        raise PlanError(
            f"plan {name!r}: {fqn} has {shape[0]} {extra.dim0 or 'rows'} on dim 0 "
            f"(shape {list(shape)}), not divisible by {name}={size}"
        )
    if planned_shard_dim(shape[0] // size, fsdp) == 1 and shape[1] % fsdp:
        raise PlanError(
            f"plan {name!r}: {fqn} has {shape[1]} on dim 1 (shape {list(shape)}), not divisible by "
            f"{name}_fsdp={fsdp} (FSDP2 shards a planned slice evenly on dim 1 where its "
            f"{shape[0] // size} rows on dim 0 do not divide by {fsdp})"
        )


def _planned_module(model: nn.Module, plan: Plan, mod_fqn: str, name: str, names: list[str]) -> PlannedModule:
    """The module ``mod_fqn`` as plan ``name`` splits it, refused when the plan leaves some of its own parameters
    whole or its style cannot serve it."""
    module = model.get_submodule(mod_fqn)
    wrapped = any("." in n for n in names)  # an adapter wrapper: everything inside it computes with the slice
    others = [n for n, _ in module.named_parameters(recurse=wrapped) if n not in names]
    if others:
        raise PlanError(
            f"plan {name!r} splits {mod_fqn}.{names} but not {others} of the same module; "
            "a planned module's own parameters must all be planned"
        )
    if plan.extra[name].style == "lm_head":  # vocab modules the styles cannot serve: refused before any work
        check_head(model, module)
    elif plan.extra[name].style == "embedding":
        try:
            check_embedding(model, module)
        except PlanError as e:
            raise PlanError(f"plan {name!r} ({mod_fqn}): {e}; leave {name!r} out of the mesh") from None
    return PlannedModule(mod_fqn, name, plan.extra[name].style, tuple(names))


def whole_vocab_head_fusable(model: nn.Module, plan: Plan) -> bool:
    """Whether ``parallelize``'s default fused loss applies to ``model``'s whole-vocab head (on a mesh without a
    ``head`` plan): the plan defines a head plan (the architecture's head is proved to take it) and the head is
    fusable (:func:`~xpar_zoo.styles.vocab.fusable_head`). The sizer asks the same."""
    from .vocab import fusable_head

    return any(p.style == "lm_head" for p in plan.extra.values()) and fusable_head(model) is not None
