"""accelerate with xpar_zoo models.

:func:`~xpar_zoo.parallelize` marks the model as already prepared, so ``accelerator.prepare(model, optimizer,
dataloader)`` hands the model back as it is (no DDP, no second sharding) and prepares the optimizer and the data
loader as usual. In the loop use ``xpar_zoo.clip_grad_norm_`` and ``xpar_zoo.save_checkpoint`` /
``load_checkpoint`` instead of accelerate's, pass ``num_items_in_batch`` for exact accumulation (accelerate's own at
1), and autocast with ``with accelerator.autocast():`` or choose the precision at load. :func:`check_accelerator`
refuses the settings that would not train such a model exactly. Why: ``docs/design.md``, "Integrations".
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from ..errors import IntegrationError

# accelerate's distributed types that shard or wrap the model themselves (by name: accelerate is optional here)
_SHARDING_TYPES = ("FSDP", "DEEPSPEED", "MEGATRON_LM", "XLA")


def check_accelerator(accelerator: Any) -> None:
    """Raise :class:`~xpar_zoo.errors.IntegrationError` when ``accelerator`` (an ``accelerate.Accelerator``) is set up
    in a way that would not train an xpar_zoo model exactly: a distributed type that shards or wraps the model
    itself (FSDP, DeepSpeed, Megatron-LM, XLA), tensor/context/sequence parallelism, fp16 loss scaling, or fewer
    processes than ``torch.distributed`` has (a CPU job started without ``ACCELERATE_USE_CPU=true`` or
    ``use_cpu=True``: every rank would think it trains alone)."""
    kind = str(accelerator.distributed_type).rsplit(".", 1)[-1]
    if kind in _SHARDING_TYPES:
        raise IntegrationError(
            f"accelerate is set up for {kind}, which shards or wraps the model itself; an xpar_zoo model is sharded "
            "already (FSDP2 and its plans): launch with a multi-GPU config (examples/accelerate/gpu.yaml, or "
            "examples/accelerate/cpu.yaml with ACCELERATE_USE_CPU=true on CPU) or plain torchrun")
    config = getattr(accelerator, "parallelism_config", None)
    if config is not None:
        enabled = [name for name in ("tp", "cp", "sp") if getattr(config, f"{name}_enabled", False)]
        if enabled:
            raise IntegrationError(f"accelerate's parallelism_config enables {', '.join(enabled)}; an xpar_zoo model "
                                   "brings its own parallelism (xpar_zoo.Mesh): leave parallelism_config unset")
    if getattr(accelerator, "scaler", None) is not None:
        raise IntegrationError(
            "fp16 mixed precision scales the loss (a GradScaler), which xpar_zoo's clip and checkpoints do not "
            "unscale: use bf16, or choose the precision at load (from_pretrained(dtype=...), "
            "parallelize(..., mixed_precision=True))")
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if accelerator.num_processes != world:
        raise IntegrationError(
            f"accelerate sees {accelerator.num_processes} process(es) but torch.distributed has {world}: on CPU "
            "start with ACCELERATE_USE_CPU=true (or TrainingArguments(use_cpu=True)), so that accelerate uses the "
            "gloo process group instead of training every rank alone")
