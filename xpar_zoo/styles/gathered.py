"""The ``gathered`` style: a storage-only dim-0 split for any module (the generic forward of user-named plans).

Each rank stores its ``rows`` of the planned parameters (FSDP2 shards them further, on dim 0 or 1); the module's own
forward sees the full parameters, all-gathered over the plan group, and the gradients are summed back onto the owners'
rows. The memory of a dim-0 split, the compute of the original module.
"""

from __future__ import annotations

import types

import torch
import torch.distributed as dist
from torch import nn

from ..compat import parameter_slots
from ..parallel.collectives import to_local
from ..parallel.mesh import PlanShard


class _AllGatherDim0(torch.autograd.Function):
    # Ours, not torch.distributed.nn's all-gather: its backward refuses gloo ("Backend not supported!").
    @staticmethod
    def forward(ctx, local: torch.Tensor, shard: PlanShard) -> torch.Tensor:
        ctx.shard = shard
        out = local.new_empty((shard.size * local.shape[0], *local.shape[1:]))
        dist.all_gather_single(out, local.contiguous(), group=shard.group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        shard = ctx.shard
        out = grad.new_empty((grad.shape[0] // shard.size, *grad.shape[1:]))
        dist.reduce_scatter_single(out, grad.contiguous(), group=shard.group)
        return out, None


def _gathered_forward(self: nn.Module, *args, **kwargs):
    shard: PlanShard = self._xpar_gathered
    slots = parameter_slots(self)
    saved = {name: slots[name] for name in self._xpar_gathered_params}
    try:
        for name, param in saved.items():
            # Each rank's gradient comes from its own micro-batch: the backward sums over the group, which a
            # DTensor redistribute (that assumes replicated gradients) would not.
            slots[name] = _AllGatherDim0.apply(to_local(param), shard)
        return self._xpar_gathered_forward(*args, **kwargs)
    finally:
        for name, param in saved.items():
            slots[name] = param


def install_gathered(module: nn.Module, params: tuple[str, ...], shard: PlanShard) -> None:
    """Make ``module`` compute with its full ``params`` (all-gathered over the plan group in its forward; gradients
    summed back to the owners' rows) while each rank stores only its dim-0 slice. Works for any module."""
    module._xpar_gathered = shard
    module._xpar_gathered_params = tuple(params)
    module._xpar_gathered_forward = module.forward
    module.forward = types.MethodType(_gathered_forward, module)
