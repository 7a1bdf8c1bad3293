"""``parallelize(model, mesh)``: a readable sequence of steps over a transformers model (meta or real weights).

1. ``plan_parameters``     match the plan against the model and check every size — before any tensor is touched;
2. ``split_planned``       each planned tensor becomes a DTensor split on dim 0 over its plan's ranks;
3. ``install_styles``      planned modules get their forward style (EP dispatch, vocab-parallel lookup, …);
4. ``shard_planned``       ``fully_shard`` planned modules on dim 1 over ``<plan>_fsdp``, deepest first;
5. ``shard_units``         ``fully_shard`` decoder layers, the input embedding and the output head (units of their
                           own unless planned or tied), then the root, over all ranks (HSDP with replicate);
6. ``set_prefetch``        explicit forward/backward prefetch across the nested units;
7. ``install_global_loss`` the forward checks the model is ready (:func:`check_ready`) and, with labels, makes
                           every rank's loss its share of the global-batch mean (:mod:`xpar_zoo.loss`).
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard

from .errors import ModelStateError, PlanError
from .mesh import Mesh, check_same_on_all_ranks
from .gathered import install_gathered
from .hub_save import install_save_pretrained
from .loss import install_global_loss
from .materialize import check_materialized, meta_tensors, unread_buffers
from .moe import EXPERTS_IMPLEMENTATION, install_expert_parallel
from .plan import Plan, match_parameters
from .registry import get_plan
from .vocab import fusable_head, install_fused_loss, install_vocab_embedding, install_vocab_lm_head


@dataclass(frozen=True)
class PlannedModule:
    """A module whose parameters one extra plan splits on dim 0."""

    fqn: str
    plan_name: str
    style: str
    params: tuple[str, ...]  # local names on the module


@dataclass
class ParallelState:
    """What ``parallelize`` did, kept on the model as ``model._xpar``: the mesh, the plan and the planned modules."""

    mesh: Mesh
    plan: Plan
    planned: list[PlannedModule] = field(default_factory=list)
    unset_buffers: tuple[str, ...] = ()  # built on meta: buffers no checkpoint holds, until materialize()

    def planned_params(self) -> dict[str, str]:
        """``{parameter FQN: plan name}`` for every planned parameter."""
        return {f"{m.fqn}.{p}" if m.fqn else p: m.plan_name for m in self.planned for p in m.params}


def _split(fqn: str) -> tuple[str, str]:
    mod, _, name = fqn.rpartition(".")
    return mod, name


def check_plan_names(names, plan: Plan) -> None:
    """Raise :class:`PlanError` when a mesh names plans that ``plan`` does not define (the planner checks alike)."""
    unknown = [n for n in names if n not in plan.extra]
    if unknown:
        raise PlanError(
            f"mesh uses plan(s) {unknown} that the {plan.model_type!r} plan does not define; "
            f"its plans: {', '.join(plan.extra) or 'none'}"
        )


def plan_parameters(model: nn.Module, mesh: Mesh, plan: Plan) -> list[PlannedModule]:
    """Match ``plan`` against ``model`` for the plans ``mesh`` activates; raise :class:`PlanError` on any mismatch."""
    if any(isinstance(p, DTensor) for p in model.parameters()):
        raise PlanError("model is already parallelized (it has DTensor parameters)")
    return match_plan(model, plan, mesh.active, mesh.shard_size)


def match_plan(model: nn.Module, plan: Plan, active: dict[str, int], shard_size: int) -> list[PlannedModule]:
    """The planned modules of ``model`` for plans of sizes ``active`` (each > 1) over ``shard_size`` FSDP ranks,
    every size checked; no process group needed (the planner calls it on a meta model)."""
    check_plan_names(active, plan)
    params = dict(model.named_parameters(remove_duplicate=False))
    names_of: dict[int, list[str]] = defaultdict(list)
    for n, p in params.items():
        names_of[id(p)].append(n)
    owner: dict[str, str] = {}
    by_module: dict[str, list[str]] = defaultdict(list)
    for name, size in active.items():
        extra = plan.extra[name]
        fqns = match_parameters(model, extra.params)
        if not fqns:
            raise PlanError(f"plan {name!r} matched no parameter of {type(model).__name__} (patterns {extra.params})")
        fsdp = shard_size // size
        for fqn in fqns:
            if fqn in owner:
                raise PlanError(f"{fqn} is claimed by two plans: {owner[fqn]!r} and {name!r}")
            owner[fqn] = name
            tied = [n for n in names_of[id(params[fqn])] if n != fqn]
            if tied:
                raise PlanError(
                    f"plan {name!r}: {fqn} is tied to {', '.join(tied)} (e.g. tie_word_embeddings=True); a split "
                    "tensor can have only one compute style: untie the weights or leave this plan out of the mesh"
                )
            shape = tuple(params[fqn].shape)
            if len(shape) < 2:
                raise PlanError(f"plan {name!r}: {fqn} has shape {shape}; planned tensors need ≥ 2 dims")
            if shape[0] % size:
                raise PlanError(
                    f"plan {name!r}: {fqn} has {shape[0]} {extra.dim0 or 'rows'} on dim 0 "
                    f"(shape {list(shape)}), not divisible by {name}={size}"
                )
            if shape[1] % fsdp:
                raise PlanError(
                    f"plan {name!r}: {fqn} has {shape[1]} on dim 1 (shape {list(shape)}), not divisible by "
                    f"{name}_fsdp={fsdp} (FSDP2 shards planned tensors evenly on dim 1)"
                )
            by_module[(_split(fqn)[0], name)].append(_split(fqn)[1])
    planned = []
    for (mod_fqn, name), names in by_module.items():
        module = model.get_submodule(mod_fqn)
        others = [n for n, _ in module.named_parameters(recurse=False) if n not in names]
        if others:
            raise PlanError(
                f"plan {name!r} splits {mod_fqn}.{names} but not {others} of the same module; "
                "a planned module's own parameters must all be planned"
            )
        planned.append(PlannedModule(mod_fqn, name, plan.extra[name].style, tuple(names)))
    modules = [p.fqn for p in planned]
    if len(set(modules)) != len(modules):
        raise PlanError(f"a module is planned by two plans: {sorted(m for m in modules if modules.count(m) > 1)}")
    return planned


def split_planned(model: nn.Module, mesh: Mesh, planned: list[PlannedModule]) -> None:
    """Replace each planned parameter by this rank's dim-0 slice, as a DTensor at its global shape."""
    for pm in planned:
        module = model.get_submodule(pm.fqn)
        device_mesh = mesh.plan_mesh(pm.plan_name)
        size, rank = mesh.size(pm.plan_name), mesh.plan_rank(pm.plan_name)
        placements = [Replicate()] * (device_mesh.ndim - 1) + [Shard(0)]
        for name in pm.params:
            full = getattr(module, name)
            rows = full.shape[0] // size
            local = full.detach().narrow(0, rank * rows, rows)
            if not local.is_meta:
                local = local.clone()
            dt = DTensor.from_local(local, device_mesh, placements, run_check=False,
                                    shape=full.shape, stride=full.stride())
            setattr(module, name, nn.Parameter(dt, requires_grad=full.requires_grad))


