"""The fused linear + cross-entropy: a causal LM's head and loss in one pass over chunks of tokens, never holding
``[tokens, V]`` logits — over the whole vocab (a group of one), or over a vocab split across a ``head`` plan group
(each rank holds ``V/s`` rows; per-token statistics are combined over the group). Pure tensor code: the module wiring
(which head, which labels) is in :mod:`xpar_zoo.styles.vocab`.

One pass per chunk: the chunk's logits, its log-sum-exp and target logit (combined over a head group by one
all-gather of ``[2, chunk]`` statistics), the loss, and — when a gradient is wanted — ``softmax − onehot`` straight
into the hidden states' and the weight's gradients; backward only scales them. At most ``CE_CHUNK_ELEMENTS`` logits
exist at once, in one tensor. ``kernels="triton"``: each chunk's statistics and gradient by
:mod:`xpar_zoo.kernels.loss_triton`.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist

from ..compat import assert_async, is_fake
from ..errors import BatchError, KernelError
from ..kernels import triton_runs_on
from ..parallel.collectives import gather_rows, scatter_sum_rows
from ..parallel.mesh import PlanShard

# Logits per chunk ``[tokens, V/s]`` in the fused head, by device type: bounds its memory, yet large enough that
# re-reading the weight-gradient accumulator per chunk stays cheap (figures: docs/design.md, "The fused loss").
CE_CHUNK_ELEMENTS = {"cuda": 1 << 28, "cpu": 1 << 26}
LOSS_KERNELS = ("torch", "triton")


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
        denominators = gather_rows(mine, [1] * shard.size, shard)
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
        h_all = gather_rows(hidden, counts, shard)  # [N, H]
        t_all = gather_rows(targets, counts, shard)  # [N]
        valid = t_all != ignore_index
        vocab = shard.rows * shard.size
        assert_async(((t_all >= 0) & (t_all < vocab) | ~valid).all(),
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
                dist.all_gather_single(gathered, stats, group=shard.group)
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
            hidden_grad = (scatter_sum_rows(grad_h, counts, shard) * grad).to(ctx.hidden_dtype)
        if grad_w is not None:
            if shard.size == 1:
                weight_grad = (grad_w * grad).to(grad_w.dtype)
            else:
                grads = gather_rows(grad.reshape(1), [1] * shard.size, shard)  # every group rank's upstream grad
                # equal on every rank under the global-batch loss; a simulated world's (fake) cannot tell: equal
                if is_fake(grads) or bool((grads == grads[0]).all()):
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
        from ..kernels import loss_triton

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
        from ..kernels import loss_triton

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


def fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                               ignore_index: int = -100, *, num_items: torch.Tensor | int | None = None,
                               chunk_elements: int | None = None, kernels: str = "torch") -> torch.Tensor:
    """``cross_entropy(hidden @ weight.T, targets)`` — the sum over counted targets divided by ``num_items``
    (else their number) — without ``[tokens, V]`` logits: the fused head's computation for a custom training loop.
    ``hidden``: ``[..., H]``; ``weight``: ``[V, H]``; ``targets``: ``hidden``'s leading shape (already shifted)."""
    check_kernel_name(kernels)
    if targets.shape != hidden.shape[:-1]:
        raise BatchError(f"targets of shape {tuple(targets.shape)} for hidden states of shape {tuple(hidden.shape)}")
    flat = hidden.reshape(-1, hidden.shape[-1])
    return fused_cross_entropy(flat, weight, targets.reshape(-1), whole_vocab(weight), [flat.shape[0]],
                                ignore_index, num_items, chunk_elements, kernels)


def fused_cross_entropy(hidden, weight, targets, shard, counts, ignore_index, num_items, chunk_elements, kernels):
    """Apply the fused loss to ``[N, H]`` hidden states and ``[N]`` targets, computing only the gradients wanted."""
    if kernels == "triton" and not triton_runs_on(hidden):
        raise KernelError("the fused loss's Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 on the CPU); "
                           f"the head got {hidden.device.type} hidden states")
    grad = torch.is_grad_enabled()
    want = (grad and hidden.requires_grad, grad and weight.requires_grad)
    return _FusedLinearCrossEntropy.apply(hidden, weight, targets, shard, counts, ignore_index, num_items, want,
                                          chunk_elements, kernels)


def check_kernel_name(kernels: str) -> None:
    if kernels not in LOSS_KERNELS:
        raise KernelError(f"kernels must be one of {LOSS_KERNELS}, got {kernels!r}")


def whole_vocab(weight: torch.Tensor) -> PlanShard:
    """A head group of one: every vocab row here, nothing communicated."""
    return PlanShard(None, 1, 0, weight.shape[0])
