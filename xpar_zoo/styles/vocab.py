"""Vocab parallelism, the module wiring: the ``embedding`` and ``lm_head`` styles (the generic ``gathered`` style is
in gathered.py; the fused loss's tensor code in fused_loss.py).

- ``embedding`` (:func:`install_vocab_embedding`): token ids go to the ranks owning their rows, vectors come back.
- ``lm_head`` (:func:`install_vocab_lm_head`): the head computes the loss itself with
  :func:`~xpar_zoo.loss.fused.fused_cross_entropy`, never holding ``[tokens, V]`` logits; with labels
  ``out.logits`` is ``None`` unless asked for with :func:`full_logits`.
- :func:`install_fused_loss` (``parallelize``'s default on meshes without a ``head`` plan): the same over the whole
  vocab.

Tied embeddings with a vocab plan are refused with :class:`~xpar_zoo.errors.PlanError`. Design:
``docs/design.md``, "Vocab parallelism".
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import re
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers.utils import ModelOutput

from ..errors import BatchError, PlanError
from ..loss.fused import check_kernel_name, fused_cross_entropy, whole_vocab
from ..loss.global_batch import wrap_forward
from ..parallel.collectives import (
    GatherRows,
    all_to_all,
    all_to_all_counts,
    group_row_counts,
    to_local,
)
from ..parallel.mesh import PlanShard
from ..zoo.forward_source import embedding_weight_read, forward_source
from .routes import fixed_routes

# What these styles keep on a module, each attribute named once here: set with setattr (nn.Module types attributes
# set with `.` as tensors or modules), read with getattr. (Fixed routes: styles/routes.py.)
_VOCAB, _HEAD = "_xpar_vocab", "_xpar_head"

# ---- embedding ------------------------------------------------------------------------------------------------

def _embedding_forward(self: nn.Embedding, input: torch.Tensor) -> torch.Tensor:
    """Vocab-parallel lookup: distinct ids go to their owners (all-to-all), vectors come back (all-to-all)."""
    shard: PlanShard = getattr(self, _VOCAB)
    weight = to_local(self.weight)  # [V/s, H]: this rank's rows (FSDP has gathered them)
    vocab = shard.rows * shard.size
    flat = input.reshape(-1)
    routes = fixed_routes(self)
    if routes is not None:  # a simulated run (no values): every id distinct, spread evenly over the owners
        ids, inverse = flat, torch.arange(flat.numel(), device=flat.device)
        send_splits, recv_splits = routes.splits(flat.numel(), shard.size)
    else:
        ids, inverse = torch.unique(flat, return_inverse=True)  # sorted, hence grouped by owner
        lo, hi = ids[[0, -1]].tolist() if ids.numel() else (0, 0)  # sorted: the ends bound every id; one host sync
        if lo < 0 or hi >= vocab:
            raise BatchError(f"token id out of range [0, {vocab}) in the vocab-parallel embedding (ids {lo} … {hi})")
        send = torch.bincount(ids // shard.rows, minlength=shard.size)
        recv = all_to_all_counts(send, shard.group)
        send_splits, recv_splits = send.tolist(), recv.tolist()
    asked = all_to_all(ids, recv_splits, send_splits, shard.group) - shard.offset
    pad = self.padding_idx
    local_pad = pad - shard.offset if pad is not None and 0 <= pad - shard.offset < shard.rows else None
    vectors = nn.functional.embedding(asked, weight, local_pad)
    vectors = all_to_all(vectors, send_splits, recv_splits, shard.group)
    return vectors[inverse.view(input.shape)]  # a fresh tensor: FSDP's backward hook must not sit on a view


def install_vocab_embedding(module: nn.Module, shard: PlanShard) -> None:
    """Make ``module`` (an ``nn.Embedding`` whose weight holds ``shard.rows`` rows here) look ids up vocab-parallel.
    A subclass whose forward post-processes ``nn.Embedding``'s lookup (``super().forward(ids)`` times a scale, or
    through a norm: Gemma's and Inkling's embeddings) keeps its forward: the vocab-parallel lookup takes the place of
    ``nn.Embedding.forward`` behind it."""
    _check_embedding_module(module)
    setattr(module, _VOCAB, shard)
    if type(module).forward is nn.Embedding.forward:
        module.forward = types.MethodType(_embedding_forward, module)
    else:
        cls: type = type(module)  # a class is hashable: mypy's check of a class against Hashable is wrong (mypy#20409)
        module.__class__ = _with_vocab_parallel_lookup(cls)


class _VocabParallelLookup(nn.Embedding):
    forward = _embedding_forward


@functools.cache
def vocab_parallel_embeddings(model: nn.Module) -> list[nn.Module]:
    """Every embedding of ``model`` that :func:`install_vocab_embedding` made vocab-parallel."""
    return [m for m in model.modules() if hasattr(m, _VOCAB)]


def fused_heads(model: nn.Module) -> list[nn.Module]:
    """Every head of ``model`` that the fused loss (whole-vocab or vocab-parallel) runs."""
    return [m for m in model.modules() if hasattr(m, _HEAD)]


def _with_vocab_parallel_lookup(cls: type) -> type:
    """``cls`` with :class:`_VocabParallelLookup` between it and ``nn.Embedding`` in its MRO, so that its forward's
    ``super().forward(ids)`` is the vocab-parallel lookup; same name, so class-name based choices are unchanged."""
    return type(cls.__name__, (cls, _VocabParallelLookup), {"__module__": cls.__module__})


def _check_embedding_module(module: nn.Module) -> None:
    if not isinstance(module, nn.Embedding):
        raise PlanError(f"the embedding style needs an nn.Embedding, got {type(module).__name__}")
    if module.max_norm is not None or module.scale_grad_by_freq or module.sparse:
        raise PlanError("the vocab-parallel embedding supports neither max_norm, scale_grad_by_freq nor sparse")
    cls = type(module)
    if cls.forward is not nn.Embedding.forward and "super().forward(" not in forward_source(cls.forward):
        raise PlanError(f"the vocab-parallel embedding replaces nn.Embedding's lookup, but {cls.__name__}.forward "
                        "does not call it (super().forward(ids)): it would look ids up in this rank's rows only")


def check_embedding(model: nn.Module, module: nn.Module) -> None:
    """Raise :class:`~xpar_zoo.errors.PlanError` naming the reason when ``module`` cannot be ``model``'s
    vocab-parallel embedding: not an ``nn.Embedding`` (or a subclass that post-processes its lookup), an option the
    lookup cannot honour, or a model that reads the weight outside the embedding's forward."""
    _check_embedding_module(module)
    line = embedding_weight_read(model, module)
    if line:
        raise PlanError(f"the vocab-parallel embedding splits {type(module).__name__}.weight, but "
                        f"{type(model).__name__} reads that weight outside the embedding's forward ({line!r})")


