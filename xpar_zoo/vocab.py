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
  tensor, nor even ``[tokens, V/s]`` at once: each chunk's gradients are made as soon as its statistics are
  combined, in the same pass (a fused linear + cross-entropy), and backward only scales them.
  ``model(input_ids, labels=...)`` returns the usual loss (same shift, ``ignore_index``, mean over this rank's
  tokens, or ``num_items_in_batch``); ``out.logits`` is ``None`` unless asked for with :func:`full_logits`.
- the fused loss without a ``head`` plan (:func:`install_fused_loss`, ``parallelize``'s default; and
  :func:`fused_linear_cross_entropy` for custom loops): the same computation over the whole vocab, a group of one —
  no collective, at most a chunk of logits at once.

Tied embeddings (``tie_word_embeddings=True``) are refused with :class:`~xpar_zoo.errors.PlanError` when a plan
splits the shared tensor: the embedding and the head need different compute styles (lookup vs. logits), and giving
one storage two communication patterns would double-count gradients. Untie the weights (``tie_word_embeddings=False``
before building, as real large-vocab MoE checkpoints are) or leave ``emb``/``head`` out of the mesh.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import re
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

# Logits per chunk ``[tokens, V/s]`` in the fused head, by device type: bounds its memory (on the torch path one
# chunk-sized tensor lives at a time: 256 MiB in fp32 on the CPU). Every chunk also reads and writes the ``[V/s, H]``
# fp32 weight-gradient accumulator, so chunks must not be small: on the CPU 2^26 is as fast as transformers' loss
# at a fifth to two fifths of its memory, 2^24 was 1.10-1.18x slower at T=2048, H=1024, V=50000 (bench/RESULTS.md);
# bench/gpu_moe.py sweeps it on a GPU.
CE_CHUNK_ELEMENTS = {"cuda": 1 << 28, "cpu": 1 << 26}
LOSS_KERNELS = ("torch", "triton")


# ---- raw collectives (no autograd) over a group whose ranks hold different numbers of rows ----------------------

def _group_counts(n: int, shard: PlanShard, device: torch.device) -> list[int]:
    if shard.size == 1:
        return [n]
    counts = torch.zeros(shard.size, dtype=torch.int64, device=device)
    out = torch.empty_like(counts)
    counts[:] = n
    dist.all_to_all_single(out, counts, group=shard.group)
    return out.tolist()


def _gather_rows(x: torch.Tensor, counts: list[int], shard: PlanShard) -> torch.Tensor:
    """``cat`` of every group rank's ``x`` (``counts[q]`` rows from rank ``q``), on every rank."""
    if shard.size == 1:
        return x
    n = x.shape[0]
    send = x.unsqueeze(0).expand(shard.size, *x.shape).reshape(shard.size * n, *x.shape[1:])
    out = x.new_empty((sum(counts), *x.shape[1:]))
    dist.all_to_all_single(out, send.contiguous(), counts, [n] * shard.size, group=shard.group)
    return out


def _scatter_sum_rows(y: torch.Tensor, counts: list[int], shard: PlanShard) -> torch.Tensor:
    """The transpose of :func:`_gather_rows`: rank ``r`` gets the group-wide sum of the ``counts[r]`` rows it owns."""
    if shard.size == 1:
        return y
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


# ---- lm_head: fused (vocab-parallel) logits + cross-entropy ----------------------------------------------------

