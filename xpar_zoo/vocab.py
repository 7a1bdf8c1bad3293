"""Vocab parallelism: the ``embedding`` and ``lm_head`` styles (the generic ``gathered`` style is in gathered.py).

A vocab plan of size ``s`` gives each rank of a group ``V/s`` consecutive rows of a ``[V, H]`` tensor (FSDP2 shards
those rows on dim 1 over ``<plan>_fsdp``). Every rank keeps its own micro-batch; only ids, vectors and per-token
statistics travel.

- ``embedding`` (:func:`install_vocab_embedding`): each rank sends the distinct token ids of its batch to the ranks
  owning their rows (all-to-all, as in EP), the owners look them up (``padding_idx`` keeps its meaning: that row gets
  no gradient) and send the vectors back; the all-to-all is differentiable, so gradients land on the owner's rows.
  Only the lookup is replaced — any embedding scale a model applies outside the module is untouched.
- ``lm_head`` (:func:`install_vocab_lm_head`): the head group all-gathers its hidden states, each rank computes the
  logits of its ``V/s`` vocab rows for all the group's tokens, chunk by chunk, and a vocab-parallel cross-entropy
  combines per-token log-sum-exp and target logits over the group. No rank ever holds a ``[tokens, V]`` logits
  tensor, nor even ``[tokens, V/s]`` at once: chunks are recomputed in backward (a fused linear + cross-entropy).
  ``model(input_ids, labels=...)`` returns the usual loss (same shift, ``ignore_index``, mean over this rank's
  tokens, or ``num_items_in_batch``); ``out.logits`` is ``None`` unless asked for with :func:`full_logits`.

Tied embeddings (``tie_word_embeddings=True``) are refused with :class:`~xpar_zoo.errors.PlanError` when a plan
splits the shared tensor: the embedding and the head need different compute styles (lookup vs. logits), and giving
one storage two communication patterns would double-count gradients. Untie the weights (``tie_word_embeddings=False``
before building, as real large-vocab MoE checkpoints are) or leave ``emb``/``head`` out of the mesh.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import types
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from transformers.utils import ModelOutput

from .collectives import all_to_all, all_to_all_counts, to_local
from .errors import PlanError
from .mesh import PlanShard

# Elements of one fp32 logits chunk ``[tokens, V/s]`` in the fused head: bounds its memory (64 MiB).
CE_CHUNK_ELEMENTS = 1 << 24


# ---- raw collectives (no autograd) over a group whose ranks hold different numbers of rows ----------------------

def _group_counts(n: int, shard: PlanShard, device: torch.device) -> list[int]:
    counts = torch.zeros(shard.size, dtype=torch.int64, device=device)
    out = torch.empty_like(counts)
    counts[:] = n
    dist.all_to_all_single(out, counts, group=shard.group)
    return out.tolist()


def _gather_rows(x: torch.Tensor, counts: list[int], shard: PlanShard) -> torch.Tensor:
    """``cat`` of every group rank's ``x`` (``counts[q]`` rows from rank ``q``), on every rank."""
    n = x.shape[0]
    send = x.unsqueeze(0).expand(shard.size, *x.shape).reshape(shard.size * n, *x.shape[1:])
    out = x.new_empty((sum(counts), *x.shape[1:]))
    dist.all_to_all_single(out, send.contiguous(), counts, [n] * shard.size, group=shard.group)
    return out


def _scatter_sum_rows(y: torch.Tensor, counts: list[int], shard: PlanShard) -> torch.Tensor:
    """The transpose of :func:`_gather_rows`: rank ``r`` gets the group-wide sum of the ``counts[r]`` rows it owns."""
    n = counts[shard.rank]
    out = y.new_empty((shard.size * n, *y.shape[1:]))
    dist.all_to_all_single(out, y.contiguous(), [n] * shard.size, counts, group=shard.group)
    return out.view(shard.size, n, *y.shape[1:]).sum(0)


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, counts: list[int], shard: PlanShard) -> torch.Tensor:
        ctx.counts, ctx.shard = counts, shard
        return _gather_rows(x, counts, shard)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _scatter_sum_rows(grad, ctx.counts, ctx.shard), None, None


# ---- embedding ------------------------------------------------------------------------------------------------

def _embedding_forward(self: nn.Embedding, input: torch.Tensor) -> torch.Tensor:
    """Vocab-parallel lookup: distinct ids go to their owners (all-to-all), vectors come back (all-to-all)."""
    shard: PlanShard = self._xpar_vocab
    weight = to_local(self.weight)  # [V/s, H]: this rank's rows (FSDP has gathered dim 1)
    vocab = shard.rows * shard.size
    flat = input.reshape(-1)
    ids, inverse = torch.unique(flat, return_inverse=True)  # sorted, hence grouped by owner
    lo, hi = ids[[0, -1]].tolist() if ids.numel() else (0, 0)  # sorted: the ends bound every id; one host sync
    if lo < 0 or hi >= vocab:
        raise IndexError(f"token id out of range [0, {vocab}) in the vocab-parallel embedding")
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
    """Make ``module`` (an ``nn.Embedding`` whose weight holds ``shard.rows`` rows here) look ids up vocab-parallel."""
    if not isinstance(module, nn.Embedding):
        raise PlanError(f"the embedding style needs an nn.Embedding, got {type(module).__name__}")
    if module.max_norm is not None or module.scale_grad_by_freq or module.sparse:
        raise PlanError("the vocab-parallel embedding supports neither max_norm, scale_grad_by_freq nor sparse")
    module._xpar_vocab = shard
    module.forward = types.MethodType(_embedding_forward, module)