# ---- lm_head: the fused (vocab-parallel) head ------------------------------------------------------

@dataclass
class VocabParallelLogits(ModelOutput):
    """What a fused ``lm_head`` returns in place of logits: this rank's loss (``None`` without labels) and the full
    ``[…, V]`` logits only inside :func:`full_logits`. The model's ``loss_function`` passes the loss on; the model's
    output carries ``.logits`` (``None`` unless asked)."""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None

    def float(self) -> VocabParallelLogits:
        """Itself: a forward that upcasts the head's output before its loss (``self.lm_head(h).float()``, as
        nemotron_h's does) gets what the fused loss already does, whose softmax statistics are fp32."""
        return self


@dataclass
class _LossRequest:
    targets: torch.Tensor  # shifted labels, shaped like the hidden states' token dims
    ignore_index: int
    num_items: torch.Tensor | int | None  # ``num_items_in_batch``: the loss's denominator when given


class _HeadState:
    def __init__(self, shard: PlanShard, chunk_elements: int | None, kernels: str) -> None:
        check_kernel_name(kernels)
        self.shard = shard
        self.chunk_elements = chunk_elements
        self.kernels = kernels
        self.request: _LossRequest | None = None
        self.full_logits = False


def _head_full_logits(hidden: torch.Tensor, weight: torch.Tensor, counts: list[int], shard: PlanShard, lead):
    """Full ``[*lead, V]`` logits of this rank's tokens: local-vocab logits of the group's tokens, sent to their
    owners and concatenated by vocab block."""
    if shard.size == 1:
        return (hidden @ weight.t()).view(*lead, -1)
    z = GatherRows.apply(hidden, counts, shard) @ weight.t()  # [N, V/s]
    n = counts[shard.rank]
    z = all_to_all(z, [n] * shard.size, counts, shard.group)  # [s·T, V/s], by source rank = vocab block
    return torch.cat([block.view(*lead, -1) for block in z.view(shard.size, n, -1).unbind(0)], dim=-1)


