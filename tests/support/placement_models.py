"""The models and plans of the FSDP placement tests, shared by the unit rule tests and the launched placements."""

import torch
from torch import nn

from xpar_zoo import ExtraPlan, get_plan

WORLD = 4
DIM1 = dict(num_experts=6, vocab_size=126)  # slices of 3 experts / 63 rows: odd over 2 FSDP ranks
EXPERTS = "model.layers.0.mlp.experts"
EMB, HEAD = "model.embed_tokens.weight", "lm_head.weight"
O_PROJ = "model.layers.0.self_attn.o_proj"
RANK = 6  # the low-rank update's rank: its ``down`` [6, in] splits into 3 rows per rank of a plan of size 2


class LowRankLinear(nn.Module):
    """A linear layer plus a rank-``RANK`` update (as LoRA adds one): under a plan of size 2 on 4 ranks, ``weight``
    [32, 32] and ``up`` [32, 6] keep 16 rows per rank (dim 0 over 2 FSDP ranks) and ``down`` [6, 32] 3 (dim 1): one
    FSDP unit whose tensors are sharded on different dims."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.weight = linear.weight
        self.down = nn.Parameter(0.1 * torch.randn(RANK, linear.in_features))
        self.up = nn.Parameter(0.1 * torch.randn(linear.out_features, RANK))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight) + nn.functional.linear(nn.functional.linear(x, self.down), self.up)


def with_low_rank(model: nn.Module) -> nn.Module:
    """Every decoder layer's ``o_proj`` as a :class:`LowRankLinear` (the same on every rank: seeded)."""
    torch.manual_seed(1)
    for layer in model.model.layers:
        layer.self_attn.o_proj = LowRankLinear(layer.self_attn.o_proj)
    return model


LOW_RANK_PLAN = get_plan("qwen3_moe").with_extra("lowrank", ExtraPlan(
    params=tuple(f"model.layers.*.self_attn.o_proj.{p}" for p in ("weight", "down", "up")), style="gathered"))