# ---- lm_head: fused vocab-parallel logits + cross-entropy ----------------------------------------------------

def _chunks(n: int, rows: int) -> Iterator[slice]:
    step = max(1, CE_CHUNK_ELEMENTS // max(rows, 1))
    for start in range(0, n, step):
        yield slice(start, min(n, start + step))


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy of this rank's tokens against a vocab split over the head group.

    Forward: gather the group's hidden states and targets; per chunk, local logits ``[chunk, V/s]`` → local
    log-sum-exp and target logit; one all-gather of those ``[2, N]`` statistics gives the exact per-token loss.
    Backward: gather the per-token gradient coefficients, recompute each chunk's logits, ``(softmax − onehot)·g``
    gives the weight's gradient (this rank's rows, all group tokens) and the hidden states' (summed back to owners).
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, shard: PlanShard, counts: list[int], ignore_index: int, lead):
        h_all = _gather_rows(hidden.detach(), counts, shard)  # [N, H]
        t_all = _gather_rows(targets, counts, shard)  # [N]
        valid = t_all != ignore_index
        local_t = t_all - shard.offset
        owned = valid & (local_t >= 0) & (local_t < shard.rows)
        index = torch.where(owned, local_t, 0).unsqueeze(1)
        n = h_all.shape[0]
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        target_logit = torch.empty(n, dtype=torch.float32, device=hidden.device)
        for c in _chunks(n, shard.rows):
            z = (h_all[c] @ weight.t()).float()
            lse[c] = torch.logsumexp(z, dim=-1)
            target_logit[c] = z.gather(1, index[c]).squeeze(1)
        stats = torch.stack([lse, torch.where(owned, target_logit, 0.0)])
        gathered = [torch.empty_like(stats) for _ in range(shard.size)]
        dist.all_gather(gathered, stats, group=shard.group)
        gathered = torch.stack(gathered)  # [s, 2, N]
        group_lse = torch.logsumexp(gathered[:, 0], dim=0)
        loss = torch.where(valid, group_lse - gathered[:, 1].sum(0), 0.0)
        ctx.shard, ctx.counts = shard, counts
        ctx.save_for_backward(h_all, weight, index, owned, valid, group_lse)
        start = sum(counts[:shard.rank])
        return loss[start:start + counts[shard.rank]].reshape(lead).clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        h_all, weight, index, owned, valid, group_lse = ctx.saved_tensors
        shard, counts = ctx.shard, ctx.counts
        coef = _gather_rows(grad.float().reshape(-1), counts, shard) * valid  # [N]
        grad_h = torch.empty_like(h_all)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for c in _chunks(h_all.shape[0], shard.rows):
            p = torch.exp((h_all[c] @ weight.t()).float() - group_lse[c, None])
            p.scatter_add_(1, index[c], -owned[c, None].float())
            p.mul_(coef[c, None])
            p = p.to(weight.dtype)
            grad_h[c] = p @ weight
            grad_w.addmm_(p.t().float(), h_all[c].float())
        return _scatter_sum_rows(grad_h, counts, shard), grad_w.to(weight.dtype), None, None, None, None, None


@dataclass
class VocabParallelLogits(ModelOutput):
    """What a vocab-parallel ``lm_head`` returns in place of logits: this rank's per-token losses (0 where the
    target is ignored; ``None`` without labels), the count of counted tokens, and the full ``[…, V]`` logits only
    inside :func:`full_logits`. The model's ``loss_function`` turns it into the loss; the model's output carries
    ``.logits`` (``None`` unless asked)."""

    token_losses: torch.Tensor | None = None
    num_valid: torch.Tensor | None = None
    logits: torch.Tensor | None = None


@dataclass
class _LossRequest:
    targets: torch.Tensor  # shifted labels, shaped like the hidden states' token dims
    ignore_index: int


class _HeadState:
    def __init__(self, shard: PlanShard) -> None:
        self.shard = shard
        self.request: _LossRequest | None = None
        self.full_logits = False


def _head_full_logits(hidden: torch.Tensor, weight: torch.Tensor, counts: list[int], shard: PlanShard, lead):
    """Full ``[*lead, V]`` logits of this rank's tokens: local-vocab logits of the group's tokens, sent to their
    owners and concatenated by vocab block."""
    z = _GatherRows.apply(hidden, counts, shard) @ weight.t()  # [N, V/s]
    n = counts[shard.rank]
    z = all_to_all(z, [n] * shard.size, counts, shard.group)  # [s·T, V/s], by source rank = vocab block
    return torch.cat([block.view(*lead, -1) for block in z.view(shard.size, n, -1).unbind(0)], dim=-1)


