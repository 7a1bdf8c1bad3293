"""Gradient clipping over parameters that live on different meshes (dense FSDP, and one mesh per extra plan).

Each rank's local pieces are grouped by how many ranks hold them, device and dtype, and each group is measured
(``torch.nn.utils.get_total_norm``) and scaled (foreach ``mul_``) in one batched call, as torch's own
``clip_grad_norm_`` does for one device; one all-reduce combines the groups of every rank."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.nn.utils import get_total_norm

from ..compat import foreach_mul_
from ..errors import NonFiniteError
from .collectives import to_local
from .distributed import all_gather


def _copies(g: torch.Tensor) -> int:
    """How many ranks hold this rank's piece of ``g`` (the product of its Replicate mesh dims)."""
    if not isinstance(g, DTensor):
        return dist.get_world_size() if dist.is_initialized() else 1
    return math.prod(g.device_mesh.size(i) for i, p in enumerate(g.placements) if isinstance(p, Replicate))


@torch.no_grad()  # as torch's own: DTensor.to_local is then a plain attribute read, not an autograd function
def clip_grad_norm_(
    model_or_params: nn.Module | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
) -> torch.Tensor:
    """Clip gradients in place by their total norm over *all* parameters, as single-process training would, and
    return that norm. Works across meshes: each rank adds up its local pieces (a replicated piece counts once over
    its copies) and one all-reduce over the world combines them. A collective: every rank must call it.

    Non-finite norms follow ``torch.nn.utils.clip_grad_norm_``: by default the gradients are scaled by the
    non-finite norm (and become NaN); with ``error_if_nonfinite=True`` a :class:`~xpar_zoo.errors.NonFiniteError`
    (a ``RuntimeError``, as torch raises) is raised on every rank before any gradient changes, naming the
    parameters whose gradients hold NaN or inf on each rank."""
    named: list[tuple[str, torch.Tensor]]
    if isinstance(model_or_params, nn.Module):
        named = [(n, p) for n, p in model_or_params.named_parameters() if p.grad is not None]
    else:
        named = [(f"parameter #{i}", p) for i, p in enumerate(model_or_params) if p.grad is not None]
    grads = [g for _, p in named if (g := p.grad) is not None]  # every one: named holds those with a gradient
    norm_type = float(norm_type)
    device = to_local(grads[0]).device if grads else torch.device("cpu")
    groups = _local_groups(grads)
    acc = torch.zeros((), dtype=torch.float32, device=device)
    for (copies, _, dtype), pieces in groups.items():
        # in fp32, as single-process torch would for fp32 gradients (bf16 ones are measured after an fp32 copy)
        norm = get_total_norm(pieces if dtype == torch.float32 else [t.float() for t in pieces], norm_type)
        norm = norm.to(device, torch.float32)
        acc = torch.maximum(acc, norm) if math.isinf(norm_type) else acc + norm ** norm_type / copies
    if dist.is_initialized():
        dist.all_reduce(acc, op=dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM)
    total = acc if math.isinf(norm_type) else acc ** (1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(total):  # the same on every rank: total is all-reduced
        _raise_nonfinite(total, norm_type, [n for (n, _), g in zip(named, grads)
                                            if not bool(torch.isfinite(to_local(g)).all())])
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for (_, piece_device, dtype), pieces in groups.items():
        foreach_mul_(pieces, coef.to(piece_device, dtype))  # one batched kernel per group (CPU: a loop)
    return total


def _local_groups(grads: list[torch.Tensor]) -> dict[tuple[int, torch.device, torch.dtype], list[torch.Tensor]]:
    """This rank's non-empty pieces of ``grads`` by ``(copies, device, dtype)``: how many ranks hold each piece (a
    replicated piece counts once over its copies), and what one batched kernel can take."""
    groups: dict[tuple[int, torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
    for g in grads:
        local = to_local(g).detach()
        if local.numel():
            groups[_copies(g), local.device, local.dtype].append(local)
    return groups


def _raise_nonfinite(total: torch.Tensor, norm_type: float, local_names: list[str]) -> None:
    """Raise :class:`NonFiniteError` on every rank, naming each rank's parameters with non-finite gradients."""
    per_rank = all_gather(local_names)
    where = "; ".join(f"{', '.join(names[:8])}{f' … and {len(names) - 8} more' if len(names) > 8 else ''}"
                      + (f" (rank {r})" if len(per_rank) > 1 else "") for r, names in enumerate(per_rank) if names)
    raise NonFiniteError(f"the total norm of order {norm_type:g} of the gradients is non-finite ({total.item()}), "
                         "so they cannot be clipped: non-finite gradients in "
                         f"{where or 'no single tensor (their sum overflowed)'}; set error_if_nonfinite=False to "
                         "scale them by the non-finite norm anyway (as torch does)")