def install_styles(model: nn.Module, mesh: Mesh, planned: list[PlannedModule]) -> None:
    """Give each planned module the forward of its style; experts modules use xpar_zoo's experts path."""
    for pm in planned:
        module = model.get_submodule(pm.fqn)
        shard = mesh.plan_shard(pm.plan_name, getattr(module, pm.params[0]).shape[0])
        if pm.style == "experts":
            install_expert_parallel(module, shard)
        elif pm.style == "embedding":
            install_vocab_embedding(module, shard)
        elif pm.style == "lm_head":
            install_vocab_lm_head(model, module, shard)
        elif pm.style == "gathered":
            install_gathered(module, pm.params, shard)
        else:
            raise PlanError(f"plan style {pm.style!r} ({pm.fqn}) is not implemented")
    if type(model)._can_set_experts_implementation() and getattr(model.config, "_experts_implementation", None):
        model.set_experts_implementation(EXPERTS_IMPLEMENTATION)


def whole_vocab_head_fusable(model: nn.Module, plan: Plan) -> bool:
    """Whether ``parallelize``'s default fused loss applies to ``model``'s whole-vocab head (on a mesh without a
    ``head`` plan): the plan defines a head plan (the architecture's head is proved to take it) and the head is
    fusable (:func:`~xpar_zoo.vocab.fusable_head`). The planner asks the same."""
    return any(p.style == "lm_head" for p in plan.extra.values()) and fusable_head(model) is not None


