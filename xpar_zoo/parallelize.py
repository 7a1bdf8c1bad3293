"""``parallelize(model, mesh)``: a readable sequence of steps over a transformers model (meta or real weights).

1. ``plan_parameters``     match the plan against the model and check every size — before any tensor is touched;
2. ``split_planned``       each planned tensor becomes a DTensor split on dim 0 over its plan's ranks;
3. ``install_styles``      planned modules get their forward style (EP dispatch, vocab-parallel lookup, …);
4. ``fsdp_layout``         FSDP units, meshes, reshard and prefetch decisions (:mod:`xpar_zoo.parallel.fsdp_layout`);
5. ``apply_fsdp``          ``fully_shard`` planned modules (dim 0 of each slice where it divides, else dim 1),
                           decoder layers, embedding and head, then the root (on the CPU each with its
                           collectives in place, :mod:`xpar_zoo.parallel.gloo_comms`, unless the options'
                           ``cpu_collectives`` says ``"gloo"``); then reshard and prefetch, and every unit resharded after a forward no
                           backward follows (:func:`reshard_after_inference`);
6. ``install_global_loss`` the forward checks the model is ready (:func:`check_ready`) and makes every rank's
                           loss its share of the global-batch mean (:mod:`xpar_zoo.loss.global_batch`);
7. ``install_sequence_parallel`` with sp/cp: the attention is wrapped and the forward keeps this rank's part of
                           full-length rows (:mod:`xpar_zoo.styles.sequence`; checked in step 1);
8. ``install_encoder_agreement`` a multimodal model runs its encoders on every rank whenever any rank has
                           images (a dummy image where it has none), so the vision tower's FSDP collectives
                           match with images in some rows only; outermost, so that under sp/cp the whole rows'
                           images are encoded before the split (:mod:`xpar_zoo.styles.encoders`).

Why each step is as it is: ``docs/design.md``, "parallelize and the placement of planned tensors".
"""

from __future__ import annotations

import hashlib
import logging
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard

from .compat import (
    can_set_experts_implementation,
    fsdp_managed_tensors,
    mark_fsdp_managed,
)
from .errors import ModelStateError, PlanError
from .hub.adapter_files import finish
from .hub.save_pretrained import install_save_pretrained
from .loss.global_batch import install_global_loss
from .parallel.distributed import run_everywhere
from .parallel.fsdp_layout import FSDPUnit, PlannedModule, fsdp_layout
from .parallel.materialize import check_materialized, meta_tensors, unread_buffers
from .parallel.mesh import Mesh, check_same_on_all_ranks
from .parallel.options import ParallelOptions
from .parallel.state import ParallelState, parallel_state, set_parallel_state
from .styles.encoders import install_encoder_agreement
from .styles.experts import EXPERTS_IMPLEMENTATION, install_expert_parallel
from .styles.gathered import install_gathered
from .styles.lora import base_of, prepare, uses_peft
from .styles.planned import match_plan, whole_vocab_head_fusable
from .styles.sequence import check_sequence_parallel, install_sequence_parallel
from .styles.vocab import (
    install_fused_loss,
    install_vocab_embedding,
    install_vocab_lm_head,
)
from .zoo.plan import Plan

if TYPE_CHECKING:
    from transformers import PretrainedConfig
from .zoo.registry import plan_for

logger = logging.getLogger(__name__)


def plan_parameters(model: nn.Module, mesh: Mesh, plan: Plan) -> list[PlannedModule]:
    """Match ``plan`` against ``model`` for the plans ``mesh`` activates; raise :class:`PlanError` on any mismatch."""
    if any(isinstance(p, DTensor) for p in model.parameters()):
        raise PlanError("model is already parallelized (it has DTensor parameters)")
    return match_plan(model, plan, mesh.active, mesh.shard_size)


