"""Autograd-aware collectives used by the extra-plan forwards (EP dispatch/combine, vocab-parallel lookups)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def to_local(t: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a DTensor (a plain tensor unchanged)."""
    return t.to_local() if isinstance(t, DTensor) else t


def all_to_all_counts(counts: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Exchange a ``[size, ...]`` integer tensor: row ``i`` goes to rank ``i`` of ``group``; returns the rows received."""
    out = torch.empty_like(counts)
    dist.all_to_all_single(out, counts.contiguous(), group=group)
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
        ctx.group, ctx.out_splits, ctx.in_splits = group, out_splits, in_splits
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        back = grad.new_empty((sum(ctx.in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), ctx.in_splits, ctx.out_splits, group=ctx.group)
        return back, None, None, None


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """Rows ``x[sum(in_splits[:i]) : …+in_splits[i]]`` go to rank ``i``; returns the rows received, by source rank.
    Differentiable: the backward sends gradients back along the same routes."""
    return _AllToAll.apply(x, list(out_splits), list(in_splits), group)
