"""What ``parallelize`` did to a model (:class:`ParallelState`, read with :func:`parallel_state`) and views of a
parallelized model: the whole model on rank 0 (:func:`full_state_dict`), the global region of a tensor this rank
holds (:func:`local_region`), and the runs of consecutive indices in what a rank holds (:func:`consecutive_runs`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
)
from torch.distributed.tensor import DTensor, Shard

from ..compat import StridedShard, shard_size_and_offsets
from ..errors import LoadError
from ..zoo.plan import Plan
from .distributed import exact_gathers
from .fsdp_layout import PlannedModule
from .mesh import Mesh
from .options import ParallelOptions


@dataclass
class ParallelState:
    """What ``parallelize`` did, kept on the model (:func:`parallel_state` reads it): the mesh, the plan, the planned
    modules and the options the styles read."""

    mesh: Mesh
    plan: Plan
    planned: list[PlannedModule] = field(default_factory=list)
    options: ParallelOptions = field(default_factory=ParallelOptions)
    unset_buffers: tuple[str, ...] = ()  # built on meta: buffers no checkpoint holds, until materialize()
    # check_ready's last pass: the module-tree generation it saw, and the parameters no FSDP unit manages (frozen)
    ready_at: int | None = None
    frozen_unmanaged: tuple[nn.Parameter, ...] = ()

    def planned_params(self) -> dict[str, str]:
        """``{parameter FQN: plan name}`` for every planned parameter."""
        return {f"{m.fqn}.{p}" if m.fqn else p: m.plan_name for m in self.planned for p in m.params}


_ATTRIBUTE = "_xpar"  # the one place that names it: everything else calls the functions below


def parallel_state(model: nn.Module | None) -> ParallelState | None:
    """What ``parallelize`` did to ``model`` (found through PEFT's wrappers, which forward attribute lookups to the
    model they wrap), or ``None`` for a model ``parallelize`` has not seen."""
    return getattr(model, _ATTRIBUTE, None)


def set_parallel_state(model: nn.Module, state: ParallelState) -> None:
    setattr(model, _ATTRIBUTE, state)


def parallelized_module(model: Any) -> nn.Module | None:
    """The module ``parallelize`` was applied to inside ``model`` (``model`` itself, or the base model of a PEFT
    model), or ``None`` (also when ``model`` is not a module). Looks at each module's own attributes: PEFT's
    wrappers would answer a lookup for it too."""
    if not isinstance(model, nn.Module):
        return None
    return next((m for m in model.modules() if _ATTRIBUTE in vars(m)), None)


Box = tuple[tuple[int, int], ...]  # one [start, stop) per dim


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Rank 0 gets ``{in-memory HF name: full CPU tensor}`` at global shapes (every expert, every vocab row);
    other ranks get ``{}``. A collective: every rank must call it."""
    with exact_gathers():
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return cast(dict[str, torch.Tensor], state)  # full_state_dict: every value a tensor


def held_indices(tensor: DTensor) -> tuple[list[int], dict[int, torch.Tensor]]:
    """This rank's local shape of ``tensor`` and, per sharded dim, the global indices it holds in order (a 1-D tensor
    each; an unsharded dim is absent): torch's own per-placement rule (``compute_local_shape_and_global_offset``
    keeps only the first), so that a ``_StridedShard`` (what FSDP2 makes of a dim-0 shard of a slice already split
    on dim 0) can be checked or read."""
    mesh, coordinate = tensor.device_mesh, tensor.device_mesh.get_coordinate()
    if coordinate is None:
        raise LoadError(f"this rank holds no part of a tensor on {mesh}")
    shape, held = list(tensor.shape), dict[int, torch.Tensor]()
    for i, placement in enumerate(tensor.placements):
        if isinstance(placement, (Shard, StridedShard)):
            d = placement.dim
            # the indices themselves (return_first_offset=False), never None
            shape[d], held[d] = cast(tuple[int, torch.Tensor], shard_size_and_offsets(
                shape[d], mesh.size(i), coordinate[i], placement, held.get(d), tensor.shape[d], False))
    return shape, held


def consecutive_runs(values: Sequence[int]) -> list[tuple[int, int, int]]:
    """The maximal runs of consecutive integers in ``values`` (each one more than the one before it), in order:
    ``[(index of the run's first value, its first value, its length)]``; a rank's held indices or positions as
    blocks."""
    runs: list[tuple[int, int, int]] = []
    for i, value in enumerate(values):
        if runs and runs[-1][1] + runs[-1][2] == value:
            start, first, n = runs[-1]
            runs[-1] = (start, first, n + 1)
        else:
            runs.append((i, value, 1))
    return runs


def local_region(tensor: torch.Tensor) -> tuple[torch.Tensor, Box]:
    """This rank's local tensor of ``tensor`` and the global ``[start, stop)`` it holds on each dim; a layout whose
    local indices on some dim are not one block of the global tensor raises :class:`LoadError`."""
    if not isinstance(tensor, DTensor):
        return tensor, tuple((0, n) for n in tensor.shape)
    shape, held = held_indices(tensor)
    local = tensor.to_local()
    if tuple(local.shape) != tuple(shape):
        raise LoadError(f"local shard of shape {tuple(local.shape)} where the placements {tensor.placements} give "
                        f"{tuple(shape)}: a layout the loader does not understand")
    region = []
    for d, n in enumerate(shape):
        index = held.get(d)
        start = int(index[0]) if index is not None else 0
        if n and index is not None and not torch.equal(index, torch.arange(start, start + n)):
            raise LoadError(f"the placements {tensor.placements} give this rank the global indices "
                            f"{index.tolist()[:8]}… on dim {d} of {tuple(tensor.shape)}, not one block: a layout the "
                            "loader does not understand")
        region.append((start, start + n))
    return local, tuple(region)
