"""transformers' ``Trainer`` — and trainers built on it, such as TRL's ``SFTTrainer`` — for xpar_zoo models.

    from xpar_zoo.integrations.trainer import XparTrainer, XparTrainerMixin
    trainer = XparTrainer(model=model, args=TrainingArguments(...), train_dataset=ds)   # Trainer's arguments
    class SFT(XparTrainerMixin, SFTTrainer): ...                                         # in front of a subclass

``model`` comes from ``xpar_zoo.from_pretrained`` or ``xpar_zoo.parallelize`` (or is a PEFT model around one); every
rank of the torchrun / ``accelerate launch`` job builds the trainer and calls ``train()`` and ``save_model()``. The
mixin keeps the model unwrapped, makes the loss the global-batch one (:meth:`XparTrainerMixin.compute_loss`), answers
TRL's fused LM head from the model's own head, clips with ``xpar_zoo.clip_grad_norm_``, and saves an xpar_zoo
checkpoint in ``checkpoint-N/xpar_checkpoint/`` that ``resume_from_checkpoint`` loads. Why each of these:
``docs/design.md``, "Integrations".

Long context (a model on ``xpar_zoo.Mesh(sp=…, cp=…)``): the training dataloader is sharded by
:func:`xpar_zoo.data_shard` — the ``sp·cp`` ranks of a sequence group get the same samples (accelerate's sharding
re-pointed to ``num_processes=count, process_index=index``) and pass full-length rows, of which the model keeps each rank's
tokens — and the Trainer's ``get_cp_size`` answers ``sp·cp``, the ranks that share one batch, so its
``num_items_in_batch`` (gathered over the world) counts each target once and the logged loss (the mean over the
world of the ranks' shares) is the global-batch mean.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import Trainer

from ..checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from ..errors import IntegrationError
from ..loss.global_batch import IGNORE_INDEX
from ..parallel.clip import clip_grad_norm_
from ..parallel.options import ParallelOptions
from ..parallel.state import parallelized_module
from ..parallelize import set_parallel_options
from ..styles.sequence import data_shard
from ..styles.vocab import full_logits
from ..train.router_loss import RouterAux, model_router_aux
from .accelerate import check_accelerator

XPAR_CHECKPOINT_DIR = "xpar_checkpoint"  # inside the Trainer's checkpoint-N: the DCP checkpoint of model + optimizer
SCHEDULER_FILE = "scheduler.pt"  # the Trainer's own name (transformers.trainer.SCHEDULER_NAME)
TRAINING_ARGS_FILE = "training_args.bin"  # likewise (TRAINING_ARGS_NAME)
TRAINER_STATE_FILE = "trainer_state.json"  # likewise (TRAINER_STATE_NAME)


@dataclass(frozen=True)
class FusedHead:
    """What TRL's ``add_fused_lm_head`` was asked for: the temperature and the per-token fields."""

    temperature: float = 1.0
    fields: tuple[str, ...] = ("log_probs",)


@dataclass
class XparState:
    """A parallelized model as a trainer drives it: the module, its own forward, TRL's fused-head settings."""

    module: nn.Module  # the parallelized model (the base model under PEFT)
    forward: Any  # its forward as xpar_zoo installed it (the global-batch loss)
    fused_head: FusedHead | None = None

    @classmethod
    def of(cls, module: nn.Module) -> XparState:
        """``module``'s state, its forward taken before a trainer's ``__init__`` may patch it."""
        return cls(module=module, forward=module.__dict__["forward"])

    def take_back_forward(self) -> None:
        """After the trainer's ``__init__``: record TRL's fused-head patch of the forward, if any (answered inside
        ``compute_loss`` instead), and put xpar_zoo's forward back."""
        self.fused_head = trl_fused_head(self.module.__dict__.get("forward"), self.forward)
        self.module.forward = self.forward


def is_peft_model(model: nn.Module) -> bool:
    """Whether ``model`` is a PEFT model (``False`` without PEFT installed)."""
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def _torch_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The torch optimizer inside accelerate's ``AcceleratedOptimizer`` (what ``save_checkpoint`` takes)."""
    try:
        from accelerate.optimizer import AcceleratedOptimizer
    except ImportError:
        return optimizer
    return optimizer.optimizer if isinstance(optimizer, AcceleratedOptimizer) else optimizer


