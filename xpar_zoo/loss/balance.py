"""MoE load during training: tokens per expert, the router auxiliary loss over the global batch, and the
auxiliary-loss-free bias update.

- :class:`ExpertLoad` counts, per MoE layer, the tokens each expert received during an optimizer step (a forward
  pre-hook on every fused experts module, reading the routing the model computed); :meth:`ExpertLoad.take` sums
  the counts over the ranks.
- :func:`global_router_aux_loss`: transformers' ``load_balancing_loss_func`` over every rank's tokens of the
  micro-batch, returned as this rank's share.
- :func:`update_correction_biases`: ``bias += rate · sign(mean load − load)`` for routers with an
  ``e_score_correction_bias`` (DeepSeek-V3, GLM-4-MoE), from the global counts.

Design: ``docs/design.md``, "Training".
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist
from torch import nn

from ..errors import TrainConfigError
from ..zoo.plan import is_fused_experts


def fused_experts_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every fused experts module (a 3-D ``down_proj``), in forward order."""
    return [(n, m) for n, m in model.named_modules() if is_fused_experts(m)]


def layer_index(name: str, default: int) -> int:
    """The decoder layer number in a module name (``model.layers.3.mlp.experts`` → 3)."""
    found = re.search(r"(?:^|\.)layers\.(\d+)\.", name)
    return int(found.group(1)) if found else default


class ExpertLoad:
    """Per MoE layer, the tokens routed to each expert during the model's forwards since the last :meth:`take`."""

    def __init__(self, model: nn.Module, device: torch.device):
        self.modules = fused_experts_modules(model)
        self.layers = [layer_index(n, i) for i, (n, _) in enumerate(self.modules)]
        self.num_experts = [int(m.down_proj.shape[0]) for _, m in self.modules]  # global shape (DTensor)
        self.counts = [torch.zeros(e, dtype=torch.int64, device=device) for e in self.num_experts]
        self._counting = False
        self._handles = [m.register_forward_pre_hook(self._hook(i)) for i, (_, m) in enumerate(self.modules)]
        if self.modules:
            self._handles.append(model.register_forward_pre_hook(lambda *_: self._set(True)))
            self._handles.append(model.register_forward_hook(lambda *_: self._set(False)))

    def _set(self, on: bool) -> None:
        self._counting = on

    def _hook(self, i: int):
        def count(module, args):
            if self._counting and len(args) >= 2:
                index = args[1].reshape(-1)
                self.counts[i].index_add_(0, index, torch.ones_like(index))
        return count

    def __bool__(self) -> bool:
        return bool(self.modules)

    def take(self) -> torch.Tensor | None:
        """The counts since the last call summed over every rank: ``[layers, experts]`` int64 (identical on every
        rank), or ``None`` for a model without fused experts; resets them. A collective."""
        if not self.modules or len(set(self.num_experts)) != 1:
            if self.modules:
                raise TrainConfigError(f"MoE layers with different expert counts {sorted(set(self.num_experts))}")
            return None
        total = torch.stack(self.counts)
        for c in self.counts:
            c.zero_()
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(total)
        return total

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def load_summary(layers: list[int], counts: torch.Tensor) -> list[dict]:
    """``[{"layer", "tokens", "max_over_mean"}]`` for the metrics."""
    out = []
    for layer, row in zip(layers, counts.tolist()):
        mean = sum(row) / len(row)
        out.append({"layer": layer, "tokens": row, "max_over_mean": max(row) / mean if mean else 0.0})
    return out


def aux_loss_terms(router_logits: tuple[torch.Tensor, ...], num_experts: int, top_k: int,
                   attention_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's part of transformers' ``load_balancing_loss_func``: top-k assignments per expert and summed
    router probabilities over all MoE layers' rows, and the number of rows; with ``attention_mask`` (``[batch,
    seq]``, one router row per token) only its tokens count, as transformers weighs them."""
    device = router_logits[0].device
    counts = torch.zeros(num_experts, dtype=torch.float32, device=device)
    probs = torch.zeros(num_experts, dtype=torch.float32, device=device)
    weight = None if attention_mask is None else attention_mask.reshape(-1, 1).to(device, torch.float32)
    rows = torch.zeros((), dtype=torch.float32, device=device)
    for logits in router_logits:
        p = torch.softmax(logits.float(), dim=-1)
        chosen = torch.topk(p, top_k, dim=-1).indices
        ones = torch.ones_like(chosen, dtype=torch.float32) if weight is None else weight.expand_as(chosen)
        counts = counts.index_add(0, chosen.reshape(-1), ones.reshape(-1))
        probs = probs + (p if weight is None else p * weight).sum(dim=0)
        rows = rows + (p.shape[0] if weight is None else weight.sum())
    return counts, probs, rows


def global_router_aux_loss(router_logits: tuple[torch.Tensor, ...], num_experts: int, top_k: int,
                           attention_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(share, local)``: this rank's share of the load-balancing loss over every rank's tokens (differentiable;
    the mean of the shares over the ranks is the global loss), and the loss of this rank's tokens alone (detached,
    what transformers computes per rank); ``attention_mask`` as in :func:`aux_loss_terms`. A collective."""
    counts, probs, rows = aux_loss_terms(router_logits, num_experts, top_k, attention_mask)
    local = num_experts * torch.sum((counts / rows) * (probs.detach() / rows))
    world = dist.get_world_size() if dist.is_initialized() else 1
    totals = torch.cat([counts, rows.reshape(1)])
    if world > 1:
        totals = totals.clone()
        dist.all_reduce(totals)
    fractions, all_rows = totals[:-1] / totals[-1], totals[-1]
    share = num_experts * world * torch.sum(fractions * probs / all_rows)
    return share, local


def correction_biases(model: nn.Module, load: ExpertLoad) -> list[tuple[int, torch.Tensor]]:
    """``(index into load's layers, bias buffer)`` of every router with an ``e_score_correction_bias``, matched to
    the experts module beside it (the same parent module)."""
    parents = {n.rpartition(".")[0]: i for i, (n, _) in enumerate(load.modules)}
    found = []
    for name, module in model.named_modules():
        bias = getattr(module, "e_score_correction_bias", None)
        if isinstance(bias, torch.Tensor):
            parent = name.rpartition(".")[0]
            if parent not in parents:
                raise TrainConfigError(f"{name}.e_score_correction_bias has no fused experts module beside it "
                                       f"(under {parent or 'the model'}); cannot update it from the expert load")
            found.append((parents[parent], bias))
    return found


@torch.no_grad()
def update_correction_biases(biases: list[tuple[int, torch.Tensor]], counts: torch.Tensor, rate: float) -> None:
    """``bias += rate · sign(mean load − load)`` per layer, from ``counts`` ``[layers, experts]`` (global)."""
    for i, bias in biases:
        load = counts[i].to(torch.float32)
        step = torch.sign(load.mean() - load) * rate
        bias.add_(step.to(device=bias.device, dtype=bias.dtype))