def split_planned(model: nn.Module, mesh: Mesh, planned: list[PlannedModule]) -> None:
    """Replace each planned parameter by this rank's dim-0 slice, as a DTensor at its global shape."""
    for pm in planned:
        module = model.get_submodule(pm.fqn)
        device_mesh = mesh.plan_mesh(pm.plan_name)
        size, rank = mesh.size(pm.plan_name), mesh.plan_rank(pm.plan_name)
        placements = [Replicate()] * (device_mesh.ndim - 1) + [Shard(0)]
        for name in pm.params:
            holder_fqn, _, name = name.rpartition(".")
            holder = module.get_submodule(holder_fqn)
            full = getattr(holder, name)
            rows = full.shape[0] // size
            local = full.detach().narrow(0, rank * rows, rows)
            if not local.is_meta:
                local = local.clone()
            dt = DTensor.from_local(local, device_mesh, placements, run_check=False,
                                    shape=full.shape, stride=full.stride())
            setattr(holder, name, nn.Parameter(dt, requires_grad=full.requires_grad))


def install_styles(model: nn.Module, mesh: Mesh, planned: list[PlannedModule]) -> None:
    """Give each planned module the forward of its style; experts modules use xpar_zoo's experts path."""
    for pm in planned:
        module = model.get_submodule(pm.fqn)
        shard = mesh.plan_shard(pm.plan_name, module.get_parameter(pm.params[0]).shape[0])
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
    if can_set_experts_implementation(model):
        model.set_experts_implementation(EXPERTS_IMPLEMENTATION)


def apply_fsdp(model: nn.Module, mesh: Mesh, units: list[FSDPUnit], *, cpu_collectives: str = "in_place",
               **fsdp_kwargs) -> None:
    """``fully_shard`` every unit of :func:`~xpar_zoo.parallel.fsdp_layout.fsdp_layout` in its order, then set its reshard
    and prefetch decisions. Planned units go over their plan's mesh, each parameter on its ``shard_dim``, with the
    gradient divide factor of the whole world. On the CPU, with ``cpu_collectives="in_place"``, every unit gathers
    and reduces through :mod:`xpar_zoo.parallel.gloo_comms` (in place, without gloo's staging copies)."""
    in_place: Callable[[FSDPModule], None] | None = None
    if mesh.dense.device_type == "cpu" and cpu_collectives == "in_place":  # gloo's own stage a copy of every buffer
        from .parallel.gloo_comms import use_in_place_collectives

        in_place = use_in_place_collectives
    sharded: dict[str, FSDPModule] = {}  # fully_shard returns the module it was given, now an FSDPModule
    for unit in units:
        module = model.get_submodule(unit.fqn)
        if unit.kind == "planned" and unit.plan_name is not None:
            dims = {id(model.get_parameter(f)): unit.shard_dim(f) for f in unit.params}
            logger.debug("FSDP %s over %s_fsdp=%d: %s", unit.fqn, unit.plan_name,
                         mesh.shard_size // mesh.size(unit.plan_name),
                         ", ".join(f"{f.rpartition('.')[2]} on dim {unit.shard_dim(f)}" for f in unit.params))
            sharded[unit.fqn] = fsdp = fully_shard(
                module, mesh=mesh.plan_mesh(unit.plan_name), dp_mesh_dims=mesh.fsdp_dims(unit.plan_name),
                shard_placement_fn=_placement_by_id(dims), **fsdp_kwargs)
            # FSDP averages over the ranks it reduces across (world / size); every rank saw its own micro-batch, so
            # the data-parallel average is over the whole world: without this, gradients are `size` times too large.
            fsdp.set_gradient_divide_factor(float(mesh.world_size))
            # A divide factor other than the group size makes FSDP2 reduce with PREMUL_SUM, which gloo rejects and
            # NCCL zeroes in bf16 up to torch 2.13 (pytorch#190747): reduce with SUM, then divide locally. Only where
            # a reduce-scatter really runs: with a single FSDP rank, torch 2.13 divides once in the local copy and
            # again after it when sums are forced.
            if mesh.shard_size // mesh.size(unit.plan_name) > 1:
                fsdp.set_force_sum_reduction_for_comms(True)
        elif unit.kind == "root":  # FSDP2 never reshards the root after forward
            sharded[unit.fqn] = fully_shard(module, mesh=mesh.dense, **{k: v for k, v in fsdp_kwargs.items()
                                                                        if k != "reshard_after_forward"})
        else:
            sharded[unit.fqn] = fully_shard(module, mesh=mesh.dense, **fsdp_kwargs)
        if in_place is not None:
            in_place(sharded[unit.fqn])
    for unit in units:
        fsdp = sharded[unit.fqn]
        if unit.kind != "root" and not unit.reshard_after_forward and fsdp_kwargs.get("reshard_after_forward", True):
            fsdp.set_reshard_after_forward(False, recurse=False)
        if unit.forward_prefetch:
            fsdp.set_modules_to_forward_prefetch([sharded[f] for f in unit.forward_prefetch])
        if unit.backward_prefetch:
            fsdp.set_modules_to_backward_prefetch([sharded[f] for f in unit.backward_prefetch])


