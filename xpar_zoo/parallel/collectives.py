"""Collectives of the extra-plan forwards (EP dispatch/combine, vocab-parallel lookups and head), with autograd where
they carry activations."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

if TYPE_CHECKING:
    from .mesh import PlanShard


def to_local(t: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a DTensor (a plain tensor unchanged)."""
    return t.to_local() if isinstance(t, DTensor) else t


def all_to_all_counts(counts: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Exchange a ``[size, ...]`` integer tensor: row ``i`` goes to rank ``i`` of ``group`` (``None``: the default
    group, as in ``torch.distributed``); returns the rows received."""
    out = torch.empty_like(counts)
    dist.all_to_all_single(out, counts.contiguous(), group=group)
    return out


class _AllToAll(torch.autograd.Function):
    # Ours: torch.distributed.nn.functional.all_to_all_single (the same, with autograd) is deprecated in torch 2.13
    # in favour of the private _functional_collectives module.
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


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup | None
               ) -> torch.Tensor:
    """Rows ``x[sum(in_splits[:i]) : …+in_splits[i]]`` go to rank ``i`` of ``group`` (``None``: the default group);
    returns the rows received, by source rank.
    Differentiable: the backward sends gradients back along the same routes."""
    return _AllToAll.apply(x, list(out_splits), list(in_splits), group)


# ---- over a plan group whose ranks hold different numbers of rows (the vocab-parallel head) --------------------

def group_row_counts(n: int, shard: PlanShard, device: torch.device) -> list[int]:
    """Every group rank's row count (this rank has ``n``), in group rank order; one host sync."""
    if shard.size == 1:
        return [n]
    counts = torch.zeros(shard.size, dtype=torch.int64, device=device)
    out = torch.empty_like(counts)
    counts[:] = n
    dist.all_to_all_single(out, counts, group=shard.group)
    return out.tolist()


def gather_rows(x: torch.Tensor, counts: list[int], shard: PlanShard) -> torch.Tensor:
    """``cat`` of every group rank's ``x`` (``counts[q]`` rows from rank ``q``), on every rank."""
    if shard.size == 1:
        return x
    n = x.shape[0]
    send = x.unsqueeze(0).expand(shard.size, *x.shape).reshape(shard.size * n, *x.shape[1:])
    out = x.new_empty((sum(counts), *x.shape[1:]))
    dist.all_to_all_single(out, send.contiguous(), counts, [n] * shard.size, group=shard.group)
    return out


def scatter_sum_rows(y: torch.Tensor, counts: list[int], shard: PlanShard) -> torch.Tensor:
    """The transpose of :func:`gather_rows`: rank ``r`` gets the group-wide sum of the ``counts[r]`` rows it owns."""
    if shard.size == 1:
        return y
    n = counts[shard.rank]
    out = y.new_empty((shard.size * n, *y.shape[1:]))
    dist.all_to_all_single(out, y.contiguous(), [n] * shard.size, counts, group=shard.group)
    return out.view(shard.size, n, *y.shape[1:]).sum(0)


class GatherRows(torch.autograd.Function):
    """:func:`gather_rows` with autograd: the backward is :func:`scatter_sum_rows`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, counts: list[int], shard: PlanShard) -> torch.Tensor:
        ctx.counts, ctx.shard = counts, shard
        return gather_rows(x, counts, shard)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return scatter_sum_rows(grad, ctx.counts, ctx.shard), None, None
