"""The router auxiliary loss over the global batch, for ``xpar-zoo train`` and the Trainer integration:
transformers' Switch-Transformer load-balancing term computed from every rank's tokens
(:func:`xpar_zoo.loss.balance.global_router_aux_loss`). ``xpar-zoo train`` adds each micro-batch's share and switches
the model's own per-rank term off, checked equal to ours once (:func:`router_aux`); the Trainer keeps the model's
coefficient and swaps its per-rank term for the share (:func:`model_router_aux`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..errors import TrainConfigError
from ..loss.balance import global_router_aux_loss
from .config import TrainConfig

AUX_CHECK_RTOL = 1e-4


@dataclass
class RouterAux:
    """The router auxiliary loss the run adds over the global batch: its coefficient and the model's sizes."""

    coef: float
    num_experts: int
    top_k: int
    checked: bool = False

    def share(self, router_logits: tuple[torch.Tensor, ...], attention_mask: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(share, local)``: this rank's share of the load-balancing loss over every rank's tokens (differentiable,
        unscaled) and the loss of its own tokens alone (detached); ``attention_mask``: padding not counted. A
        collective."""
        return global_router_aux_loss(router_logits, self.num_experts, self.top_k, attention_mask)

    def add(self, out, loss: torch.Tensor, micro_batches: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``loss`` of one of the step's ``micro_batches`` (``out``: the model's output, with router logits) plus its
        share of the global-batch auxiliary loss, and that share (detached, fp64) for the step's ``aux_loss``. The
        first call checks our per-rank term against the model's own (a collective)."""
        share, local = self.share(out.router_logits)
        if not self.checked:
            _check_aux(self, local, out.aux_loss)
        return loss + share * (self.coef / micro_batches), share.detach().double() / micro_batches


def router_aux(model: nn.Module, cfg: TrainConfig) -> RouterAux | None:
    """The router auxiliary loss to add (``None``: off). transformers' own per-rank term is switched off on the
    model (its coefficient set to 0) so that only the global-batch term trains."""
    config = model.config
    coef = cfg.router_aux_loss_coef
    if coef is None:
        coef = getattr(config, "router_aux_loss_coef", 0.0) if getattr(config, "output_router_logits", False) else 0.0
    if not coef:
        return None
    missing = [a for a in ("router_aux_loss_coef", "num_experts", "num_experts_per_tok") if not hasattr(model, a)]
    if missing:
        raise TrainConfigError(f"{type(model).__name__} has no router auxiliary loss (no {', '.join(missing)}); "
                               "leave --router-aux-loss-coef unset")
    model.router_aux_loss_coef = 0.0
    return RouterAux(float(coef), int(model.num_experts), int(model.num_experts_per_tok))


def model_router_aux(model: nn.Module) -> RouterAux:
    """The router auxiliary loss as ``model`` adds it itself: its text config's ``router_aux_loss_coef`` (0 when
    unset) and its expert counts; not checked against the model's term (the Trainer replaces that term)."""
    coef = getattr(model.config.get_text_config(), "router_aux_loss_coef", 0.0) or 0.0
    return RouterAux(float(coef), int(model.num_experts), int(model.num_experts_per_tok), checked=True)


def _check_aux(aux: RouterAux, local: torch.Tensor, model_aux: torch.Tensor) -> None:
    """Once per run: our per-rank term equals the model's own, so the global version computes the model's loss."""
    err = ((local - model_aux.detach().float()).abs() / model_aux.detach().float().abs().clamp_min(1e-12)).reshape(1)
    if dist.get_world_size() > 1:
        dist.all_reduce(err, op=dist.ReduceOp.MAX)
    if err.item() > AUX_CHECK_RTOL:
        raise TrainConfigError(f"this model's router auxiliary loss is not transformers' Switch-Transformer form "
                               f"(relative difference {err.item():.2e}); train it without (--router-aux-loss-coef 0)")
    aux.checked = True
