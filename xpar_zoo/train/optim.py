"""The optimizer and the learning-rate schedule of ``xpar-zoo train``: AdamW with weight decay on matrices only,
warmup then transformers' schedules (:func:`lr_factor`), and this run's settings on an optimizer loaded from a
checkpoint."""

from __future__ import annotations

import functools
import math

import torch
from torch import nn

from .config import TrainConfig


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW; weight decay on matrices only (not on norms, biases or other vectors)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    rest = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=cfg.lr, betas=cfg.adam_betas)


def lr_factor(cfg: TrainConfig, done: int) -> float:
    """The learning rate of step ``done + 1`` as a fraction of ``cfg.lr`` (``done`` steps finished). Warmup:
    step ``k`` ≤ ``warmup`` trains at ``k / warmup`` (step 1 at ``lr / warmup``, never at 0); after it,
    transformers' schedules over the remaining steps (cosine down to ``min_lr_ratio``, linear to 0, constant)."""
    if done < cfg.warmup:
        return (done + 1) / cfg.warmup
    if cfg.schedule == "constant":
        return 1.0
    progress = (done - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    if cfg.schedule == "linear":
        return max(0.0, 1.0 - progress)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cosine


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig, done: int = 0):
    """The schedule of :func:`lr_factor` over ``cfg.steps`` steps, positioned after ``done`` steps (a resumed run:
    ``cfg.lr`` and the schedule settings are this run's, whatever the checkpoint's were)."""
    for group in optimizer.param_groups:
        group["lr"] = group["initial_lr"] = cfg.lr
    return torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(lr_factor, cfg), last_epoch=done - 1)


def apply_optimizer_settings(optimizer: torch.optim.Optimizer, cfg: TrainConfig) -> None:
    """This run's weight decay (matrices' group) and betas on an optimizer whose state was loaded from a
    checkpoint (loading restores the saved hyperparameters)."""
    for group in optimizer.param_groups:
        if all(p.dim() >= 2 for p in group["params"]):  # the matrices' group (build_optimizer)
            group["weight_decay"] = cfg.weight_decay
        group["betas"] = tuple(cfg.adam_betas)