def _lm_head_forward(self: nn.Linear, hidden_states: torch.Tensor) -> VocabParallelLogits | torch.Tensor:
    state: _HeadState = getattr(self, _HEAD)
    shard, request = state.shard, state.request
    weight = to_local(self.weight)  # [V/s, H]
    if request is None and shard.size == 1:  # a whole-vocab head without labels: plain logits, as transformers's
        return nn.functional.linear(hidden_states, weight)
    lead = hidden_states.shape[:-1]
    hidden = hidden_states.reshape(-1, hidden_states.shape[-1])
    if fixed_routes(self) is not None:  # fixed routes: every group rank holds as many rows
        counts = [hidden.shape[0]] * shard.size
    else:
        counts = group_row_counts(hidden.shape[0], shard, hidden.device)
    out = VocabParallelLogits()
    if request is not None:
        if request.targets.shape != lead:
            raise BatchError(f"fused loss: labels give targets of shape {tuple(request.targets.shape)} but the "
                             f"head sees hidden states of shape {tuple(lead)} (logits_to_keep with labels?)")
        out.loss = fused_cross_entropy(hidden, weight, request.targets.reshape(-1).to(hidden.device), shard,
                                        counts, request.ignore_index, request.num_items, state.chunk_elements,
                                        state.kernels)
    if state.full_logits or request is None:  # without labels a forward is for its logits (generate, evaluation)
        out.logits = _head_full_logits(hidden, weight, counts, shard, lead)
    return out


def _fused_loss(fallback, logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100,
                shift_labels=None, **kwargs):
    """The model's ``loss_function`` under a fused head: the head already reduced the loss like transformers'
    ``ForCausalLMLoss`` (sum / ``num_items_in_batch``, else mean over counted tokens)."""
    if not isinstance(logits, VocabParallelLogits):
        return fallback(logits, labels, vocab_size, num_items_in_batch=num_items_in_batch,
                        ignore_index=ignore_index, shift_labels=shift_labels, **kwargs)
    if logits.loss is None:
        raise RuntimeError("fused loss requested but the head computed none (labels not seen by forward)")
    return logits.loss


def _unwrap_logits(out):
    if isinstance(out, ModelOutput) and isinstance(out.get("logits"), VocabParallelLogits):
        fields = dict(out.items())
        fields["logits"] = fields["logits"].logits
        return type(out)(**fields)
    if isinstance(out, tuple):
        return tuple(o.logits if isinstance(o, VocabParallelLogits) else o for o in out)
    return out


_LOGITS_CHANGED = re.compile(r"\blogits\s*(\[|[-+*/]?=(?!=))")


def logits_transform(model: nn.Module, module: nn.Module) -> str | None:
    """The first line of ``model``'s forward that changes the head's output between the head and the loss
    (softcapping, a scale, a vocab slice: a fused head computes the loss inside the head and cannot honour it), or
    a reason why the forward cannot be read; ``None`` when the logits go straight to ``loss_function``."""
    cls: type = type(model)  # a class is hashable: mypy's check of a class against Hashable is wrong (mypy#20409)
    return _forward_logits_transform(cls, next((n for n, m in model.named_children() if m is module), None))


@functools.cache
def _forward_logits_transform(cls: type[nn.Module], name: str | None) -> str | None:
    """:func:`logits_transform` for a model class and its head's attribute name: the source is read once per class
    (``parallelize``, ``install_fused_loss`` and every mesh the sizer tries ask again)."""
    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return "its forward's source cannot be read"
    start = source.find(f"self.{name}(") if name else -1
    end = source.find("loss_function", start)
    if start < 0 or end < 0:
        return f"its forward does not visibly pass self.{name}(...) to self.loss_function"
    changed = [line.strip() for line in source[start:end].splitlines()[1:] if _LOGITS_CHANGED.search(line)]
    return changed[0] if changed else None


def check_head(model: nn.Module, module: nn.Module | None) -> None:
    """Raise :class:`~xpar_zoo.errors.PlanError` naming the reason when ``module`` cannot be ``model``'s fused
    (whole-vocab or vocab-parallel) head: not a bias-free ``nn.Linear`` output embedding, logit softcapping, or a
    forward that changes the logits between the head and the loss."""
    if not isinstance(module, nn.Linear) or module.bias is not None:
        raise PlanError(f"the fused head needs a bias-free nn.Linear, got {module}")
    if _output_embeddings(model) is not module:
        raise PlanError("the fused head applies to the model's output embeddings (get_output_embeddings())")
    if getattr(model.config, "final_logit_softcapping", None) is not None:
        raise PlanError("the fused head does not support final_logit_softcapping")
    changed = logits_transform(model, module)
    if changed:
        raise PlanError(f"the fused head computes the loss inside the head, but {type(model).__name__} changes "
                        f"the logits before its loss ({changed!r}); leave 'head' out of the mesh (parallelize's "
                        "default fused loss skips such models)")
    if hasattr(module, _HEAD):
        raise PlanError("the model's output head is already fused")


def _output_embeddings(model: nn.Module) -> nn.Module | None:
    """``model.get_output_embeddings()``, or ``None`` for a model without that method."""
    return getattr(model, "get_output_embeddings", lambda: None)()