def trl_fused_head(current: Any, forward: Any) -> FusedHead | None:
    """The settings of TRL's fused LM head when ``current`` is TRL's ``add_fused_lm_head`` patch around ``forward``;
    ``None`` when the forward was left alone. Any other replacement of the forward is refused."""
    if current is forward:
        return None
    fn = getattr(current, "__func__", current)
    code = getattr(fn, "__code__", None)
    if code is not None and code.co_name == "_fused_forward":
        names = inspect.getclosurevars(fn).nonlocals
        if names.get("original_forward") is forward:
            return FusedHead(float(names.get("temperature", 1.0)), tuple(names.get("outputs", ("log_probs",))))
    raise IntegrationError(
        f"the trainer replaced the model's forward with {getattr(fn, '__qualname__', fn)!r}; an xpar_zoo model "
        "computes its loss in its own forward (the global-batch loss, vocab-parallel heads), so a replacement "
        "could bypass its parallel compute: turn that option off (e.g. use_liger_kernel)")


def _fused_lm_head(module: nn.Module, forward: Any, head: FusedHead, args: tuple, kwargs: dict):
    """TRL's ``fused_lm_head=True`` contract answered from the model's own logits: per-token log-probabilities of
    the next-token labels (with gradients, 0 where ignored), the requested statistics (without), the loss."""
    from trl.trainer.utils import FusedCausalLMOutput

    labels, shift_labels = kwargs.pop("labels", None), kwargs.pop("shift_labels", None)
    n_items = kwargs.pop("num_items_in_batch", None)
    if labels is None and shift_labels is None:
        raise IntegrationError("fused_lm_head=True needs labels (or shift_labels)")
    kwargs["use_cache"] = False
    if getattr(module.config.get_text_config(), "output_router_logits", False):
        kwargs.setdefault("output_router_logits", True)
    with full_logits(module):
        out = forward(*args, **kwargs)  # without labels: the full logits, through the model's (parallel) head
    logits = out.logits if shift_labels is not None else out.logits[:, :-1]
    targets = shift_labels if shift_labels is not None else labels[:, 1:]
    targets = targets.to(logits.device)
    mask = targets != IGNORE_INDEX
    log_p = torch.log_softmax(logits.float() / head.temperature, dim=-1)
    log_probs = log_p.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1).masked_fill(~mask, 0)
    stats = {}
    with torch.no_grad():
        if "entropy" in head.fields:
            stats["entropy"] = -(log_p.exp() * log_p).sum(-1).masked_fill(~mask, 0)
        if "log_sum_sq_probs" in head.fields:
            stats["log_sum_sq_probs"] = torch.logsumexp(2 * log_p, dim=-1).masked_fill(~mask, 0)
        if "mean_logits" in head.fields:
            stats["mean_logits"] = (logits.float() / head.temperature).mean(-1).masked_fill(~mask, 0)
        if "is_top1" in head.fields:
            stats["is_top1"] = (logits.argmax(-1) == targets) & mask
    loss = -log_probs.sum() / (mask.sum().clamp(min=1) if n_items is None else n_items)
    aux_loss = None
    if out.get("aux_loss") is not None:  # TRL adds it after its world factor: the share is what FSDP averages
        aux = model_router_aux(module)
        aux_loss = _global_aux_share(aux, out, kwargs.get("attention_mask"))
        loss = loss + aux.coef * aux_loss
    return FusedCausalLMOutput(loss=loss, log_probs=log_probs, label_mask=mask, aux_loss=aux_loss, **stats)


