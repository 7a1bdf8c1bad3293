"""The global-batch loss: what ``model(..., labels=...)`` returns on a parallelized model.

:func:`install_global_loss` makes each rank's loss ``W · (sum of its targets' cross-entropies) / N``, with ``N``
the valid targets over the world (counted by one all-reduce per forward, passed as transformers' own
``num_items_in_batch``): the mean of ``out.loss`` over the ranks is the global-batch mean, and after ``backward``
the gradients are exactly its gradients. A caller's ``num_items_in_batch`` is taken as that global count already
(all ranks and all micro-batches of a step: exact accumulation); :func:`count_targets` and :func:`global_count`
compute it. A batch without a valid target gives 0. Why: ``docs/design.md``, "The global-batch loss".
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.distributed as dist
from torch import nn

IGNORE_INDEX = -100


def count_targets(labels: torch.Tensor | None = None, *, shift_labels: torch.Tensor | None = None,
                  ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """The number of valid targets (an int64 tensor on the labels' device) of a causal-LM batch, as transformers'
    ``ForCausalLMLoss`` counts them: ``shift_labels`` when given, else ``labels`` shifted by one position."""
    targets = shift_labels if shift_labels is not None else labels[..., 1:]
    return (targets != ignore_index).sum()


def global_count(local: torch.Tensor | int, device: torch.device | str | None = None) -> torch.Tensor:
    """``local`` (a count on this rank) summed over every rank of the default process group, as an fp32 tensor: one
    all-reduce, no host sync. A collective."""
    total = torch.as_tensor(local, device=device).to(torch.float32).reshape(())
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        total = total.clone()
        dist.all_reduce(total)
    return total


def wrap_forward(model: nn.Module, around) -> None:
    """Replace ``model.forward`` with ``around(original, labels, extra, args, kwargs)``, where ``labels`` and
    ``extra`` (the ``**kwargs`` transformers passes on to the loss) are read from the call by the original's
    signature, however they were passed."""
    original = model.forward
    signature = inspect.signature(original)

    @functools.wraps(original)
    def forward(*args, **kwargs):
        bound = signature.bind_partial(*args, **kwargs).arguments
        return around(original, bound.get("labels"), bound.get("kwargs", {}), args, kwargs)

    model.forward = forward


def install_global_loss(model: nn.Module, world_size: int) -> None:
    """Wrap ``model.forward`` so that with labels every rank's loss is its share of the global-batch mean (see the
    module docstring): ``num_items_in_batch`` becomes ``N / world_size``, ``N`` counted over the world unless the
    caller passes it."""

    def forward(original, labels, extra, args, kwargs):
        if labels is not None:
            items = extra.get("num_items_in_batch")
            if items is None:
                local = count_targets(labels, shift_labels=extra.get("shift_labels"),
                                      ignore_index=extra.get("ignore_index", IGNORE_INDEX))
                items = global_count(local)
            elif not torch.is_tensor(items):
                items = torch.tensor(float(items), device=labels.device)
            kwargs["num_items_in_batch"] = items.to(device=labels.device, dtype=torch.float32).clamp_min(1) / world_size
        return original(*args, **kwargs)

    wrap_forward(model, forward)