def _lm_head_forward(self: nn.Linear, hidden_states: torch.Tensor) -> VocabParallelLogits:
    state: _HeadState = self._xpar_head
    shard, request = state.shard, state.request
    if request is None and not state.full_logits:
        return VocabParallelLogits()
    weight = to_local(self.weight)  # [V/s, H]
    lead = hidden_states.shape[:-1]
    hidden = hidden_states.reshape(-1, hidden_states.shape[-1])
    counts = _group_counts(hidden.shape[0], shard, hidden.device)
    out = VocabParallelLogits()
    if request is not None:
        if request.targets.shape != lead:
            raise ValueError(f"vocab-parallel loss: labels give targets of shape {tuple(request.targets.shape)} "
                             f"but the head sees hidden states of shape {tuple(lead)} (logits_to_keep with labels?)")
        targets = request.targets.reshape(-1).to(hidden.device)
        out.token_losses = _VocabParallelCrossEntropy.apply(hidden, weight, targets, shard, counts,
                                                            request.ignore_index, lead)
        out.num_valid = (targets != request.ignore_index).sum()
    if state.full_logits:
        out.logits = _head_full_logits(hidden, weight, counts, shard, lead)
    return out


def _vocab_parallel_loss(fallback, logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100,
                         shift_labels=None, **kwargs):
    """The model's ``loss_function`` under the lm_head style: reduce the head's per-token losses like
    transformers' ``ForCausalLMLoss`` (sum / ``num_items_in_batch``, else mean over counted tokens)."""
    if not isinstance(logits, VocabParallelLogits):
        return fallback(logits, labels, vocab_size, num_items_in_batch=num_items_in_batch,
                        ignore_index=ignore_index, shift_labels=shift_labels, **kwargs)
    if logits.token_losses is None:
        raise RuntimeError("vocab-parallel loss requested but the head computed none (labels not seen by forward)")
    total = logits.token_losses.sum()
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(total.device)
        return total / num_items_in_batch
    return total / logits.num_valid


def _unwrap_logits(out):
    if isinstance(out, ModelOutput) and isinstance(out.get("logits"), VocabParallelLogits):
        fields = dict(out.items())
        fields["logits"] = fields["logits"].logits
        return type(out)(**fields)
    if isinstance(out, tuple):
        return tuple(o.logits if isinstance(o, VocabParallelLogits) else o for o in out)
    return out


def install_vocab_lm_head(model: nn.Module, module: nn.Module, shard: PlanShard) -> None:
    """Make ``module`` (the model's output head, holding ``shard.rows`` vocab rows here) a vocab-parallel head with
    a fused cross-entropy, and hook ``model``'s forward and ``loss_function`` so that ``model(…, labels=…)`` returns
    the usual loss. Every rank of a head group must call the model alike (labels or not, :func:`full_logits` or not).
    """
    if not isinstance(module, nn.Linear) or module.bias is not None:
        raise PlanError(f"the lm_head style needs a bias-free nn.Linear, got {module}")
    if getattr(model, "get_output_embeddings", lambda: None)() is not module:
        raise PlanError("the lm_head style applies to the model's output embeddings (get_output_embeddings())")
    if getattr(model.config, "final_logit_softcapping", None) is not None:
        raise PlanError("the vocab-parallel head does not support final_logit_softcapping")
    module._xpar_head = _HeadState(shard)
    module.forward = types.MethodType(_lm_head_forward, module)

    fallback = model.loss_function
    model.loss_function = functools.partial(_vocab_parallel_loss, fallback)
    original = model.forward
    signature = inspect.signature(original)

    @functools.wraps(original)
    def forward(*args, **kwargs):
        bound = signature.bind_partial(*args, **kwargs).arguments
        extra = bound.get("kwargs", {})
        labels = bound.get("labels")
        state: _HeadState = module._xpar_head
        if labels is not None:
            ignore_index = extra.get("ignore_index", -100)
            targets = extra.get("shift_labels")
            if targets is None:
                targets = nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
            state.request = _LossRequest(targets, ignore_index)
        try:
            return _unwrap_logits(original(*args, **kwargs))
        finally:
            state.request = None

    model.forward = forward


@contextlib.contextmanager
def full_logits(model: nn.Module) -> Iterator[None]:
    """Inside this block a vocab-parallel model's ``out.logits`` holds the full ``[batch, seq, V]`` logits of this
    rank's tokens (differentiable; for evaluation and generation). Outside it, ``out.logits`` is ``None``. A model
    without a vocab-parallel head is unaffected."""
    heads = [m._xpar_head for m in model.modules() if hasattr(m, "_xpar_head")]
    previous = [h.full_logits for h in heads]
    for h in heads:
        h.full_logits = True
    try:
        yield
    finally:
        for h, p in zip(heads, previous):
            h.full_logits = p