def shard_planned(model: nn.Module, mesh: Mesh, planned: list[PlannedModule], **fsdp_kwargs) -> None:
    """``fully_shard`` each planned module on dim 1 over its plan's FSDP ranks, submodules before parents."""
    for pm in sorted(planned, key=lambda p: -p.fqn.count(".")):
        module = model.get_submodule(pm.fqn)
        fully_shard(module, mesh=mesh.plan_mesh(pm.plan_name), dp_mesh_dims=mesh.fsdp_dims(pm.plan_name),
                    shard_placement_fn=lambda p: Shard(1), **fsdp_kwargs)
        # FSDP averages over the ranks it reduces across (world / size); every rank saw its own micro-batch, so
        # the data-parallel average is over the whole world: without this, gradients are `size` times too large.
        module.set_gradient_divide_factor(float(mesh.world_size))
        # A divide factor other than the group size makes FSDP2 reduce with PREMUL_SUM, which gloo rejects and NCCL
        # zeroes in bf16 up to torch 2.13 (pytorch#190747): reduce with SUM, then divide locally. Only where a
        # reduce-scatter really runs: with a single FSDP rank, torch 2.13 divides once in the local copy and
        # again after it when sums are forced.
        if mesh.shard_size // mesh.size(pm.plan_name) > 1:
            module.set_force_sum_reduction_for_comms(True)