def _placement_by_id(dims: dict[int, int]) -> Callable[[nn.Parameter], Shard]:
    """FSDP's ``shard_placement_fn``: each parameter on its dim in ``dims`` (keyed by ``id(parameter)``)."""
    return lambda p: Shard(dims[id(p)])


def reshard_after_inference(model: nn.Module) -> None:
    """After every forward of ``model`` without gradients or in eval mode (``torch.no_grad()``, ``model.eval()``,
    ``generate``), reshard every FSDP unit, the root and the units kept gathered for backward included: FSDP2 leaves
    them unsharded for a backward that does not come, so ``model.parameters()`` would hand an optimizer built then
    plain unsharded tensors outside FSDP. In training mode with gradients nothing changes (a backward regathers a
    resharded unit, at the cost of one all-gather, should one follow an eval-mode forward)."""
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]

    def reshard(module: nn.Module, args, output):
        if torch.is_grad_enabled() and module.training:
            return None
        for unit in units:
            unit.reshard()
        return None

    model.register_forward_hook(reshard)  # after FSDP2's own post-forward hook, registered by fully_shard


def _fingerprint(model: nn.Module, plan: Plan) -> str:
    """A short digest of the model's parameter names and shapes and of the plan, to compare across ranks."""
    text = repr([(n, tuple(p.shape)) for n, p in model.named_parameters()]) + repr(sorted(plan.extra.items()))
    config = cast("PretrainedConfig", model.config)  # a transformers model's (nn.Module types attributes as modules)
    return f"{config.model_type}:{hashlib.sha1(text.encode()).hexdigest()[:12]}"