def _chunks(n: int, rows: int, elements: int | None, device: torch.device) -> Iterator[slice]:
    if elements is None:
        elements = CE_CHUNK_ELEMENTS.get(device.type, CE_CHUNK_ELEMENTS["cpu"])
    step = max(1, elements // max(rows, 1))
    for start in range(0, n, step):
        yield slice(start, min(n, start + step))


def _owners(counts: list[int], device: torch.device) -> torch.Tensor:
    """The group rank each gathered token came from (``counts[q]`` tokens from rank ``q``, in rank order)."""
    return torch.repeat_interleave(torch.arange(len(counts), device=device), torch.tensor(counts, device=device),
                                   output_size=sum(counts))


def _token_coefficients(valid: torch.Tensor, counts: list[int], shard: PlanShard, num_items) -> torch.Tensor:
    """``d(owner's loss) / d(token's cross-entropy)`` for every gathered token (fp32 ``[N]``): 1 / its owner's
    denominator — ``num_items_in_batch`` if given, else the owner's number of counted tokens — and 0 where ignored.
    A group of one needs no host sync here (no shape depends on data, nothing is copied from the host)."""
    device = valid.device
    if num_items is None:
        counted = valid.float()
    elif torch.is_tensor(num_items):
        mine = num_items.to(device=device, dtype=torch.float32).reshape(1)
    else:
        mine = torch.full((1,), float(num_items), device=device)
    if shard.size == 1:
        return torch.where(valid, 1.0 / (counted.sum() if num_items is None else mine[0]), 0.0)
    owners = _owners(counts, device)
    if num_items is None:
        denominators = torch.zeros(shard.size, device=device).index_add_(0, owners, counted)
    else:
        denominators = _gather_rows(mine, [1] * shard.size, shard)
    return torch.where(valid, 1.0 / denominators[owners], 0.0)


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """This rank's loss (sum of its tokens' cross-entropies over its denominator) against a vocab split over the
    head group; a group of one holds the whole vocab.

    Forward, one pass over chunks of the group's gathered tokens: local logits ``[chunk, V/s]`` → local
    log-sum-exp and target logit, combined over the group by one all-gather of ``[2, chunk]`` statistics → the
    exact per-token losses; and, when a gradient is wanted, ``(softmax − onehot) · c`` (``c`` = 1 / the token
    owner's denominator) straight into the hidden states' and the weight's gradients. Logits are never stored and
    the head's GEMMs run once each (no recompute). Backward scales those by the upstream gradient: the hidden
    states' rows by this rank's, the weight's by the group's — when the group's upstream gradients differ (a
    per-rank loss scale) the weight's gradient is recomputed chunk by chunk, exactly.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, shard: PlanShard, counts: list[int], ignore_index: int, num_items,
                want: tuple[bool, bool], chunk_elements: int | None, kernels: str):
        device = hidden.device
        compute = _compute_dtype(hidden, weight)
        ctx.hidden_dtype = hidden.dtype
        with torch.autocast(device.type, enabled=False):  # one explicit compute dtype, as autocast would pick
            return _FusedLinearCrossEntropy._forward(ctx, hidden.detach().to(compute), weight, weight.to(compute),
                                                     targets, shard, counts, ignore_index, num_items, want,
                                                     chunk_elements, kernels)

    @staticmethod
    def _forward(ctx, hidden, weight_input, weight, targets, shard, counts, ignore_index, num_items, want,
                 chunk_elements, kernels):
        h_all = _gather_rows(hidden, counts, shard)  # [N, H]
        t_all = _gather_rows(targets, counts, shard)  # [N]
        valid = t_all != ignore_index
        vocab = shard.rows * shard.size
        torch._assert_async(((t_all >= 0) & (t_all < vocab) | ~valid).all(),
                            f"fused loss: a target is outside the vocabulary [0, {vocab}) and is not ignore_index")
        local_t = t_all - shard.offset
        owned = valid & (local_t >= 0) & (local_t < shard.rows)
        index = torch.where(owned, local_t, 0)
        coef = _token_coefficients(valid, counts, shard, num_items)
        n = h_all.shape[0]
        losses = torch.zeros(n, dtype=torch.float32, device=hidden.device)
        group_lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        want_h, want_w = want
        grad_h = torch.empty_like(h_all) if want_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_w else None
        for c in _chunks(n, shard.rows, chunk_elements, hidden.device):
            z, stats, shift = _chunk_logits(h_all[c], weight, index[c], owned[c], kernels)
            if shard.size > 1:
                gathered = stats.new_empty((shard.size * 2, stats.shape[1]))  # rank by rank on dim 0
                dist.all_gather_into_tensor(gathered, stats, group=shard.group)
                gathered = gathered.view(shard.size, 2, -1)
                stats = torch.stack([torch.logsumexp(gathered[:, 0], dim=0), gathered[:, 1].sum(0)])
            group_lse[c] = stats[0]
            losses[c] = torch.where(valid[c], stats[0] - stats[1], 0.0)
            if want_h or want_w:
                p = _chunk_softmax_grad(z, stats[0], shift, index[c], owned[c], coef[c], kernels, weight.dtype)
                if want_h and grad_h.dtype == p.dtype:
                    torch.mm(p, weight, out=grad_h[c])  # straight into the rows (contiguous), no temporary
                elif want_h:
                    grad_h[c] = p @ weight
                if want_w:
                    _accumulate(grad_w, p.t(), h_all[c])
        start = sum(counts[:shard.rank])
        mine = slice(start, start + counts[shard.rank])
        loss = (losses[mine] * coef[mine]).sum()
        ctx.shard, ctx.counts, ctx.chunk_elements, ctx.kernels = shard, counts, chunk_elements, kernels
        saved = [grad_h, None if grad_w is None else grad_w.to(weight_input.dtype)]
        if shard.size > 1 and want_w:  # kept for the exact recompute when the group's upstream gradients differ
            saved += [h_all, weight_input, index, owned, coef, group_lse]
        ctx.save_for_backward(*saved)
        return loss

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        shard, counts = ctx.shard, ctx.counts
        grad_h, grad_w, *kept = ctx.saved_tensors
        grad = grad.float()
        hidden_grad = weight_grad = None
        if grad_h is not None:
            hidden_grad = (_scatter_sum_rows(grad_h, counts, shard) * grad).to(ctx.hidden_dtype)
        if grad_w is not None:
            if shard.size == 1:
                weight_grad = (grad_w * grad).to(grad_w.dtype)
            else:
                grads = _gather_rows(grad.reshape(1), [1] * shard.size, shard)  # every group rank's upstream grad
                if bool((grads == grads[0]).all()):
                    weight_grad = (grad_w * grads[0]).to(grad_w.dtype)
                else:
                    with torch.autocast(grad.device.type, enabled=False):
                        weight_grad = _recompute_weight_grad(*kept, grads, counts, shard, ctx.chunk_elements,
                                                             ctx.kernels)
        return hidden_grad, weight_grad, None, None, None, None, None, None, None, None


def _compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The head's GEMM dtype: autocast's where it is on (as ``nn.Linear`` would run), else the promoted one."""
    if torch.is_autocast_enabled(hidden.device.type):
        return torch.get_autocast_dtype(hidden.device.type)
    return torch.promote_types(hidden.dtype, weight.dtype)


def _accumulate(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` into the fp32 accumulator (in the GEMM itself when the operands are fp32 too)."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    else:
        acc.add_(a @ b)


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor, index: torch.Tensor, owned: torch.Tensor, kernels: str):
    """A chunk's local logits and their ``[2, rows]`` statistics: log-sum-exp over this rank's vocab rows, and the
    target's logit where owned. Returns ``(z, stats, shift)``. The Triton kernels leave ``z`` as the logits (in the
    GEMM's dtype; ``shift`` is ``None``). The torch path turns the fp32 ``z`` in place into ``exp(z − shift)``, with
    ``shift`` the rows' maxima: one chunk-sized tensor at a time (``torch.logsumexp`` would make a second) and one
    ``exp`` pass fewer, as the softmax reuses it."""
    z = h @ weight.t()
    if kernels == "triton":
        from . import loss_triton

        return z, loss_triton.row_stats(z, index, owned), None
    z = z.float()
    target = torch.where(owned, z.gather(1, index[:, None])[:, 0], 0.0)
    shift = z.amax(dim=-1)
    shift = torch.where(torch.isfinite(shift), shift, 0.0)  # all −inf rows (as torch.logsumexp does)
    lse = z.sub_(shift[:, None]).exp_().sum(dim=-1).log_().add_(shift)
    return z, torch.stack([lse, target]), shift


def _chunk_softmax_grad(z: torch.Tensor, lse: torch.Tensor, shift: torch.Tensor | None, index: torch.Tensor,
                        owned: torch.Tensor, coef: torch.Tensor, kernels: str, dtype: torch.dtype) -> torch.Tensor:
    """``(softmax(z) − onehot(target)) · coef`` per row in ``dtype``, computed in place on the chunk ``z`` as
    :func:`_chunk_logits` left it (``lse``: the group's log-sum-exp)."""
    if kernels == "triton":
        from . import loss_triton

        return loss_triton.softmax_grad_(z, lse, index, owned, coef)
    p = z.mul_(torch.exp(shift - lse)[:, None])  # exp(z − shift) · exp(shift − lse)
    p.scatter_add_(1, index[:, None], -owned[:, None].float())
    return p.mul_(coef[:, None]).to(dtype)


def _recompute_weight_grad(h_all, weight, index, owned, coef, group_lse, grads, counts, shard, chunk_elements,
                           kernels):
    """The weight's gradient when the group ranks' upstream gradients differ: each token's coefficient times its
    owner's upstream gradient, the logits recomputed chunk by chunk."""
    coef = coef * grads[_owners(counts, h_all.device)]
    weight_input, weight = weight, weight.to(h_all.dtype)  # the forward's compute dtype
    grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
    for c in _chunks(h_all.shape[0], shard.rows, chunk_elements, h_all.device):
        z, _, shift = _chunk_logits(h_all[c], weight, index[c], owned[c], kernels)
        _accumulate(grad_w, _chunk_softmax_grad(z, group_lse[c], shift, index[c], owned[c], coef[c], kernels,
                                                weight.dtype).t(), h_all[c])
    return grad_w.to(weight_input.dtype)


@dataclass
class VocabParallelLogits(ModelOutput):
    """What a fused ``lm_head`` returns in place of logits: this rank's loss (``None`` without labels) and the full
    ``[…, V]`` logits only inside :func:`full_logits`. The model's ``loss_function`` passes the loss on; the model's
    output carries ``.logits`` (``None`` unless asked)."""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None


@dataclass
class _LossRequest:
    targets: torch.Tensor  # shifted labels, shaped like the hidden states' token dims
    ignore_index: int
    num_items: torch.Tensor | int | None  # ``num_items_in_batch``: the loss's denominator when given


class _HeadState:
    def __init__(self, shard: PlanShard, chunk_elements: int | None, kernels: str) -> None:
        _check_kernel_name(kernels)
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
    z = _GatherRows.apply(hidden, counts, shard) @ weight.t()  # [N, V/s]
    n = counts[shard.rank]
    z = all_to_all(z, [n] * shard.size, counts, shard.group)  # [s·T, V/s], by source rank = vocab block
    return torch.cat([block.view(*lead, -1) for block in z.view(shard.size, n, -1).unbind(0)], dim=-1)


def _lm_head_forward(self: nn.Linear, hidden_states: torch.Tensor) -> VocabParallelLogits | torch.Tensor:
    state: _HeadState = self._xpar_head
    shard, request = state.shard, state.request
    weight = to_local(self.weight)  # [V/s, H]
    if request is None and shard.size == 1:  # a whole-vocab head without labels: plain logits, as transformers's
        return nn.functional.linear(hidden_states, weight)
    lead = hidden_states.shape[:-1]
    hidden = hidden_states.reshape(-1, hidden_states.shape[-1])
    counts = _group_counts(hidden.shape[0], shard, hidden.device)
    out = VocabParallelLogits()
    if request is not None:
        if request.targets.shape != lead:
            raise ValueError(f"fused loss: labels give targets of shape {tuple(request.targets.shape)} but the "
                             f"head sees hidden states of shape {tuple(lead)} (logits_to_keep with labels?)")
        out.loss = _fused_cross_entropy(hidden, weight, request.targets.reshape(-1).to(hidden.device), shard,
                                        counts, request.ignore_index, request.num_items, state.chunk_elements,
                                        state.kernels)
    if state.full_logits or request is None:  # without labels a forward is for its logits (generate, evaluation)
        out.logits = _head_full_logits(hidden, weight, counts, shard, lead)
    return out


def fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                               ignore_index: int = -100, *, num_items: torch.Tensor | int | None = None,
                               chunk_elements: int | None = None, kernels: str = "torch") -> torch.Tensor:
    """``cross_entropy(hidden @ weight.T, targets)`` — the sum over counted targets divided by ``num_items``
    (else their number) — without ``[tokens, V]`` logits: the fused head's computation for a custom training loop.
    ``hidden``: ``[..., H]``; ``weight``: ``[V, H]``; ``targets``: ``hidden``'s leading shape (already shifted)."""
    _check_kernel_name(kernels)
    if targets.shape != hidden.shape[:-1]:
        raise ValueError(f"targets of shape {tuple(targets.shape)} for hidden states of shape {tuple(hidden.shape)}")
    flat = hidden.reshape(-1, hidden.shape[-1])
    return _fused_cross_entropy(flat, weight, targets.reshape(-1), _whole_vocab(weight), [flat.shape[0]],
                                ignore_index, num_items, chunk_elements, kernels)


def _fused_cross_entropy(hidden, weight, targets, shard, counts, ignore_index, num_items, chunk_elements, kernels):
    """Apply the fused loss to ``[N, H]`` hidden states and ``[N]`` targets, computing only the gradients wanted."""
    if kernels == "triton" and not hidden.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("the fused loss's Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 on the CPU); "
                           f"the head got {hidden.device.type} hidden states")
    grad = torch.is_grad_enabled()
    want = (grad and hidden.requires_grad, grad and weight.requires_grad)
    return _FusedLinearCrossEntropy.apply(hidden, weight, targets, shard, counts, ignore_index, num_items, want,
                                          chunk_elements, kernels)


def _check_kernel_name(kernels: str) -> None:
    if kernels not in LOSS_KERNELS:
        raise ValueError(f"kernels must be one of {LOSS_KERNELS}, got {kernels!r}")


def _whole_vocab(weight: torch.Tensor) -> PlanShard:
    """A head group of one: every vocab row here, nothing communicated."""
    return PlanShard(None, 1, 0, weight.shape[0])


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
    return _forward_logits_transform(type(model), next((n for n, m in model.named_children() if m is module), None))


@functools.cache
def _forward_logits_transform(cls: type, name: str | None) -> str | None:
    """:func:`logits_transform` for a model class and its head's attribute name: the source is read once per class
    (``parallelize``, ``install_fused_loss`` and every mesh the planner tries ask again)."""
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


def _check_head(model: nn.Module, module: nn.Module) -> None:
    if not isinstance(module, nn.Linear) or module.bias is not None:
        raise PlanError(f"the fused head needs a bias-free nn.Linear, got {module}")
    if getattr(model, "get_output_embeddings", lambda: None)() is not module:
        raise PlanError("the fused head applies to the model's output embeddings (get_output_embeddings())")
    if getattr(model.config, "final_logit_softcapping", None) is not None:
        raise PlanError("the fused head does not support final_logit_softcapping")
    changed = logits_transform(model, module)
    if changed:
        raise PlanError(f"the fused head computes the loss inside the head, but {type(model).__name__} changes "
                        f"the logits before its loss ({changed!r}); leave 'head' out of the mesh (parallelize's "
                        "default fused loss skips such models)")
    if hasattr(module, "_xpar_head"):
        raise PlanError("the model's output head is already fused")


def install_vocab_lm_head(model: nn.Module, module: nn.Module, shard: PlanShard,
                          chunk_elements: int | None = None, kernels: str = "torch") -> None:
    """Make ``module`` (the model's output head, holding ``shard.rows`` vocab rows here) a vocab-parallel head with
    a fused cross-entropy, and hook ``model``'s forward and ``loss_function`` so that ``model(…, labels=…)`` returns
    the usual loss. Every rank of a head group must call the model alike (labels or not, :func:`full_logits` or not).
    A group of one (:func:`install_fused_loss`) is the same fused loss over the whole vocab, with no collective.
    """
    _check_head(model, module)
    module._xpar_head = _HeadState(shard, chunk_elements, kernels)
    module.forward = types.MethodType(_lm_head_forward, module)

    fallback = model.loss_function
    model.loss_function = functools.partial(_fused_loss, fallback)
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
            state.request = _LossRequest(targets, ignore_index, extra.get("num_items_in_batch"))
        try:
            return _unwrap_logits(original(*args, **kwargs))
        finally:
            state.request = None

    model.forward = forward


def fusable_head(model: nn.Module) -> nn.Module | None:
    """The model's output head if the fused loss applies to it (a bias-free ``nn.Linear`` without logit
    softcapping, not fused yet), else ``None``."""
    module = getattr(model, "get_output_embeddings", lambda: None)()
    try:
        _check_head(model, module)
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
    :mod:`xpar_zoo.loss_triton` (CUDA, or the CPU under ``TRITON_INTERPRET=1``) instead of torch ops. Returns
    ``model``.

    The loss and its gradients equal transformers' ``ForCausalLMLoss`` (``ignore_index``, ``shift_labels``,
    ``num_items_in_batch``), except that a batch whose targets are all ignored gives 0 instead of NaN.
    """
    module = getattr(model, "get_output_embeddings", lambda: None)()
    _check_head(model, module)  # before reading its weight
    install_vocab_lm_head(model, module, _whole_vocab(module.weight), chunk_elements, kernels)
    return model


@contextlib.contextmanager
def full_logits(model: nn.Module) -> Iterator[None]:
    """Inside this block a model with a fused (vocab-parallel or whole-vocab) head returns the full
    ``[batch, seq, V]`` logits of this rank's tokens in ``out.logits``, labels or not (differentiable; for evaluation
    and generation). Outside it, ``out.logits`` is ``None`` whenever the head computed the loss (and always under a
    ``head`` plan). A model without a fused head is unaffected."""
    heads = [m._xpar_head for m in model.modules() if hasattr(m, "_xpar_head")]
    previous = [h.full_logits for h in heads]
    for h in heads:
        h.full_logits = True
    try:
        yield
    finally:
        for h, p in zip(heads, previous):
            h.full_logits = p
