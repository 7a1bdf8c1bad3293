"""The global-batch loss: what ``model(..., labels=...)`` returns on a parallelized model.

Every rank trains on its own micro-batch and FSDP averages the gradients over the ``W`` ranks of the world. For the
gradients to be those of the mean over *all* valid targets of *all* ranks (whatever each rank holds: padding,
``-100`` prompt masks, packed documents, a rank with none), each rank's loss must be ``W · (sum of its targets'
cross-entropies) / N`` with ``N`` the number of valid targets over the world. :func:`install_global_loss` puts that
normaliser into the model's forward as transformers' own ``num_items_in_batch`` (every causal LM hands it to its
``loss_function``, which divides the sum by it), so transformers' loss and xpar_zoo's fused loss both honour it.

- ``N`` is counted on each rank and summed by one all-reduce of a scalar per forward (no host sync).
- ``num_items_in_batch=N`` given by the caller is that global count already: the valid targets over all ranks
  *and* all micro-batches of an optimizer step, so gradient accumulation is exact as well.
- ``out.loss`` on a rank is its share ``W · sum_r / N``; the mean of ``out.loss`` over the ranks is the global-batch
  mean loss. A batch without any valid target gives 0 (not NaN).
- A router auxiliary loss (``output_router_logits=True``) is the model's own, computed on each rank's micro-batch
  and added unscaled: its gradient is the mean over ranks of the per-rank auxiliary losses' gradients, as in DDP.
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


def install_global_loss(model: nn.Module, world_size: int) -> None:
    """Wrap ``model.forward`` so that with labels every rank's loss is its share of the global-batch mean (see the
    module docstring): ``num_items_in_batch`` becomes ``N / world_size``, ``N`` counted over the world unless the
    caller passes it."""
    original = model.forward
    signature = inspect.signature(original)

    @functools.wraps(original)
    def forward(*args, **kwargs):
        bound = signature.bind_partial(*args, **kwargs).arguments
        extra = bound.get("kwargs", {})
        labels = bound.get("labels")
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

    model.forward = forward
