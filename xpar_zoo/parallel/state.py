"""Whole-model views of a parallelized model."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from .distributed import exact_gathers


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Rank 0 gets ``{in-memory HF name: full CPU tensor}`` at global shapes (every expert, every vocab row);
    other ranks get ``{}``. A collective: every rank must call it."""
    with exact_gathers():
        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
