"""A pure-torch reference of the flash-attention kernels' contract, for machines where ``flash_attn`` cannot run (no
GPU): ``flash_attn_func`` and ``flash_attn_varlen_func`` as transformers calls them, on ``[batch, seq, heads, dim]``
(varlen: ``[tokens, heads, dim]`` cut by ``cu_seqlens``). What the contract says and this keeps: no mask argument;
``causal`` aligned bottom-right when a sequence has fewer queries than keys (flash_attn >= 2.1); ``window_size =
(left, right)`` around that diagonal (-1: unbounded); grouped key/value heads; ``softcap``; a per-head sink
``s_aux`` in the softmax denominator (as vLLM's FA3 takes it); a query with no key gets a zero output. Dropout is not
modelled (refused). Differentiable, so training runs through it.

:func:`installed` puts the two functions where transformers keeps the flash kernels it loaded
(:func:`xpar_zoo.compat.load_flash_kernels`): transformers' whole flash path (``flash_attention_forward``, its
unpadding, its varlen kwargs, its window and sink arguments) runs unchanged around them.
"""

from __future__ import annotations

import contextlib

import torch


def _attend(q, k, v, softmax_scale, causal, window_size, softcap, s_aux) -> torch.Tensor:
    """``q [b, sq, h, d]``, ``k [b, sk, kv, d]``, ``v [b, sk, kv, dv]`` → ``[b, sq, h, dv]``."""
    sq, heads, sk = q.shape[1], q.shape[2], k.shape[1]
    k, v = (t.repeat_interleave(heads // t.shape[2], dim=2) for t in (k, v))
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    qpos = torch.arange(sq, device=q.device)[:, None] + (sk - sq)  # bottom-right
    kpos = torch.arange(sk, device=q.device)[None, :]
    allowed = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
    left, right = window_size
    if causal:
        allowed &= kpos <= qpos
    if left >= 0:
        allowed &= kpos >= qpos - left
    if right >= 0:
        allowed &= kpos <= qpos + right
    scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    if s_aux is not None:
        sink = s_aux.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    probs = probs * allowed  # a query with no key: zero
    return torch.einsum("bhqk,bkhd->bqhd", probs, v)


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False, s_aux=None):
    if dropout_p or alibi_slopes is not None:
        raise NotImplementedError("the reference flash kernel models neither dropout nor ALiBi")
    return _attend(q, k, v, softmax_scale, causal, window_size, softcap, s_aux)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, s_aux=None):
    if dropout_p or alibi_slopes is not None:
        raise NotImplementedError("the reference flash kernel models neither dropout nor ALiBi")
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    if len(cu_q) != len(cu_k):
        raise ValueError(f"cu_seqlens_q has {len(cu_q) - 1} sequences, cu_seqlens_k {len(cu_k) - 1}")
    outs = [_attend(q[None, cu_q[i]:cu_q[i + 1]], k[None, cu_k[i]:cu_k[i + 1]], v[None, cu_k[i]:cu_k[i + 1]],
                    softmax_scale, causal, window_size, softcap, s_aux)[0] for i in range(len(cu_q) - 1)]
    return torch.cat(outs) if outs else q.new_zeros(0, q.shape[1], v.shape[-1])


@contextlib.contextmanager
def installed(implementation: str = "flash_attention_2"):
    """transformers' ``implementation`` runs on the reference kernels inside the block (loaded as transformers
    loads ``flash_attn``'s); unloaded after it."""
    from ..compat import load_flash_kernels, unload_flash_kernels

    load_flash_kernels(implementation, flash_attn_func, flash_attn_varlen_func)
    try:
        yield
    finally:
        unload_flash_kernels()
