"""TRL's ``GRPOTrainer`` for xpar_zoo models.

    from xpar_zoo.integrations.grpo import XparGRPOTrainer
    trainer = XparGRPOTrainer(model=policy, reward_funcs=[reward], args=GRPOConfig(...), train_dataset=prompts,
                              processing_class=tokenizer)

Every rank builds the trainer and trains. Completions come from transformers' ``generate`` on the sharded model on
every rank (the ranks stay in step), or from vLLM: there TRL's weight sync (colocate ``load_weights``, server
``update_named_params``) reads :func:`xpar_zoo.iter_hub_weights` — hub names and full tensors a bucket at a time,
fused experts per expert — instead of gathering parameters one by one under their in-memory names. TRL gathers the
rewards over the world before it computes each group's advantages (a prompt's completions may sit on several
ranks), and its loss normalisations count over the world; FSDP averages the ranks' gradients as DDP would. Options
that cannot hold under xpar_zoo are refused in one line before any work (:func:`check_grpo_args`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from trl import GRPOTrainer

from ..compat import stream_vllm_weights
from ..errors import IntegrationError
from ..hub.weights_stream import iter_hub_weights
from ..parallel.state import parallelized_module
from ..styles.sequence import data_shard
from .trainer import XparTrainerMixin, is_peft_model

VLLM_BUCKET_BYTES = 512 << 20  # the weight-sync buckets: one is gathered at a time


def check_grpo_args(model: nn.Module, args: Any) -> None:
    """Raise :class:`IntegrationError` for GRPO options an xpar_zoo policy cannot train with exactly."""
    module = parallelized_module(model)
    if module is not None:
        index, count = data_shard(module)
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        if count != world:
            raise IntegrationError("XparGRPOTrainer: the model's mesh splits sequences (sp/cp), which generation "
                                   "does not support; train GRPO on a mesh without sp/cp")
    if getattr(args, "use_transformers_continuous_batching", False):
        raise IntegrationError("XparGRPOTrainer: use_transformers_continuous_batching is not supported on a "
                               "parallelized model; leave it off (generate) or use vLLM")
    if getattr(args, "beta", 0.0) != 0.0 and not is_peft_model(model):
        raise IntegrationError(f"XparGRPOTrainer: beta={args.beta} needs a reference model, which TRL would load "
                               "unsharded; use beta=0.0, or a LoRA policy (its disabled adapter is the reference)")
    if getattr(args, "sync_ref_model", False):
        raise IntegrationError("XparGRPOTrainer does not support sync_ref_model=True yet; leave it off")


def hub_named_params(model: nn.Module, bucket_bytes: int = VLLM_BUCKET_BYTES) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hub name, full tensor)`` of ``model`` one at a time, from :func:`xpar_zoo.iter_hub_weights` (merged LoRA
    for a PEFT model): what an inference engine loads. A collective: every rank iterates to the end."""
    for bucket in iter_hub_weights(model, bucket_bytes):
        yield from bucket


class XparGRPOTrainer(XparTrainerMixin, GRPOTrainer):
    """TRL's ``GRPOTrainer`` for an xpar_zoo policy on any mesh without sp/cp (see the module docstring)."""

    def __init__(self, model: nn.Module, reward_funcs: Any, args: Any = None, **kwargs: Any) -> None:
        if kwargs.get("peft_config") is not None:
            raise IntegrationError("XparGRPOTrainer: apply LoRA at load (xpar_zoo.from_pretrained(peft_config=...)), "
                                   "not through the trainer's peft_config")
        check_grpo_args(model, args)
        super().__init__(model=model, reward_funcs=reward_funcs, args=args, **kwargs)
        if getattr(self, "use_vllm", False):
            self.stream_weights_to(self.vllm_generation)

    def stream_weights_to(self, generation: Any) -> None:
        """Make TRL's vLLM weight sync of ``generation`` (a ``VLLMGeneration``) read :func:`hub_named_params`."""
        stream_vllm_weights(generation, lambda: hub_named_params(self.model))