def _unmanaged(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``model``'s parameters that no FSDP unit manages, trainable or not."""
    managed: set[int] = set()
    for module in model.modules():
        if isinstance(module, FSDPModule):
            managed.update(id(t) for t in fsdp_managed_tensors(module))
    return [(n, p) for n, p in model.named_parameters() if id(p) not in managed]


def unmanaged_parameters(model: nn.Module) -> list[str]:
    """Names of ``model``'s trainable parameters that no FSDP unit manages — added after ``parallelize`` (e.g. a
    LoRA adapter) or swapped in for a managed one: FSDP never reduces their gradients, so each rank would train its
    own copy."""
    return [n for n, p in _unmanaged(model) if p.requires_grad]


# The module tree's generation: torch's global registration hooks count every parameter, buffer and submodule
# registered on a module of a model check_ready has passed (assignment, register_*), so that check_ready walks a
# model again only after such a change. Registrations on other modules do not count: transformers builds a fresh
# ModuleList from ``self.layers[:n]`` at every forward.
_tree_generation = [0]
_watched: weakref.WeakSet = weakref.WeakSet()
_tree_hooks: list = []


def _count_registration(module: nn.Module, *args) -> None:
    if module in _watched:
        _tree_generation[0] += 1


def _watch_module_tree() -> None:
    if not _tree_hooks:
        from torch.nn.modules import module as nn_module

        _tree_hooks.extend(register(_count_registration) for register in (
            nn_module.register_module_parameter_registration_hook, nn_module.register_module_buffer_registration_hook,
            nn_module.register_module_module_registration_hook))


def check_ready(model: nn.Module) -> None:
    """Raise :class:`~xpar_zoo.errors.ModelStateError` when a parallelized model cannot run exactly: tensors still on
    meta or buffers never initialised (see :mod:`xpar_zoo.parallel.materialize`), or trainable parameters that
    ``parallelize`` does not manage (:func:`unmanaged_parameters`). ``parallelize`` runs it before every forward.

    The walk over every parameter, buffer and FSDP unit runs once, and again only after a parameter, buffer or
    module was registered on one of the model's modules (torch's global registration hooks) or while
    ``materialize`` is still due; in between, only the frozen parameters no FSDP unit manages are looked at (one
    made trainable fails the check)."""
    state = parallel_state(model)
    if (state is not None and state.ready_at == _tree_generation[0] and not state.unset_buffers
            and not any(p.requires_grad for p in state.frozen_unmanaged)):
        return
    generation = _tree_generation[0]  # read first: a registration during the walk makes the next call walk again
    check_materialized(model)
    unmanaged = _unmanaged(model)
    trainable = [n for n, p in unmanaged if p.requires_grad]
    if trainable:
        shown = ", ".join(trainable[:6]) + (f", … ({len(trainable)} in all)" if len(trainable) > 6 else "")
        raise ModelStateError(
            f"trainable parameters that xpar_zoo.parallelize does not manage: {shown}. They were added or swapped in "
            "after parallelize, so their gradients are never reduced across ranks and every rank would train its own "
            "copy. Create them before parallelize (e.g. apply the PEFT adapter to the model first) or freeze them "
            "(requires_grad=False)")
    if state is not None:
        _watched.update(model.modules())
        state.ready_at, state.frozen_unmanaged = generation, tuple(p for _, p in unmanaged)


def resolve_options(options: ParallelOptions | None, cpu_collectives: str | None = None) -> ParallelOptions:
    """The options ``parallelize`` runs with: ``options``, else the environment's defaults
    (:meth:`ParallelOptions.from_env`, read here once); ``cpu_collectives`` (a keyword of ``parallelize`` too) sets that field.
    :class:`PlanError` on a bad value, or on ``cpu_collectives`` that disagrees with ``options``."""
    if options is None:
        given: dict[str, Any] = {} if cpu_collectives is None else {"cpu_collectives": cpu_collectives}
        return ParallelOptions.from_env(**given)
    if not isinstance(options, ParallelOptions):
        raise PlanError(f"options must be a xpar_zoo.ParallelOptions, got {type(options).__name__}")
    if cpu_collectives is not None and cpu_collectives != options.cpu_collectives:
        raise PlanError(f"cpu_collectives={cpu_collectives!r} and options.cpu_collectives="
                        f"{options.cpu_collectives!r} disagree; give it once (in options)")
    return options


def set_parallel_options(model: nn.Module, options: ParallelOptions | None) -> None:
    """Run the parallelized ``model`` with ``options`` from its next forward on (the styles read them from its
    parallel state; ``None``: keep those it runs with). A collective: every rank calls it, and ranks given different
    options (one of them ``None``) get one line each, before anything changes. ``cpu_collectives`` was applied when
    ``parallelize`` sharded the model and cannot change here."""
    state = parallel_state(model)
    if state is None:
        raise ModelStateError(f"{type(model).__name__} is not parallelized; pass options to parallelize")
    agreement = options if options is None or isinstance(options, ParallelOptions) else type(options).__name__
    check_same_on_all_ranks(agreement, "options", PlanError)
    if options is None:
        return
    if not isinstance(options, ParallelOptions):
        raise PlanError(f"options must be a xpar_zoo.ParallelOptions, got {type(options).__name__}")
    if options.cpu_collectives != state.options.cpu_collectives:
        raise PlanError(f"cpu_collectives={options.cpu_collectives!r}: the model was parallelized with "
                        f"{state.options.cpu_collectives!r}, which its FSDP units keep; pass it to parallelize")
    state.options = options


def parallelize(
    model: nn.Module,
    mesh: Mesh,
    *,
    plan: Plan | None = None,
    mixed_precision: bool | MixedPrecisionPolicy = False,
    reshard_after_forward: bool = True,
    prefetch: bool = True,
    fused_loss: bool = True,
    options: ParallelOptions | None = None,
    cpu_collectives: str | None = None,
) -> nn.Module:
    """Apply the architecture's extra plans (dim-0 splits with real parallel compute) and FSDP2 (planned slices on
    dim 0 where it divides, else dim 1) to a transformers model in place; returns it. ``plan`` defaults to the
    registry's plan for the model (:func:`~xpar_zoo.zoo.registry.plan_for`: curated, else derived from transformers'
    declarations); ``mixed_precision=True`` means bf16 parameters with fp32 gradient reduction.

    ``fused_loss`` (default): where the mesh has no ``head`` plan but the plan defines one (so the architecture's
    head is proved to take it), the whole-vocab head gets the fused linear + cross-entropy of
    :func:`~xpar_zoo.styles.vocab.install_fused_loss` — no ``[tokens, V]`` logits with labels (``out.logits`` is ``None``
    unless asked for with :func:`~xpar_zoo.full_logits`). ``fused_loss=False`` keeps transformers' loss; to choose
    its chunk size or kernels, call :func:`~xpar_zoo.styles.vocab.install_fused_loss` on the model before this.

    ``options`` (:class:`~xpar_zoo.ParallelOptions`): the sp/cp attention's block budget and cp path, the hybrid
    mixers' recompute, the CPU collectives; without it, :meth:`~xpar_zoo.ParallelOptions.from_env` (the
    ``XPAR_ZOO_*`` variables, read once here, else the defaults). Checked equal on every rank with the other
    arguments. ``cpu_collectives`` sets ``options.cpu_collectives`` (CPU meshes only: ``"in_place"``, the default,
    gives every FSDP unit the in-place gloo collectives of :mod:`xpar_zoo.parallel.gloo_comms`, ``"gloo"`` keeps
    FSDP2's own).

    With labels, ``out.loss`` on each rank is its share of the mean over every valid target of every rank's
    micro-batch (the mean of ``out.loss`` over the ranks is that global mean, and the gradients are exactly its
    gradients); ``num_items_in_batch`` sets the global count explicitly (gradient accumulation): see
    :mod:`xpar_zoo.loss.global_batch`. A model built on meta needs :func:`~xpar_zoo.materialize` before it loads a checkpoint."""
    given = options  # a bad value on one rank is raised on every rank (no rank left in the agreement check)
    options = run_everywhere(lambda: resolve_options(given, cpu_collectives))
    outer = model
    if uses_peft(model):  # LoRA applied before parallelize: the transformers model inside, its plan under PEFT's names
        model, plan = prepare(outer, plan or plan_for(base_of(outer)))
    plan = plan or plan_for(model)
    check_same_on_all_ranks({"model and plan": _fingerprint(model, plan), "mixed_precision": repr(mixed_precision),
                             "reshard_after_forward": reshard_after_forward, "prefetch": prefetch,
                             "fused_loss": fused_loss, **options.agreement()}, "parallelize arguments", PlanError)
    planned = plan_parameters(model, mesh, plan)
    inner_attention = check_sequence_parallel(model, mesh) if mesh.sequence_size > 1 else None
    unset = tuple(sorted(unread_buffers(model))) if meta_tensors(model) else ()
    if mixed_precision is True:
        mixed_precision = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fsdp_kwargs: dict[str, Any] = {"reshard_after_forward": reshard_after_forward}
    if mixed_precision:
        fsdp_kwargs["mp_policy"] = mixed_precision
    split_planned(model, mesh, planned)
    install_styles(model, mesh, planned)
    if fused_loss and not any(pm.style == "lm_head" for pm in planned) and whole_vocab_head_fusable(model, plan):
        install_fused_loss(model)
    apply_fsdp(model, mesh, fsdp_layout(model, plan, planned, sizes=mesh.active, shard_size=mesh.shard_size,
                                        reshard_after_forward=reshard_after_forward, prefetch=prefetch),
               cpu_collectives=options.cpu_collectives, **fsdp_kwargs)
    state = ParallelState(mesh=mesh, plan=plan, planned=planned, unset_buffers=unset, options=options)
    set_parallel_state(model, state)
    reshard_after_inference(model)
    install_global_loss(model, mesh.world_size)
    if inner_attention is not None:  # outermost: the global-batch loss counts this rank's split targets
        install_sequence_parallel(model, mesh, inner_attention, state)
    install_encoder_agreement(model, mesh.device_type)  # outermost: images encoded on whole rows, before a split
    # before FSDP's own pre-forward hook, so that nothing is gathered or prefetched when the model is refused
    _watch_module_tree()
    model.register_forward_pre_hook(lambda module, args: check_ready(module), prepend=True)
    mark_fsdp_managed(model)  # transformers' generate keeps the ranks in step; accelerate's prepare adds no DDP
    install_save_pretrained(model)
    if outer is not model or uses_peft(model):
        return finish(outer, model)
    return model