def edge_units(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(fqn, module)`` of the input embedding and the output head, which ``shard_units`` makes FSDP units of
    their own (torchtitan's layout): the embedding is then gathered only around its own forward and backward and
    the head only from its forward to its backward, instead of both for the whole step as parameters of the
    root. None when they are tied (one weight, so one unit: the root's). The planner builds the same units."""
    found = []
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        try:
            module = getattr(model, getter, lambda: None)()
        except (NotImplementedError, AttributeError):  # models without one (e.g. a base model's head)
            module = None
        if isinstance(module, nn.Module) and module is not model and next(module.parameters(), None) is not None:
            found.append(module)
    weights = [id(p) for m in found for p in m.parameters()]
    if len(set(weights)) != len(weights):  # tied
        return []
    fqn = {id(m): n for n, m in model.named_modules()}
    return [(fqn[id(m)], m) for m in found if id(m) in fqn]


def shard_units(model: nn.Module, mesh: Mesh, plan: Plan, **fsdp_kwargs) -> tuple[list[nn.Module], list[nn.Module]]:
    """``fully_shard`` the decoder layers (the plan's FSDP unit classes), then the input embedding and the output
    head where no plan made them units already (:func:`edge_units`), then the root, over the dense mesh. Returns
    the decoder layers and the edge units."""
    classes = set(plan.unit_classes(model))
    units = [m for m in model.modules() if type(m).__name__ in classes and not isinstance(m, FSDPModule)]
    for unit in units:
        fully_shard(unit, mesh=mesh.dense, **fsdp_kwargs)
    edges = [m for _, m in edge_units(model) if not isinstance(m, FSDPModule)]
    for module in edges:
        fully_shard(module, mesh=mesh.dense, **fsdp_kwargs)
    root_kwargs = {k: v for k, v in fsdp_kwargs.items() if k != "reshard_after_forward"}
    fully_shard(model, mesh=mesh.dense, **root_kwargs)
    return units, edges


def _around_layers(model: nn.Module, units: list[nn.Module], modules: list[nn.Module]
                   ) -> tuple[dict[int, list[nn.Module]], list[nn.Module], list[nn.Module]]:
    """Of ``modules`` (planned modules and edge units): those inside each decoder layer (by ``id`` of the layer),
    and those outside every layer that run before the first (the embedding) and after the last (the head)."""
    inside = {id(u): [m for m in u.modules() if m is not u and any(m is q for q in modules)] for u in units}
    in_units = {id(m) for ms in inside.values() for m in ms}
    order = {id(m): i for i, m in enumerate(model.modules())}
    outside = sorted((m for m in modules if id(m) not in in_units), key=lambda m: order[id(m)])
    before = [m for m in outside if units and order[id(m)] < order[id(units[0])]]
    after = [m for m in outside if units and order[id(m)] > order[id(units[-1])]]
    return inside, before, after


def keep_gathered_for_backward(model: nn.Module, units: list[nn.Module], modules: list[nn.Module]) -> None:
    """The last decoder layer with its planned modules, and the units after it (the head), stay unsharded after
    forward: backward starts with them, so resharding would only all-gather them again at once (one all-gather —
    and for dim-1 shards one chunk-cat — saved per such unit and step, as torchtitan does for its last layer)."""
    _, _, after = _around_layers(model, units, modules)
    for module in units[-1:] + after:
        module.set_reshard_after_forward(False, recurse=True)


def set_prefetch(model: nn.Module, units: list[nn.Module], modules: list[nn.Module]) -> None:
    """Forward: layer i prefetches its planned modules (overlapping attention) and layer i+1; the root prefetches
    the units that run before the layers (the embedding) and the first layer, the last layer those after it (the
    head). Backward: layer i prefetches its planned modules; the last of those prefetches layer i-1, and layer 0's
    the embedding; the head prefetches the last layer."""
    inside, before, after = _around_layers(model, units, modules)
    for i, unit in enumerate(units):
        own = inside[id(unit)]
        unit.set_modules_to_forward_prefetch(own + (units[i + 1:i + 2] or after))
        earlier = units[i - 1:i] if i > 0 else before[-1:]
        if own:
            unit.set_modules_to_backward_prefetch(own)
            if earlier:
                own[-1].set_modules_to_backward_prefetch(earlier)
        elif earlier:
            unit.set_modules_to_backward_prefetch(earlier)
    if units:
        model.set_modules_to_forward_prefetch(before + [units[0]])
    if after:
        after[0].set_modules_to_backward_prefetch([units[-1]])


def _fingerprint(model: nn.Module, plan: Plan) -> str:
    """A short digest of the model's parameter names and shapes and of the plan, to compare across ranks."""
    text = repr([(n, tuple(p.shape)) for n, p in model.named_parameters()]) + repr(sorted(plan.extra.items()))
    return f"{model.config.model_type}:{hashlib.sha1(text.encode()).hexdigest()[:12]}"


def unmanaged_parameters(model: nn.Module) -> list[str]:
    """Names of ``model``'s trainable parameters that no FSDP unit manages — added after ``parallelize`` (e.g. a
    LoRA adapter) or swapped in for a managed one: FSDP never reduces their gradients, so each rank would train its
    own copy."""
    managed: set[int] = set()
    for module in model.modules():
        if isinstance(module, FSDPModule):
            group = module._get_fsdp_state()._fsdp_param_group
            for fsdp_param in group.fsdp_params if group is not None else ():
                managed.add(id(fsdp_param.sharded_param))
                unsharded = getattr(fsdp_param, "_unsharded_param", None)  # while the unit is gathered
                if unsharded is not None:
                    managed.add(id(unsharded))
    return [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in managed]


def check_ready(model: nn.Module) -> None:
    """Raise :class:`~xpar_zoo.errors.ModelStateError` when a parallelized model cannot run exactly: tensors still on
    meta or buffers never initialised (see :mod:`xpar_zoo.materialize`), or trainable parameters that
    ``parallelize`` does not manage (:func:`unmanaged_parameters`). ``parallelize`` runs it before every forward."""
    check_materialized(model)
    unmanaged = unmanaged_parameters(model)
    if unmanaged:
        shown = ", ".join(unmanaged[:6]) + (f", … ({len(unmanaged)} in all)" if len(unmanaged) > 6 else "")
        raise ModelStateError(
            f"trainable parameters that xpar_zoo.parallelize does not manage: {shown}. They were added or swapped in "
            "after parallelize, so their gradients are never reduced across ranks and every rank would train its own "
            "copy. Create them before parallelize (e.g. apply the PEFT adapter to the model first) or freeze them "
            "(requires_grad=False)")


def parallelize(
    model: nn.Module,
    mesh: Mesh,
    *,
    plan: Plan | None = None,
    mixed_precision: bool | MixedPrecisionPolicy = False,
    reshard_after_forward: bool = True,
    prefetch: bool = True,
    fused_loss: bool = True,
) -> nn.Module:
    """Apply the architecture's extra plans (dim-0 splits with real parallel compute) and FSDP2 (dim 1 for planned
    tensors) to a transformers model in place; returns it. ``plan`` defaults to the registry's plan for
    ``model.config.model_type``; ``mixed_precision=True`` means bf16 parameters with fp32 gradient reduction.

    ``fused_loss`` (default): where the mesh has no ``head`` plan but the plan defines one (so the architecture's
    head is proved to take it), the whole-vocab head gets the fused linear + cross-entropy of
    :func:`~xpar_zoo.vocab.install_fused_loss` — no ``[tokens, V]`` logits with labels (``out.logits`` is ``None``
    unless asked for with :func:`~xpar_zoo.full_logits`). ``fused_loss=False`` keeps transformers' loss; to choose
    its chunk size or kernels, call :func:`~xpar_zoo.vocab.install_fused_loss` on the model before this.

    With labels, ``out.loss`` on each rank is its share of the mean over every valid target of every rank's
    micro-batch (the mean of ``out.loss`` over the ranks is that global mean, and the gradients are exactly its
    gradients); ``num_items_in_batch`` sets the global count explicitly (gradient accumulation): see
    :mod:`xpar_zoo.loss`. A model built on meta needs :func:`~xpar_zoo.materialize` before it loads a checkpoint."""
    plan = plan or get_plan(model.config.model_type)
    check_same_on_all_ranks({"model and plan": _fingerprint(model, plan), "mixed_precision": repr(mixed_precision),
                             "reshard_after_forward": reshard_after_forward, "prefetch": prefetch,
                             "fused_loss": fused_loss}, "parallelize arguments", PlanError)
    planned = plan_parameters(model, mesh, plan)
    unset = tuple(sorted(unread_buffers(model))) if meta_tensors(model) else ()
    if mixed_precision is True:
        mixed_precision = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fsdp_kwargs = {"reshard_after_forward": reshard_after_forward}
    if mixed_precision:
        fsdp_kwargs["mp_policy"] = mixed_precision
    split_planned(model, mesh, planned)
    install_styles(model, mesh, planned)
    if fused_loss and not any(pm.style == "lm_head" for pm in planned) and whole_vocab_head_fusable(model, plan):
        install_fused_loss(model)
    shard_planned(model, mesh, planned, **fsdp_kwargs)
    units, edges = shard_units(model, mesh, plan, **fsdp_kwargs)
    around = [model.get_submodule(p.fqn) for p in planned] + edges
    if reshard_after_forward:
        keep_gathered_for_backward(model, units, around)
    if prefetch:
        set_prefetch(model, units, around)
    model._xpar = ParallelState(mesh=mesh, plan=plan, planned=planned, unset_buffers=unset)
    install_global_loss(model, mesh.world_size)
    # before FSDP's own pre-forward hook, so that nothing is gathered or prefetched when the model is refused
    model.register_forward_pre_hook(lambda module, args: check_ready(module), prepend=True)
    model._is_fsdp_managed_module = True  # transformers' generate then keeps the ranks in step (synced_gpus)
    install_save_pretrained(model)
    return model