def _global_aux_share(aux: RouterAux, out: Any, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """This rank's share of the router load-balancing loss over every rank's tokens (its mean over the ranks is
    what transformers computes on the whole batch in one process), in place of the model's per-rank one."""
    if not out.get("router_logits"):
        raise IntegrationError("the model returned an aux_loss without its router_logits; cannot compute the router "
                               "auxiliary loss over the global batch")
    return aux.share(out.router_logits, attention_mask)[0]


@contextlib.contextmanager
def transformers_loss_convention(state: XparState, world: int):
    """While open, the parallelized model follows transformers' convention for ``num_items_in_batch`` (see the
    module docstring) and answers TRL's ``fused_lm_head=True``."""
    module, forward = state.module, state.forward

    def call(*args, fused_lm_head: bool = False, **kwargs):
        if fused_lm_head:
            return _fused_lm_head(module, forward, state.fused_head or FusedHead(), args, kwargs)
        n_items = kwargs.get("num_items_in_batch")
        if n_items is None or kwargs.get("labels") is None:
            return forward(*args, **kwargs)
        kwargs["num_items_in_batch"] = n_items * world
        out = forward(*args, **kwargs)
        if out.get("aux_loss") is not None and out.get("loss") is not None:
            # The model added its per-rank router loss, which the Trainer's world factor would scale too: swap it
            # for the share of the global-batch one, divided by that factor.
            aux = model_router_aux(module)
            out.loss = out.loss - aux.coef * out.aux_loss + aux.coef * _global_aux_share(
                aux, out, kwargs.get("attention_mask")) / world
        return out

    previous = module.__dict__.get("forward")
    module.forward = call
    try:
        yield
    finally:
        module.forward = previous


def _shard_by_groups(dataloader: Any, index: int, count: int) -> Any:
    """``dataloader`` as accelerate prepared it, re-pointed to part ``index`` of ``count`` (a sequence group's ranks:
    the same part): the ``num_processes`` / ``process_index`` of its sampler or dataset shard, public attributes
    read at iteration (as transformers sets them for its rebalancing sampler)."""
    from accelerate.data_loader import BatchSamplerShard, IterableDatasetShard

    for shard in (getattr(dataloader, "batch_sampler", None), getattr(dataloader, "dataset", None)):
        if isinstance(shard, (BatchSamplerShard, IterableDatasetShard)):
            shard.num_processes, shard.process_index = count, index
            return dataloader
    raise IntegrationError(
        f"an sp/cp mesh needs each sequence group to read its own part of the batches ({count} parts), and "
        f"accelerate prepared a {type(dataloader).__name__} that this cannot re-shard (batches dispatched from "
        "rank 0: an iterable dataset, or dispatch_batches=True); use a map-style dataset, or "
        "TrainingArguments(accelerator_config={'dispatch_batches': False})")


def _check_args(args: Any) -> None:
    """Refuse training arguments that would wrap or patch the model behind xpar_zoo's back."""
    if args.n_gpu > 1:
        raise IntegrationError(f"the Trainer sees {args.n_gpu} GPUs in one process and would wrap the model in "
                               "DataParallel: start one process per GPU (torchrun or accelerate launch)")
    for flag, why in (("torch_compile", "torch.compile through accelerate"),
                      ("use_liger_kernel", "Liger's kernels replace the model's forward")):
        if getattr(args, flag, False):
            raise IntegrationError(f"TrainingArguments({flag}=True) is not supported for an xpar_zoo model ({why}); "
                                   "leave it off")


def check_trainer_step(checkpoint: Path, xpar_checkpoint: Path) -> None:
    """Raise :class:`IntegrationError` when the Trainer's ``checkpoint-N/trainer_state.json`` and the xpar_zoo
    checkpoint inside it record different steps (one was copied over or left from another run): resuming would mix
    one step's weights and optimizer with another step's schedule and data position."""
    import json

    from ..checkpoint import read_checkpoint_metadata

    state_file = checkpoint / TRAINER_STATE_FILE
    if not state_file.is_file():
        return  # the Trainer names a missing state itself
    try:
        trainer_step = json.loads(state_file.read_bytes()).get("global_step")
    except (OSError, ValueError, RecursionError, AttributeError) as e:
        raise IntegrationError(f"{state_file}: unreadable Trainer state ({type(e).__name__})") from None
    xpar_step = read_checkpoint_metadata(xpar_checkpoint).get("step")
    if not isinstance(trainer_step, int) or isinstance(trainer_step, bool) or trainer_step != xpar_step:
        raise IntegrationError(
            f"{checkpoint}: the Trainer state is at step {str(trainer_step)[:40]} ({TRAINER_STATE_FILE}) but its "
            f"xpar_zoo checkpoint at step {xpar_step} ({xpar_checkpoint}); they must be one save: resume from "
            "another checkpoint")


class XparTrainerMixin:
    """Put in front of ``transformers.Trainer`` or a subclass of it (``class SFT(XparTrainerMixin, SFTTrainer)``)
    to train an xpar_zoo model (from ``xpar_zoo.from_pretrained`` / ``parallelize``, or a PEFT model around one)
    exactly: no DDP wrap, the global-token loss under accumulation, xpar_zoo's clip, checkpoints that resume
    exactly, ``save_model()`` in the hub's format or as a PEFT adapter. See the module docstring for how.
    ``options`` (:class:`~xpar_zoo.ParallelOptions`, default: those the model was parallelized with): how the model
    runs while it trains; ``cpu_collectives`` must stay the model's."""

    def __init__(self, *args: Any, options: ParallelOptions | None = None, **kwargs: Any) -> None:
        model = kwargs.get("model", args[0] if args else None)
        if kwargs.get("model_init") is not None:
            raise IntegrationError(f"{type(self).__name__} takes a built xpar_zoo model (model=...), not model_init")
        module = parallelized_module(model)
        if module is None:
            raise IntegrationError(
                f"{type(self).__name__} trains xpar_zoo models (from xpar_zoo.from_pretrained or parallelize); got "
                f"{type(model).__name__}: parallelize it first, or use the plain transformers trainer")
        set_parallel_options(module, options)  # from the next forward on; every rank checks all were given the same
        self._xpar_state = XparState.of(module)
        super().__init__(*args, **kwargs)
        self._xpar_state.take_back_forward()
        check_accelerator(self.accelerator)
        _check_args(self.args)

    def autocast_smart_context_manager(self, cache_enabled: bool | None = True) -> contextlib.AbstractContextManager:
        """accelerate's autocast for ``bf16=True``, which its ``prepare`` puts around the forward of the models it
        wraps and leaves out for an xpar_zoo model."""
        return self.accelerator.autocast()

    # ---- placement: xpar_zoo placed every shard at load ---------------------------------------------------------
    def _move_model_to_device(self, model: nn.Module, device: torch.device) -> None:
        pass

    # ---- long context: the ranks of a sequence group share their batches ----------------------------------------
    def get_train_dataloader(self):
        """The Trainer's dataloader, sharded by :func:`xpar_zoo.data_shard` on an sp/cp mesh (module docstring)."""
        index, count = data_shard(self._xpar_state.module)
        dataloader = super().get_train_dataloader()
        if count == self.accelerator.num_processes:
            return dataloader
        return _shard_by_groups(dataloader, index, count)

    def get_eval_dataloader(self, eval_dataset=None):
        """The Trainer's evaluation dataloader, sharded as :meth:`get_train_dataloader`."""
        dataloader = super().get_eval_dataloader(eval_dataset)
        index, count = data_shard(self._xpar_state.module)
        return dataloader if count == self.accelerator.num_processes else _shard_by_groups(dataloader, index, count)

    def get_cp_size(self) -> int:
        """The ranks that share one batch (the Trainer divides its world-gathered ``num_items_in_batch`` and its
        data-parallel size by this): ``sp·cp`` of the model's mesh."""
        index, count = data_shard(self._xpar_state.module)
        return self.accelerator.num_processes // count

    def _track_num_input_tokens(self, inputs: dict[str, Any]) -> None:
        """The Trainer's ``num_input_tokens_seen``, counting each token once: the ``sp·cp`` ranks of a sequence
        group pass the same rows, which the Trainer's gather over the world would count once per rank."""
        before = self.state.num_input_tokens_seen
        super()._track_num_input_tokens(inputs)
        group = self.get_cp_size()
        if group > 1:
            self.state.num_input_tokens_seen = before + (self.state.num_input_tokens_seen - before) // group

    # ---- the step -----------------------------------------------------------------------------------------------
    def compute_loss(self, model: nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: torch.Tensor | int | None = None):
        """The trainer's ``compute_loss`` with the model in transformers' loss convention (module docstring)."""
        with transformers_loss_convention(self._xpar_state, self.accelerator.num_processes):
            return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)

    def training_step(self, model: nn.Module, inputs: dict[str, Any], *args: Any, **kwargs: Any) -> torch.Tensor:
        """The trainer's step; FSDP reduce-scatters only after the last micro-batch of an optimizer step."""
        self._xpar_state.module.set_requires_gradient_sync(self.accelerator.sync_gradients)
        return super().training_step(model, inputs, *args, **kwargs)

    def _clip_grad_norm(self, model: nn.Module) -> torch.Tensor:
        return clip_grad_norm_(model.parameters(), self.args.max_grad_norm)

    def _get_grad_norm(self, model: nn.Module, grad_norm: torch.Tensor | float | None = None):
        return grad_norm if grad_norm is not None else clip_grad_norm_(model.parameters(), float("inf"))

    # ---- saving -------------------------------------------------------------------------------------------------
    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """``save_model()``: the hub's format, or the adapter of a PEFT model, written by every rank together; the
        tokenizer and the training arguments beside it, as the Trainer writes them."""
        if state_dict is not None:
            raise IntegrationError("an xpar_zoo model is saved from its live shards; save_model takes no state_dict")
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if is_peft_model(self.model):
            from ..hub.adapter_files import save_adapter

            save_adapter(self.model, output_dir, force=True)  # the Trainer's own directory: its files stay
        else:
            self._xpar_state.module.save_pretrained(output_dir, progress=not self.args.disable_tqdm)
        if not self.args.should_save:
            return
        tokenizer = self.processing_class or getattr(self.data_collator, "tokenizer", None)
        if tokenizer is not None:
            tokenizer.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_FILE))

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        root = Path(output_dir) / XPAR_CHECKPOINT_DIR
        # A run resumed into its own output directory saves its steps again: the earlier checkpoint of this step
        # is set aside (rank 0, before save_checkpoint's first collective) and removed once the new one is complete.
        replaced = root.with_name(f".{root.name}.replaced-{uuid.uuid4().hex[:8]}")
        if self.args.process_index == 0 and root.exists():
            root.rename(replaced)
        save_checkpoint(root, self.model, _torch_optimizer(self.optimizer), step=self.state.global_step)
        if self.args.process_index == 0:
            shutil.rmtree(replaced, ignore_errors=True)
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_FILE))

    # ---- resuming -----------------------------------------------------------------------------------------------
    def _xpar_checkpoint(self, checkpoint: str) -> Path:
        root = Path(checkpoint) / XPAR_CHECKPOINT_DIR
        newest = latest_checkpoint(root)
        if newest is None:
            raise IntegrationError(
                f"{checkpoint} holds no complete xpar_zoo checkpoint ({root}): it was written with "
                "save_only_model=True, by another trainer, or was interrupted; resume from another checkpoint")
        check_trainer_step(Path(checkpoint), newest)
        return root

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        # Checked here, before the optimizer exists; model and optimizer load together in the next method.
        self._xpar_checkpoint(resume_from_checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        load_checkpoint(self._xpar_checkpoint(checkpoint), self.model, _torch_optimizer(self.optimizer),
                        restore_rng=False)  # the Trainer restores its RNG itself, where its data order needs it
        scheduler = os.path.join(checkpoint, SCHEDULER_FILE)
        if os.path.isfile(scheduler):
            self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))

    def _load_best_model(self) -> None:
        load_checkpoint(self._xpar_checkpoint(self.state.best_model_checkpoint), self.model, restore_rng=False)


class XparTrainer(XparTrainerMixin, Trainer):
    """``transformers.Trainer`` for xpar_zoo models: the same arguments, exact on every mesh (see
    :class:`XparTrainerMixin` and the module docstring)."""
