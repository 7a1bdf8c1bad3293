"""transformers' Trainer and accelerate, in one process: the router aux loss over padded rows equals transformers', and
models or settings the integration cannot train right are refused."""

import types

import pytest
import torch

from xpar_zoo.errors import IntegrationError
from xpar_zoo.integrations.accelerate import check_accelerator
from xpar_zoo.testing import parity

AUX = dict(output_router_logits=True, router_aux_loss_coef=0.1)  # the router auxiliary loss trains too



def _config(**overrides):
    return parity.tiny_config("qwen3_moe", **{**AUX, **overrides})



def test_router_aux_loss_over_padded_rows_equals_transformers():
    """The global router auxiliary loss weighs rows by the attention mask as transformers does (padding excluded)."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import (
        load_balancing_loss_func,
    )

    from xpar_zoo.loss.balance import global_router_aux_loss

    g = torch.Generator().manual_seed(0)
    logits = tuple(torch.randn(3 * 7, 8, generator=g) for _ in range(2))  # 2 layers, batch 3 x seq 7, 8 experts
    mask = (torch.arange(7) < torch.tensor([[7], [4], [1]])).long()
    share, _ = global_router_aux_loss(logits, 8, 2, mask)
    assert share.item() == pytest.approx(load_balancing_loss_func(logits, 8, 2, mask).item(), rel=1e-6)
    assert share.item() != pytest.approx(load_balancing_loss_func(logits, 8, 2).item(), rel=1e-3)


def test_trainer_refuses_a_model_xpar_zoo_did_not_parallelize():
    from xpar_zoo.integrations.trainer import XparTrainer

    with pytest.raises(IntegrationError, match="trains xpar_zoo models.*Qwen3MoeForCausalLM"):
        XparTrainer(model=parity.build_model(_config()))


@pytest.mark.parametrize("settings, message", [
    (dict(distributed_type="DistributedType.FSDP"), "set up for FSDP"),
    (dict(distributed_type="DistributedType.DEEPSPEED"), "set up for DEEPSPEED"),
    (dict(parallelism_config=types.SimpleNamespace(tp_enabled=True, cp_enabled=False, sp_enabled=False)),
     "enables tp"),
    (dict(scaler=object()), "fp16 mixed precision scales the loss"),
])
def test_check_accelerator_refuses_settings_that_would_wrap_or_scale(settings, message):
    accelerator = types.SimpleNamespace(**{"distributed_type": "DistributedType.MULTI_CPU", "num_processes": 1,
                                           "parallelism_config": None, "scaler": None, **settings})
    with pytest.raises(IntegrationError, match=message):
        check_accelerator(accelerator)
