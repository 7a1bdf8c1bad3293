"""Long context on one GPU (issue 30, not a test; run by bench/device_long_context.sh): what a single GPU can show of
sp/cp's inner attention, since simulated ranks need a process group per GPU. For one cp rank of ``cp`` at ``S``
tokens (its head and tail chunks, ``S/cp`` queries, against the cp-gathered keys of the whole row):

1. correctness against full causal attention on the whole row (sdpa ``is_causal``; the rank's rows of it): sdpa on
   the lower-right path (:func:`xpar_zoo.styles.sequence.lower_right_attention`), flash_attention_2 through
   :func:`~xpar_zoo.styles.sequence.flash_inner` when ``flash_attn`` imports, flex through
   :func:`~xpar_zoo.styles.sequence.flex_inner`; on packed rows (varlen / BlockMask) against sdpa under the dense mask
   of the global indices, and flex with sinks (gpt_oss' ``s_aux``, CUDA only) against an explicit softmax;
2. time and peak CUDA memory of one forward+backward of that rank's inner attention at ``S`` against the full
   attention of the whole row on one GPU.

    python bench/gpu_long_context.py [--seq 32768] [--cp 4] [--heads 32] [--kv-heads 8] [--dim 128] [--device cuda]

Prints one JSON line per part and writes ``$OUT/long_context.json`` when ``OUT`` is set.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time
import types

import torch

from xpar_zoo.compat import config_with_attn_implementation
from xpar_zoo.styles.sequence_inner import (
    flash_inner,
    flex_inner,
    lower_right_attention,
)
from xpar_zoo.styles.sequence_layout import document_ids, token_layout
from xpar_zoo.styles.sequence_masks import SequenceForward

RESULTS: dict = {}


def _record(name: str, value) -> None:
    RESULTS[name] = value
    print(json.dumps({name: value}), flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "long_context.json"), "w") as f:
            json.dump(RESULTS, f, indent=1)


def _module(inner: str):
    module = torch.nn.Linear(2, 2)
    module.is_causal, module.training = True, True
    module.config = config_with_attn_implementation(types.SimpleNamespace(), inner)
    return module


def _inputs(a, seq, c, dtype, device, packed=False):
    layout = token_layout(seq, 1, a.cp, 0, c)
    docs = None
    if packed:
        pos = torch.arange(seq, device=device)[None]
        for cut in (seq // 3, seq // 2 + 7):
            pos[:, cut:] = torch.arange(seq - cut, device=device)
        docs = document_ids(pos)
    batch = SequenceForward(layout.queries.to(device), layout.keys.to(device), docs, None)
    g = torch.Generator(device=device).manual_seed(c)
    q = torch.randn(1, a.heads, seq, a.dim, device=device, dtype=dtype, generator=g)
    k, v = (torch.randn(1, a.kv_heads, seq, a.dim, device=device, dtype=dtype, generator=g) for _ in range(2))
    return batch, q, k, v


def _runners(a):
    scale = a.dim ** -0.5
    out = {"sdpa_lower_right": lambda b, q, k, v: lower_right_attention(q, k, v, b, 0.0, scale)}
    try:
        import flash_attn  # noqa: F401

        out["flash_attention_2"] = lambda b, q, k, v: flash_inner(b, _module("flash_attention_2"), q, k, v, True,
                                                                  0.0, scale, None, {})
    except ImportError:
        _record("flash_attention_2", "flash_attn does not import here: skipped")
    out["flex_attention"] = lambda b, q, k, v: flex_inner(b, _module("flex_attention"), q, k, v, True, 0.0, scale,
                                                          None, {})
    return out


def correctness(a, dtype, device) -> None:
    seq = min(a.seq, 8192)
    for c in (0, a.cp - 1):
        for packed in (False, True):
            batch, q_row, k_row, v_row = _inputs(a, seq, c, dtype, device, packed)
            q, k, v = q_row[:, :, batch.queries], k_row[:, :, batch.keys], v_row[:, :, batch.keys]
            groups = a.heads // a.kv_heads
            want = torch.nn.functional.scaled_dot_product_attention(
                q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1),
                attn_mask=batch.mask(True, None, q.dtype), scale=a.dim ** -0.5).transpose(1, 2)
            for name, run in _runners(a).items():
                if packed and name == "sdpa_lower_right":
                    continue  # plain rows only
                try:
                    err = (run(batch, q, k, v).float() - want.float()).abs().max().item()
                    _record(f"correct/{name}/cp_rank{c}/{'packed' if packed else 'plain'}/S{seq}", err)
                except Exception as e:  # report and go on: one script, one device call
                    _record(f"correct/{name}/cp_rank{c}", f"{type(e).__name__}: {e}"[:300])


def flex_sinks(a, dtype, device) -> None:
    batch, q_row, k_row, v_row = _inputs(a, 2048, 0, dtype, device)
    q, k, v = q_row[:, :, batch.queries], k_row[:, :, batch.keys], v_row[:, :, batch.keys]
    sinks = torch.randn(a.heads, device=device, dtype=dtype)
    try:
        got = flex_inner(batch, _module("flex_attention"), q, k, v, True, 0.0, a.dim ** -0.5, None, {"s_aux": sinks})
        groups = a.heads // a.kv_heads
        scores = (q.float() @ k.float().repeat_interleave(groups, 1).transpose(-1, -2)) * a.dim ** -0.5
        scores = scores + batch.mask(True, None, torch.float32)
        full = torch.cat([scores, sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:3], 1)], -1)
        probs = torch.softmax(full, -1)[..., :-1]
        want = (probs @ v.float().repeat_interleave(groups, 1)).transpose(1, 2)
        _record("correct/flex_attention/sinks", (got.float() - want).abs().max().item())
    except Exception as e:
        _record("correct/flex_attention/sinks", f"{type(e).__name__}: {e}"[:300])


def _measure(fn, q, k, v):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    fn(q, k, v).sum().backward()  # warm-up (compiles flex)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    t = time.perf_counter()
    fn(q, k, v).float().sum().backward()
    torch.cuda.synchronize()
    return {"ms": 1e3 * (time.perf_counter() - t), "peak_mib": (torch.cuda.max_memory_allocated() - base) / 2 ** 20}


def speed(a, dtype, device) -> None:
    batch, q_row, k_row, v_row = _inputs(a, a.seq, 0, dtype, device)
    q, k, v = q_row[:, :, batch.queries], k_row[:, :, batch.keys], v_row[:, :, batch.keys]
    _record(f"speed/full_row_sdpa_causal/S{a.seq}", _measure(lambda q, k, v: torch.nn.functional.
            scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), q_row, k_row, v_row))
    for name, run in _runners(a).items():
        try:
            _record(f"speed/{name}/cp{a.cp}_rank0/S{a.seq}", _measure(functools.partial(run, batch), q, k, v))
        except Exception as e:
            _record(f"speed/{name}", f"{type(e).__name__}: {e}"[:300])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=32768)
    ap.add_argument("--cp", type=int, default=4)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()
    device = torch.device(a.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    _record("versions", {"torch": torch.__version__, "device": torch.cuda.get_device_name() if device.type == "cuda"
                         else "cpu"})
    with torch.no_grad():
        correctness(a, dtype, device)
        if device.type == "cuda":
            flex_sinks(a, dtype, device)
    if device.type == "cuda":
        speed(a, dtype, device)


if __name__ == "__main__":
    main()
