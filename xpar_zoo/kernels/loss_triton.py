"""The fused head's elementwise work on a chunk of logits as two Triton kernels (the GEMMs stay cuBLAS').

On a ``[rows, V]`` chunk of logits ``z`` (the GEMM's output dtype, bf16 in training) the torch path spends about
40 bytes of memory traffic per logit (upcast, log-sum-exp's passes, exp, scatter, scale, downcast). Here:

``_row_stats``
    per row, one pass over ``z``: the log-sum-exp (online max / sum, fp32) and the target's logit (0 where this
    rank does not own the target) — read ``z`` once;
``_softmax_grad``
    per row, ``(exp(z − lse) − onehot(target)) · coef`` written over ``z`` in place — read once, write once.

Between them a vocab-parallel head combines the statistics over its group. Used by :mod:`xpar_zoo.styles.vocab` when the
head's kernels are ``"triton"`` (``install_fused_loss(model, kernels="triton")``); runs under Triton's interpreter
(``TRITON_INTERPRET=1``) on the CPU, which is how the tests check it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..environment import triton_interpreter

if triton_interpreter() and type(tl.sum).__name__ != "InterpretedFunction":
    raise ImportError("TRITON_INTERPRET=1 was set after Triton was first imported (transformers imports it early): "
                      "set it in the environment before Python starts")

BLOCK_V = 4096


@triton.jit
def _row_stats(z_ptr, stride_z, target_ptr, owned_ptr, lse_ptr, tlogit_ptr, V, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = z_ptr + row * stride_z
    cols = tl.arange(0, BLOCK)
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK], tl.float32)
    for start in range(0, V, BLOCK):
        z = tl.load(base + start + cols, mask=start + cols < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, z)
        # lanes that have seen only -inf keep s = 0 (avoid exp(-inf - -inf) = nan)
        s = tl.where(m_new == float("-inf"), 0.0, s * tl.exp(m - m_new) + tl.exp(z - m_new))
        m = m_new
    row_max = tl.max(m, axis=0)
    total = tl.sum(tl.where(m == float("-inf"), 0.0, s * tl.exp(m - row_max)), axis=0)
    tl.store(lse_ptr + row, row_max + tl.log(total))
    owned = tl.load(owned_ptr + row)
    target = tl.load(target_ptr + row)
    tlogit = tl.load(base + target, mask=owned != 0, other=0.0).to(tl.float32)
    tl.store(tlogit_ptr + row, tl.where(owned != 0, tlogit, 0.0))


@triton.jit
def _softmax_grad(z_ptr, stride_z, target_ptr, owned_ptr, lse_ptr, coef_ptr, V, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = z_ptr + row * stride_z
    cols = tl.arange(0, BLOCK)
    lse = tl.load(lse_ptr + row)
    coef = tl.load(coef_ptr + row)
    target = tl.load(target_ptr + row)
    owned = tl.load(owned_ptr + row)
    for start in range(0, V, BLOCK):
        idx = start + cols
        mask = idx < V
        z = tl.load(base + idx, mask=mask, other=0.0).to(tl.float32)
        p = tl.exp(z - lse) - tl.where((idx == target) & (owned != 0), 1.0, 0.0)
        tl.store(base + idx, (p * coef).to(z_ptr.dtype.element_ty), mask=mask)


def row_stats(z: torch.Tensor, target: torch.Tensor, owned: torch.Tensor) -> torch.Tensor:
    """``[2, rows]`` fp32: each row's log-sum-exp and its target's logit (0 where not ``owned``)."""
    rows, vocab = z.shape
    out = torch.empty(2, rows, dtype=torch.float32, device=z.device)
    if rows:
        _launch(_row_stats, (rows,), z, z.stride(0), target, owned, out[0], out[1], vocab,
                BLOCK=min(BLOCK_V, triton.next_power_of_2(vocab)))
    return out


def softmax_grad_(z: torch.Tensor, lse: torch.Tensor, target: torch.Tensor, owned: torch.Tensor,
                  coef: torch.Tensor) -> torch.Tensor:
    """``z ← (softmax(z) − onehot(target)) · coef`` per row, in place (``lse``: the rows' log-sum-exp over the whole
    vocab; the onehot only where ``owned``). Returns ``z``."""
    rows, vocab = z.shape
    if rows:
        _launch(_softmax_grad, (rows,), z, z.stride(0), target, owned, lse.contiguous(), coef.float().contiguous(),
                vocab, BLOCK=min(BLOCK_V, triton.next_power_of_2(vocab)))
    return z


def _launch(kernel, grid, *args, **meta) -> None:
    """Every launch goes through here (``bench/compile_sm90.py`` records them to compile for the H200)."""
    kernel[grid](*args, **meta)