def install_vocab_lm_head(model: nn.Module, module: nn.Module, shard: PlanShard,
                          chunk_elements: int | None = None, kernels: str = "torch") -> None:
    """Make ``module`` (the model's output head, holding ``shard.rows`` vocab rows here) a vocab-parallel head with
    a fused cross-entropy, and hook ``model``'s forward and ``loss_function`` so that ``model(…, labels=…)`` returns
    the usual loss. Every rank of a head group must call the model alike (labels or not, :func:`full_logits` or not).
    A group of one (:func:`install_fused_loss`) is the same fused loss over the whole vocab, with no collective.
    """
    check_head(model, module)
    setattr(module, _HEAD, _HeadState(shard, chunk_elements, kernels))
    module.forward = types.MethodType(_lm_head_forward, module)

    fallback = model.loss_function
    # setattr: nn.Module types attributes set with `.` as tensors or modules
    setattr(model, "loss_function", functools.partial(_fused_loss, fallback))  # noqa: B010

    def forward(original: Callable[..., Any], labels: torch.Tensor | None, extra: dict[str, Any],
                args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        state: _HeadState = getattr(module, _HEAD)
        if labels is not None:
            ignore_index = extra.get("ignore_index", -100)
            targets = extra.get("shift_labels")
            if targets is None:
                targets = nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
            state.request = _LossRequest(targets, ignore_index, extra.get("num_items_in_batch"))
        try:
            return _unwrap_logits(original(*args, **kwargs))
        finally:
            state.request = None

    wrap_forward(model, forward)


def fusable_head(model: nn.Module) -> nn.Module | None:
    """The model's output head if the fused loss applies to it (a bias-free ``nn.Linear`` without logit
    softcapping, not fused yet), else ``None``."""
    module = _output_embeddings(model)
    try:
        check_head(model, module)
    except PlanError:
        return None
    return module


def install_fused_loss(model: nn.Module, *, chunk_elements: int | None = None, kernels: str = "torch"
                       ) -> nn.Module:
    """Give ``model`` (a transformers causal LM, whole-vocab head) the fused linear + cross-entropy: with labels,
    ``model(…, labels=…).loss`` is computed chunk by chunk (at most ``chunk_elements`` logits at once; default
    :data:`CE_CHUNK_ELEMENTS` by device type; the head's gradients produced in the same pass) and ``out.logits`` is
    ``None`` unless asked for with :func:`full_logits`; without labels the model returns its usual logits.
    :func:`~xpar_zoo.parallelize` does this by default on meshes without a ``head`` plan; call it yourself for a
    single-process model. ``kernels="triton"``: each chunk's softmax statistics and gradient by the kernels of
    :mod:`xpar_zoo.kernels.loss_triton` (CUDA, or the CPU under ``TRITON_INTERPRET=1``) instead of torch ops. Returns
    ``model``.

    The loss and its gradients equal transformers' ``ForCausalLMLoss`` (``ignore_index``, ``shift_labels``,
    ``num_items_in_batch``), except that a batch whose targets are all ignored gives 0 instead of NaN.
    """
    module = _output_embeddings(model)
    check_head(model, module)  # before reading its weight
    assert isinstance(module, nn.Linear)  # check_head refuses anything else
    install_vocab_lm_head(model, module, whole_vocab(module.weight), chunk_elements, kernels)
    return model


def set_loss_chunk(model: nn.Module, chunk_elements: int) -> int:
    """Make every fused head of ``model`` (vocab-parallel or whole-vocab) compute at most ``chunk_elements`` logits at
    once, whatever its device's default (:data:`CE_CHUNK_ELEMENTS`); returns how many heads it set."""
    heads = _heads(model)
    for state in heads:
        state.chunk_elements = chunk_elements
    return len(heads)


def _heads(model: nn.Module) -> list[_HeadState]:
    """The state of every fused head of ``model``."""
    return [getattr(m, _HEAD) for m in model.modules() if hasattr(m, _HEAD)]


@contextlib.contextmanager
def full_logits(model: nn.Module) -> Iterator[None]:
    """Inside this block a model with a fused (vocab-parallel or whole-vocab) head returns the full
    ``[batch, seq, V]`` logits of this rank's tokens in ``out.logits``, labels or not (differentiable; for evaluation
    and generation). Outside it, ``out.logits`` is ``None`` whenever the head computed the loss (and always under a
    ``head`` plan). A model without a fused head is unaffected."""
    heads = _heads(model)
    previous = [h.full_logits for h in heads]
    for h in heads:
        h.full_logits = True
    try:
        yield
    finally:
        for h, p in zip(heads, previous):
            h.full_logits = p
