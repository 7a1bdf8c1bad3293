"""TRL's ``DPOTrainer`` (and the preference losses it carries: IPO, hinge, APO, …) for xpar_zoo models.

    from xpar_zoo.integrations.dpo import XparDPOTrainer
    trainer = XparDPOTrainer(model=policy, ref_model=reference, args=DPOConfig(...), train_dataset=pairs,
                             processing_class=tokenizer)

Every rank builds the trainer and trains. The reference is one of: a second xpar_zoo model on the same ranks
(frozen here: no gradients, no optimizer state); none with ``precompute_ref_log_probs=True`` (the policy's
log-probabilities before training, computed once, cached under a fingerprint of every rank's shards); or, for a
PEFT policy whose adapter is still its initial zero update, the policy with the adapter disabled (what TRL's copy
of the adapter would compute). Both models answer TRL's fused LM head from their own heads (vocab-parallel ones
included): per-sequence log-probabilities are sums over each sequence's own completion tokens, as in one process.
The DPO loss is each rank's mean over its pairs, which FSDP averages into the mean over the global batch; TRL
gathers its reward metrics over the world, and the gradient norm is ``xpar_zoo.clip_grad_norm_``'s.
"""

from __future__ import annotations

import contextlib
import hashlib
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from trl import DPOTrainer

from ..compat import mark_fsdp_managed
from ..errors import IntegrationError
from ..parallel.distributed import all_gather
from ..parallel.state import parallelized_module
from .trainer import (
    XparState,
    XparTrainerMixin,
    is_peft_model,
    transformers_loss_convention,
)


def weights_fingerprint(model: nn.Module) -> str:
    """A SHA-256 of every rank's local shards of ``model``'s state (names, shapes, dtypes, bytes), the same on every
    rank. A collective: every rank calls it."""
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        h.update(f"{name} {tuple(tensor.shape)} {tensor.dtype}".encode())
        h.update(local.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes())
    return hashlib.sha256("".join(all_gather(h.hexdigest())).encode()).hexdigest()


@contextlib.contextmanager
def _hashable(holder: nn.Module, weights: nn.Module):
    """While open, ``holder.state_dict()`` is one small tensor, the fingerprint of ``weights``: what TRL's
    ``hash_module`` names the cache of precomputed reference log-probabilities by (it cannot read DTensors)."""
    digest = torch.tensor(list(bytes.fromhex(weights_fingerprint(weights))), dtype=torch.uint8)
    holder.state_dict = lambda *args, **kwargs: {"xpar_zoo.weights_sha256": digest}
    try:
        yield
    finally:
        del holder.state_dict


class AdapterDisabled(nn.Module):
    """A PEFT policy with its adapter disabled, as DPO's reference model: called, it runs the policy under
    ``disable_adapter()``. The policy is not a submodule (its parameters stay the policy's alone)."""

    def __init__(self, policy: nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "policy", policy)
        self.config = policy.config
        mark_fsdp_managed(self)  # accelerate hands it back as it is

    def __call__(self, *args: Any, **kwargs: Any):  # not through self.forward, which TRL's fused head replaces
        with self.policy.disable_adapter():
            return self.policy(*args, **kwargs)


def _adapter_is_zero(policy: nn.Module) -> bool:
    """Whether every LoRA ``B`` factor of ``policy`` is zero on every rank (the adapter changes nothing yet)."""
    nonzero = False
    for name, p in policy.named_parameters():
        if ".lora_B." in name or ".lora_embedding_B." in name:
            local = p.to_local() if isinstance(p, DTensor) else p
            nonzero = nonzero or bool(local.detach().count_nonzero())
    return not any(all_gather(nonzero))


def _reference(model: nn.Module, ref_model: nn.Module | None, precompute: bool) -> nn.Module | None:
    """The reference model TRL is given (checked, frozen), or ``None`` for a precomputed one."""
    if ref_model is not None:
        if parallelized_module(ref_model) is None:
            raise IntegrationError(f"ref_model is a {type(ref_model).__name__}, not an xpar_zoo model: load it with "
                                   "xpar_zoo.from_pretrained on the policy's ranks")
        ref_model.requires_grad_(False)
        return ref_model.eval()
    if is_peft_model(model):
        if not _adapter_is_zero(model):
            raise IntegrationError(
                "the LoRA policy's adapter is not at its initial zero update (a lora_B is non-zero): TRL would take "
                "a copy of it as the reference, which xpar_zoo cannot add to a parallelized model; pass ref_model= "
                "a second xpar_zoo model with this adapter (from_pretrained(..., adapter=DIR))")
        return AdapterDisabled(model)
    if precompute:
        return None
    raise IntegrationError(
        "XparDPOTrainer needs a reference: ref_model= a second xpar_zoo model on the same ranks, "
        "precompute_ref_log_probs=True, or a LoRA policy (the adapter disabled); TRL would load an unsharded copy")


class XparDPOTrainer(XparTrainerMixin, DPOTrainer):
    """TRL's ``DPOTrainer`` for an xpar_zoo policy on any mesh without sp/cp (see the module docstring for the
    reference models it takes and why its numbers are single-process TRL's)."""

    def __init__(self, model: nn.Module, ref_model: nn.Module | None = None, args: Any = None, **kwargs: Any) -> None:
        if kwargs.get("peft_config") is not None:
            raise IntegrationError("XparDPOTrainer: apply LoRA at load (xpar_zoo.from_pretrained(peft_config=...)), "
                                   "not through the trainer's peft_config")
        if getattr(args, "sync_ref_model", False):
            raise IntegrationError("XparDPOTrainer does not support sync_ref_model=True yet; leave it off")
        precompute = bool(getattr(args, "precompute_ref_log_probs", False))
        reference = _reference(model, ref_model, precompute)
        module = parallelized_module(reference) if reference is not None and ref_model is not None else None
        self._xpar_ref = XparState.of(module) if module is not None else None
        hashed = reference if reference is not None else model
        weights = model if isinstance(reference, AdapterDisabled) else hashed
        with _hashable(hashed, weights) if precompute else contextlib.nullcontext():
            super().__init__(model=model, ref_model=reference, args=args, **kwargs)
        if self._xpar_ref is not None:  # TRL's fused head on the reference: answered from its own head instead
            self._xpar_ref.take_back_forward()

    def _reference_convention(self) -> contextlib.AbstractContextManager:
        if self._xpar_ref is None:
            return contextlib.nullcontext()
        return transformers_loss_convention(self._xpar_ref, self.accelerator.num_processes)

    def compute_loss(self, model: nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: torch.Tensor | int | None = None):
        """DPO's loss with both models answering TRL's fused LM head."""
        with self._reference_convention():
            return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)

    def compute_ref_log_probs(self, model: nn.Module, inputs: dict[str, Any]):
        """TRL's reference log-probabilities (the precomputation), with the models answering its fused LM head."""
        with self._reference_convention(), transformers_loss_convention(self._xpar_state,
                                                                         self.accelerator.num_processes):
            return super().compute_ref_log_probs(model, inputs)
