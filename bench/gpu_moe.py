"""GPU MoE benchmark (issue 9): xpar_zoo's experts path against transformers' ``grouped_mm`` and ``eager`` experts,
side by side in one run, plus a 4-layer Qwen3-30B-A3B-shaped model's training tokens/s.

    python bench/gpu_moe.py                 # on a GPU: correctness, then timings; JSON to $OUT/gpu_moe.json
    python bench/gpu_moe.py --smoke         # tiny shapes, any device (checks that the script runs)
    python bench/gpu_moe.py --loss-only 2048,1024,50000 --fp32   # the loss section alone (e.g. on the CPU)
    TRITON_INTERPRET=1 python bench/gpu_moe.py --smoke   # the same, with the Triton kernels interpreted on the CPU

Implementations: ``xpar_zoo`` (the Triton kernels of ``xpar_zoo.kernels.moe_triton``, with the best tiles of a short
sweep run first), ``xpar_zoo_torch`` (our torch path: grouped_mm and torch routing), transformers'
``grouped_mm`` and ``eager``. Also timed: each Triton kernel alone (where the time goes), the raw
``torch._grouped_mm`` GEMMs on pre-permuted balanced rows, and a dense bf16 matmul (the roofline).

The block is Qwen3-30B-A3B's MoE block (H=2048, I=768, E=128, top-8) on T=16384 tokens, bf16, forward + backward.
Expert FLOPs counted as 18·T·k·H·I (gate_up and down GEMMs, forward once, backward twice); router FLOPs ignored.
Every figure is reported with the ratio to transformers' ``grouped_mm`` from the same run.

The head + loss alone (``loss``: T=16384, H=2048, V=151936) is timed too: transformers' logits + ``ForCausalLMLoss``
against xpar_zoo's fused linear + cross-entropy (torch and Triton chunk kernels, chunk sizes 2^26 / 2^28 / 2^30),
with peak memory and errors against fp32. The model is then run with the fastest fused variant
(``xpar_zoo``: Triton experts + fused loss; ``grouped_mm_fused_loss``: the loss's share alone).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import sys
import time
import traceback
import types

import torch


def _import_experts_path():
    """Register the ``xpar_zoo`` experts implementation. On the H200 image (torch 2.11, the repository on
    ``PYTHONPATH`` rather than installed) the package's ``__init__`` cannot import (torch 2.13's FSDP API, the
    installed ``xpar_zoo.converters`` mapping); the experts path and the fused loss need neither, so there the
    package is entered without running its ``__init__``."""
    try:
        import xpar_zoo.styles.experts  # noqa: F401
    except ImportError:
        for name in [m for m in sys.modules if m == "xpar_zoo" or m.startswith("xpar_zoo.")]:
            del sys.modules[name]
        package = types.ModuleType("xpar_zoo")
        package.__path__ = [os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "xpar_zoo")]
        sys.modules["xpar_zoo"] = package
        import xpar_zoo.styles.experts  # noqa: F401
    return sys.modules["xpar_zoo.styles.experts"]


set_experts_kernels = _import_experts_path().set_experts_kernels
from xpar_zoo.loss.fused import fused_linear_cross_entropy  # noqa: E402
from xpar_zoo.styles.vocab import install_fused_loss  # noqa: E402  (after the package entry)

IMPLS = ("xpar_zoo", "xpar_zoo_torch", "grouped_mm", "eager")
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def _configure(model, impl, tiles):
    """``xpar_zoo``: the Triton kernels (``tiles``); ``xpar_zoo_torch``: our torch path."""
    if impl == "xpar_zoo":
        set_experts_kernels(model, "triton", tiles)
    elif impl == "xpar_zoo_torch":
        set_experts_kernels(model, "torch")


def _hf_impl(impl):
    return "xpar_zoo" if impl.startswith("xpar_zoo") else impl


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_fn(fn, device, warmup=3, iters=10) -> float:
    """Median seconds of ``fn()`` (CUDA events on GPU)."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def moe_block(hidden, inter, experts, top_k, device, dtype, impl, seed=0, tiles=None):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=inter, num_experts=experts,
                            num_experts_per_tok=top_k, norm_topk_prob=True)
    config._experts_implementation = _hf_impl(impl)
    torch.manual_seed(seed)
    block = Qwen3MoeSparseMoeBlock(config)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.02)
    _configure(block, impl, tiles)
    return block.to(device=device, dtype=dtype)


def check_block(args, device, dtype, tiles=None) -> dict:
    """Outputs and gradients of every implementation against eager in fp32 (bf16 tolerance)."""
    h, i, e, k, t = args.hidden, args.inter, args.experts, args.top_k, args.check_tokens
    torch.manual_seed(1)
    x = torch.randn(1, t, h, device=device)
    ref_block = moe_block(h, i, e, k, device, torch.float32, "eager")
    xr = x.clone().requires_grad_()
    ref_out = ref_block(xr)
    ref_out.float().pow(2).mean().backward()
    out = {}
    for impl in args.impls:
        block = moe_block(h, i, e, k, device, dtype, impl, tiles=tiles)
        xi = x.to(dtype).clone().requires_grad_()
        y = block(xi)
        y.float().pow(2).mean().backward()

        def rel(a, b):
            return ((a.float() - b.float()).norm() / b.float().norm()).item()

        out[impl] = {
            "out_rel_err": rel(y, ref_out),
            "dx_rel_err": rel(xi.grad, xr.grad),
            "d_gate_up_rel_err": rel(block.experts.gate_up_proj.grad, ref_block.experts.gate_up_proj.grad),
            "d_down_rel_err": rel(block.experts.down_proj.grad, ref_block.experts.down_proj.grad),
        }
    # ours must be as close to the fp32 reference as transformers' own bf16 path, give or take rounding
    worst = {key: max(out["grouped_mm"][key], 1e-3) for key in out["grouped_mm"]}
    for impl in ("xpar_zoo", "xpar_zoo_torch"):
        if impl in out:
            out[impl]["ok"] = all(out[impl][key] <= 2 * worst[key] for key in worst)
    return out


# All compile for sm_90 with wgmma, pipelining and no register spills (bench/compile_sm90.py --sweep); a 128-wide
# SwiGLU tile (two 128×128 accumulators) spills, so the SwiGLU tiles stay 64 wide.
TILE_CANDIDATES = [
    dict(),  # the defaults
    dict(stages=4),
    dict(bm=64, warps=4, stages=4),
    dict(bn=256, stages=3),
    dict(bk=32, bk_w=32, stages=5),
    dict(bp=128, bq=256, bk_w=32, stages=4),
]


def _moe_inputs(args, device, dtype, tokens):
    from xpar_zoo.kernels import moe_triton

    h, i, e, k = args.hidden, args.inter, args.experts, args.top_k
    g = torch.Generator(device=device).manual_seed(3)
    x = torch.randn(tokens, h, device=device, dtype=dtype, generator=g).requires_grad_()
    logits = torch.randn(tokens, e, device=device, generator=g)
    weights, index = logits.softmax(-1).topk(k)
    weights = weights.to(dtype).requires_grad_()
    gate_up = (0.02 * torch.randn(e, 2 * i, h, device=device, generator=g)).to(dtype).requires_grad_()
    down = (0.02 * torch.randn(e, h, i, device=device, generator=g)).to(dtype).requires_grad_()
    return moe_triton, x, index, weights, gate_up, down


def sweep_tiles(args, device, dtype) -> dict:
    """The experts (routing, both GEMMs, combine; forward + backward) on the block's shapes for each tile
    candidate; the fastest one is used for the ``xpar_zoo`` rows below."""
    mt, x, index, weights, gate_up, down = _moe_inputs(args, device, dtype, args.tokens)
    grad = torch.randn_like(x)
    flops = 18 * args.tokens * args.top_k * args.hidden * args.inter
    rows = []
    for cand in TILE_CANDIDATES[: 1 if INTERPRETED or device.type != "cuda" else None]:
        tiles = mt.INTERPRETER_TILES if INTERPRETED else mt.Tiles(**cand)
        for fuse in (True, False):  # the router-weight gradient fused into the backward GEMMs, or dy materialised

            def step(tiles=tiles, fuse=fuse):
                mt.moe_experts(x, index, weights, gate_up, down, tiles, fuse_router_grad=fuse).backward(grad)

            row = {"tiles": tiles.__dict__, "fuse_router_grad": fuse}
            try:
                sec = time_fn(step, device, warmup=2, iters=args.iters)
                row.update(ms=sec * 1e3, tflops=flops / sec / 1e12)
            except Exception as e:  # a candidate that does not compile (shared memory) is reported, not fatal
                row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            rows.append(row)
            print(json.dumps(row), flush=True)
    timed = [r for r in rows if "ms" in r]
    if not timed:
        raise RuntimeError("no tile candidate ran: " + "; ".join(r["error"] for r in rows))
    best = min(timed, key=lambda r: r["ms"])
    fused = [r for r in timed if r["fuse_router_grad"] and r["tiles"] == best["tiles"]]
    if not best["fuse_router_grad"]:
        print("note: materialising dy was faster; the xpar_zoo rows below still use moe_experts' default (fused)")
    return {"candidates": rows, "best": best, "best_tiles": mt.Tiles(**(fused or [best])[0]["tiles"])}


def check_no_host_sync(args, device, dtype, tiles) -> dict:
    """Forward + backward of the Triton experts, and of the fused loss with its Triton kernels, under
    ``torch.cuda.set_sync_debug_mode("error")``: any host sync (a ``.item()``, a ``bincount`` sizing its output, a
    data-dependent shape, a copy from pageable host memory) raises."""
    if device.type != "cuda":
        return {"skipped": "no CUDA"}
    mt, x, index, weights, gate_up, down = _moe_inputs(args, device, dtype, args.check_tokens)
    try:
        mt.moe_experts(x, index, weights, gate_up, down, tiles).sum().backward()  # compile first (may sync)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        mt.moe_experts(x, index, weights, gate_up, down, tiles).sum().backward()
        result = {"ok": True}
    except Exception as e:  # noqa: BLE001 - recorded; the fused loss's check below still runs
        result = {"ok": False, "error": f"{type(e).__name__}: {e}"[:300]}
    finally:
        torch.cuda.set_sync_debug_mode("default")
    # the fused loss with its Triton chunk kernels (a whole-vocab head: no collective, so no sync is needed either)
    hidden = x.detach().clone().requires_grad_()
    weight = torch.randn(4096, x.shape[1], device=device, dtype=dtype, requires_grad=True)
    targets = torch.randint(0, 4096, (x.shape[0],), device=device)
    targets[:7] = -100
    for num_items in (None, torch.tensor(100, device=device)):
        suffix = "" if num_items is None else "_num_items"
        try:
            fused_linear_cross_entropy(hidden, weight, targets, num_items=num_items, kernels="triton").backward()
            torch.cuda.synchronize()  # compiled before the check
            torch.cuda.set_sync_debug_mode("error")
            fused_linear_cross_entropy(hidden, weight, targets, num_items=num_items, kernels="triton").backward()
            result[f"fused_loss_ok{suffix}"] = True
        except Exception as e:  # noqa: BLE001 - a compile error must not hide the experts' result
            result[f"fused_loss_error{suffix}"] = f"{type(e).__name__}: {e}"[:300]
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return result


def check_perm_path(args, device, dtype, tiles) -> dict:
    """The EP path's regrouping inside the GEMMs (``grouped_swiglu(..., perm=...)``) against permuting around the
    plain grouped MLP: the same arithmetic on the same rows, so outputs and gradients must be bit-identical."""
    mt, x, index, weights, gate_up, down = _moe_inputs(args, device, dtype, args.check_tokens)
    rows = x.shape[0]
    counts = torch.zeros(args.experts, device=device, dtype=torch.long)
    counts[: args.experts // 2] = rows // (args.experts // 2)
    counts[0] += rows - int(counts.sum())
    perm = torch.randperm(rows, device=device)
    grad = torch.randn_like(x)
    y = mt.grouped_swiglu(x, gate_up, down, counts, tiles, perm=perm)
    got = [y] + list(torch.autograd.grad(y, (x, gate_up, down), grad))
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(rows, device=device)
    y2 = mt.grouped_swiglu(x[perm], gate_up, down, counts, tiles)[inverse]
    want = [y2] + list(torch.autograd.grad(y2, (x, gate_up, down), grad))
    names = ("out", "d_x", "d_gate_up", "d_down")
    return {name: bool(torch.equal(a, b)) for name, a, b in zip(names, got, want)}


def kernel_breakdown(args, device, dtype, tiles) -> dict:
    """Milliseconds of each kernel alone on the block's shapes (where the time goes)."""
    mt, x, index, weights, gate_up, down = _moe_inputs(args, device, dtype, args.tokens)
    t, k, h, i, e = args.tokens, args.top_k, args.hidden, args.inter, args.experts
    order, counts, src, slots = mt.route(index, e)
    row_end, tile_end = mt.group_layout(counts, tiles.bm)
    s = t * k
    gu_f, dn_f, dn_b, gu_b = mt.transposed(gate_up), mt.transposed(down), mt.as_is(down), mt.as_is(gate_up)
    with torch.no_grad():
        act, hh = mt.rows_gemm(x, gate_up, gu_f, i, h, row_end, tile_end, s, tiles, src=src, epilogue=1)
        y = mt.rows_gemm(act, down, dn_f, h, i, row_end, tile_end, s, tiles)
        dy = torch.randn_like(y)
        dout = torch.randn_like(x)
        row_w = weights.detach().reshape(-1)[order.long()]
        dh = mt.rows_gemm(dy, down, dn_b, i, h, row_end, tile_end, s, tiles, epilogue=2, h=hh)
        dxs = mt.rows_gemm(dh, gate_up, gu_b, h, 2 * i, row_end, tile_end, s, tiles)
    gemm = 2 * s * h * i  # one of the six GEMMs' FLOPs (gate_up ones are twice this)
    parts = {
        "routing (sort, counts, inverse)": (lambda: mt.route(index, e), 0),
        "gate_up fwd + SwiGLU (gathered rows)": (lambda: mt.rows_gemm(x, gate_up, gu_f, i, h, row_end, tile_end, s, tiles, src=src, epilogue=1), 2 * gemm),
        "down fwd": (lambda: mt.rows_gemm(act, down, dn_f, h, i, row_end, tile_end, s, tiles), gemm),
        "combine fwd": (lambda: mt.gather_sum(y, slots, weights.detach(), tiles, dtype), 0),
        "combine bwd (dw only; fused path)": (lambda: mt.combine_backward(dout, y, weights.detach(), order, tiles, write_dy=False), 0),
        "combine bwd (dw + dy)": (lambda: mt.combine_backward(dout, y, weights.detach(), order, tiles, write_dy=True), 0),
        "down bwd dA + SwiGLU bwd + act recompute (dout gathered, scaled)": (lambda: mt.rows_gemm(dout, down, dn_b, i, h, row_end, tile_end, s, tiles, src=src, scale=row_w, epilogue=2, h=hh, act_out=True), gemm),
        "down bwd dA + SwiGLU bwd + act recompute (dy)": (lambda: mt.rows_gemm(dy, down, dn_b, i, h, row_end, tile_end, s, tiles, epilogue=2, h=hh, act_out=True), gemm),
        "down bwd dA + SwiGLU bwd, no act (frozen down)": (lambda: mt.rows_gemm(dy, down, dn_b, i, h, row_end, tile_end, s, tiles, epilogue=2, h=hh), gemm),
        "down bwd dW (dout gathered, scaled)": (lambda: mt.k_gemm(dout, act, (e, h, i), row_end, tiles, dtype, left_src=src, left_scale=row_w), gemm),
        "down bwd dW (dy)": (lambda: mt.k_gemm(dy, act, (e, h, i), row_end, tiles, dtype), gemm),
        "gate_up bwd dX": (lambda: mt.rows_gemm(dh, gate_up, gu_b, h, 2 * i, row_end, tile_end, s, tiles), 2 * gemm),
        "gate_up bwd dW (gathered rows)": (lambda: mt.k_gemm(dh, x, (e, 2 * i, h), row_end, tiles, dtype, src=src), 2 * gemm),
        "dx gather-sum": (lambda: mt.gather_sum(dxs, slots, None, tiles, dtype), 0),
    }
    out = {}
    with torch.no_grad():
        for name, (fn, fl) in parts.items():
            sec = time_fn(fn, device, warmup=2, iters=args.iters)
            out[name] = {"ms": sec * 1e3, **({"tflops": fl / sec / 1e12} if fl else {})}
    return out


def _block_step(block, x, grad) -> None:
    block.zero_grad(set_to_none=True)
    block(x).backward(grad)


def _model_step(model, ids) -> None:
    model.zero_grad(set_to_none=True)
    model(input_ids=ids, labels=ids).loss.backward()


def bench_block(args, device, dtype, tiles=None) -> dict:
    h, i, e, k, t = args.hidden, args.inter, args.experts, args.top_k, args.tokens
    flops = 18 * t * k * h * i
    torch.manual_seed(2)
    x = torch.randn(1, t, h, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn(1, t, h, device=device, dtype=dtype)
    res = {}
    for impl in args.impls:
        if impl == "eager" and args.skip_eager:
            continue
        block = moe_block(h, i, e, k, device, dtype, impl, tiles=tiles)

        step = functools.partial(_block_step, block, x, grad)
        sec = time_fn(step, device, warmup=args.warmup, iters=args.iters)
        res[impl] = {"ms": sec * 1e3, "tflops": flops / sec / 1e12}
        if device.type == "cuda":  # peak memory of one step above what was allocated before it
            res[impl]["peak_step_memory_GiB"] = _cuda_peak_growth(step) / 2**30
        del block, step
    base = res["grouped_mm"]["ms"]
    for r in res.values():
        r["speedup_vs_grouped_mm"] = base / r["ms"]
    # The expert GEMMs alone through torch._grouped_mm on already-permuted, balanced tokens.
    if device.type == "cuda" and hasattr(torch, "_grouped_mm"):
        rows = t * k
        xs = torch.randn(rows, h, device=device, dtype=dtype, requires_grad=True)
        w1 = torch.randn(e, h, 2 * i, device=device, dtype=dtype, requires_grad=True)
        w2 = torch.randn(e, i, h, device=device, dtype=dtype, requires_grad=True)
        offs = torch.arange(1, e + 1, device=device, dtype=torch.int32) * (rows // e)

        def gemms():
            a = torch._grouped_mm(xs, w1, offs=offs)
            g, u = a.chunk(2, dim=-1)
            torch._grouped_mm((torch.nn.functional.silu(g) * u).contiguous(), w2, offs=offs).sum().backward()

        sec = time_fn(gemms, device, warmup=args.warmup, iters=args.iters)
        res["raw_grouped_mm_gemms"] = {"ms": sec * 1e3, "tflops": flops / sec / 1e12}
        a = torch.randn(8192, 8192, device=device, dtype=dtype)
        sec = time_fn(lambda: a @ a, device, warmup=2, iters=10)
        res["dense_matmul_8192"] = {"tflops": 2 * 8192**3 / sec / 1e12}
    return res


def _top_kernels(step, top: int = 15) -> dict:
    """GPU milliseconds of one step's most expensive kernels (where the model's time goes besides the experts)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    rows = [(e.key, e.self_device_time_total / 1e3) for e in prof.key_averages() if e.self_device_time_total > 0]
    rows.sort(key=lambda r: -r[1])
    out = {name[:90]: round(ms, 3) for name, ms in rows[:top]}
    out["(all kernels)"] = round(sum(ms for _, ms in rows), 3)
    return out


LOSS_CHUNKS = (1 << 26, 1 << 28, 1 << 30)


def _cpu_peak_growth(fn) -> int:
    """Bytes of peak RSS above the RSS before ``fn()`` (Linux), with bench/load_memory.py's readers."""
    import load_memory  # beside this script

    load_memory._reset_peak()
    before = load_memory._status("VmRSS")
    fn()
    return load_memory._status("VmHWM") - before


def _cuda_peak_growth(fn) -> int:
    """Bytes of peak CUDA memory allocated during ``fn()`` above what was allocated before it."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def bench_loss(args, device, dtype) -> dict:
    """The head + loss alone (T tokens, H, V = 151936, bf16, forward + backward): transformers' way (logits, then
    ``ForCausalLMLoss``, which upcasts them to fp32) against xpar_zoo's fused linear + cross-entropy, with the torch
    and the Triton chunk kernels at several chunk sizes. Loss and gradients checked against an fp32 reference."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    t, h, v = args.loss_tokens, args.hidden, args.vocab
    torch.manual_seed(3)
    hidden = torch.randn(t, h, device=device).to(dtype).requires_grad_()
    weight = (torch.randn(v, h, device=device) * 0.02).to(dtype).requires_grad_()
    targets = torch.randint(0, v, (t,), device=device)
    targets[: t // 16] = -100
    h32, w32 = hidden.detach().float().requires_grad_(), weight.detach().float().requires_grad_()
    ref = torch.nn.functional.cross_entropy(h32 @ w32.t(), targets)
    ref_grads = torch.autograd.grad(ref, (h32, w32))
    ref = ref.detach()  # frees the fp32 graph (and h32 / w32 with it)
    del h32, w32
    variants = {"transformers": lambda: ForCausalLMLoss((hidden @ weight.t()).unsqueeze(0), None, v,
                                                        shift_labels=targets.unsqueeze(0))}
    kernels = ["torch"] + (["triton"] if device.type == "cuda" or INTERPRETED else [])
    settings = {}  # fused variant -> its kernels and chunk size, for the model section to take the fastest
    for k in kernels:
        for chunk in args.loss_chunks:
            name = f"fused_{k}_2^{chunk.bit_length() - 1}"
            settings[name] = {"kernels": k, "chunk_elements": chunk}
            variants[name] = (
                lambda k=k, chunk=chunk: fused_linear_cross_entropy(hidden, weight, targets, chunk_elements=chunk, kernels=k))
    flops = 6 * t * h * v
    res = {"tokens": t, "vocab": v}
    for name, fn in variants.items():
        loss = grads = None  # a failed variant's graph must not outlive it
        try:
            loss = fn()
            grads = torch.autograd.grad(loss, (hidden, weight))
            err = {"loss_abs_err": abs(loss.item() - ref.item()),
                   "grad_rel_err": max(((a.float() - b).norm() / b.norm()).item() for a, b in zip(grads, ref_grads))}
            del grads, loss

            def step(fn=fn):
                hidden.grad = weight.grad = None
                fn().backward()

            sec = time_fn(step, device, warmup=2, iters=args.iters)
            row = {"ms": sec * 1e3, "tflops": flops / sec / 1e12, **err, **settings.get(name, {})}
            if device.type == "cuda":
                row["peak_step_memory_GiB"] = _cuda_peak_growth(step) / 2**30
            elif os.path.exists("/proc/self/clear_refs"):  # CPU: peak RSS above the RSS before one step
                row["peak_step_rss_GiB"] = _cpu_peak_growth(step) / 2**30
            res[name] = row
        except Exception as e:  # noqa: BLE001 - one variant failing (e.g. out of memory) must not hide the others
            res[name] = {"error": f"{type(e).__name__}: {e}"[:500]}
        hidden.grad = weight.grad = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
    base = res["transformers"].get("ms")
    for r in res.values():
        if isinstance(r, dict) and "ms" in r and base:
            r["speedup_vs_transformers"] = base / r["ms"]
    return res


def bench_model(args, device, dtype, tiles=None, loss_chunk=None, loss_kernels="triton") -> dict:
    """Training tokens/s of a 4-layer Qwen3-30B-A3B-shaped model: ``xpar_zoo`` (Triton experts + fused loss with
    the loss section's fastest kernels and chunk size), ``xpar_zoo_torch`` (torch experts + fused loss), ``grouped_mm_fused_loss``
    (transformers' grouped_mm experts + our fused loss: the loss's share alone), transformers' ``grouped_mm`` and
    ``eager``."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    fused = loss_kernels if "xpar_zoo" in args.impls else "torch"  # the loss section's fastest kernels
    variants = {"xpar_zoo": ("xpar_zoo", fused), "xpar_zoo_torch": ("xpar_zoo_torch", "torch"),
                "grouped_mm_fused_loss": ("grouped_mm", fused),
                "grouped_mm": ("grouped_mm", None), "eager": ("eager", None)}
    res = {}
    for name, (impl, kernels) in variants.items():
        if impl not in args.impls or (impl == "eager" and args.skip_eager):
            continue
        model = step = None  # the previous variant's model (and gradients) go before the next is built
        if device.type == "cuda":
            torch.cuda.empty_cache()
        try:
            config = Qwen3MoeConfig(hidden_size=args.hidden, moe_intermediate_size=args.inter,
                                    num_experts=args.experts, num_experts_per_tok=args.top_k,
                                    num_hidden_layers=args.layers, num_attention_heads=32, num_key_value_heads=4,
                                    head_dim=128, vocab_size=args.vocab, intermediate_size=6144,
                                    attn_implementation="sdpa")
            torch.manual_seed(0)
            with torch.device(device):
                model = AutoModelForCausalLM.from_config(config, dtype=dtype, experts_implementation=_hf_impl(impl))
            _configure(model, impl, tiles)
            if kernels:
                install_fused_loss(model, kernels=kernels, chunk_elements=loss_chunk)
            ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), device=device)

            step = functools.partial(_model_step, model, ids)
            sec = time_fn(step, device, warmup=2, iters=args.model_iters)
            res[name] = {"tokens_per_s": args.batch * args.seq / sec, "ms": sec * 1e3}
            if device.type == "cuda":
                res[name]["peak_step_memory_GiB"] = _cuda_peak_growth(step) / 2**30
                if name in ("xpar_zoo", "grouped_mm"):
                    res[name]["top_kernels_ms"] = _top_kernels(step)
        except Exception as e:  # noqa: BLE001 - one variant failing must not hide the others
            res[name] = {"error": f"{type(e).__name__}: {e}"[:1000]}
        if device.type == "cuda":
            torch.cuda.empty_cache()
    base = res.get("grouped_mm", {}).get("tokens_per_s")
    for r in res.values():
        if base and "tokens_per_s" in r:
            r["ratio_vs_grouped_mm"] = r["tokens_per_s"] / base
    return res


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--smoke", action="store_true", help="tiny shapes (any device)")
    p.add_argument("--skip-eager", action="store_true")
    p.add_argument("--no-model", action="store_true")
    p.add_argument("--loss-only", metavar="T,H,V", help="only the loss section, at these tokens, hidden, vocab")
    p.add_argument("--fp32", action="store_true", help="fp32 instead of bf16 (the CPU's training dtype)")
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    # the interpreter's tl.dot mishandles bf16
    dtype = torch.float32 if INTERPRETED or args.fp32 else torch.bfloat16
    if args.smoke:
        dims = dict(hidden=64, inter=32, experts=8, top_k=2, tokens=256, check_tokens=64, layers=2, batch=1, seq=64,
                    warmup=1, iters=2, model_iters=2, vocab=1000, loss_tokens=96, loss_chunks=[1 << 13, 1 << 20])
    else:
        dims = dict(hidden=2048, inter=768, experts=128, top_k=8, tokens=16384, check_tokens=2048, layers=4, batch=4,
                    seq=4096, warmup=3, iters=10, model_iters=5, vocab=151936, loss_tokens=16384,
                    loss_chunks=list(LOSS_CHUNKS))
    if args.loss_only:
        tokens, hidden, vocab = (int(x) for x in args.loss_only.split(","))
        dims.update(loss_tokens=tokens, hidden=hidden, vocab=vocab, iters=5,
                    loss_chunks=[1 << 22, 1 << 24, 1 << 26] if device.type == "cpu" else list(LOSS_CHUNKS))
    for key, value in dims.items():
        setattr(args, key, value)
    import transformers

    report = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name() if device.type == "cuda"
              else platform.processor() or "cpu", "torch": torch.__version__, "transformers": transformers.__version__,
              "dims": dims}
    args.impls = list(IMPLS)
    if device.type != "cuda" and not INTERPRETED:  # Triton compiles for GPUs only; the interpreter runs anywhere
        args.impls.remove("xpar_zoo")
    out = os.environ.get("OUT")

    def section(name, fn, *fn_args):
        """Run one part; a failure is recorded (and the rest still runs), the JSON is rewritten after each part."""
        try:
            report[name] = fn(*fn_args)
        except Exception as e:  # noqa: BLE001 - a benchmark reports, it does not stop at the first problem
            report[name] = {"error": f"{type(e).__name__}: {e}"[:2000], "traceback": traceback.format_exc()[-4000:]}
        print(json.dumps({name: report[name]}, indent=1, default=str), flush=True)
        if out:
            with open(os.path.join(out, "gpu_moe.json"), "w") as f:
                json.dump(report, f, indent=1, default=str)
        return report[name]

    if args.loss_only:
        section("loss", bench_loss, args, device, dtype)
        return
    tiles = None
    if "xpar_zoo" in args.impls:
        sweep = section("tile_sweep", sweep_tiles, args, device, dtype)
        tiles = sweep.pop("best_tiles", None)
        if tiles is None:
            args.impls.remove("xpar_zoo")
        else:
            section("no_host_sync", check_no_host_sync, args, device, dtype, tiles)
            section("perm_path_bit_identical", check_perm_path, args, device, dtype, tiles)
            section("kernels", kernel_breakdown, args, device, dtype, tiles)
    section("check", check_block, args, device, dtype, tiles)
    section("block", bench_block, args, device, dtype, tiles)
    loss = section("loss", bench_loss, args, device, dtype)
    if not args.no_model:
        # the model's fused loss takes the fastest chunk size of the loss section (Triton kernels where they ran)
        timed = [r for r in loss.values() if isinstance(r, dict) and "ms" in r and "kernels" in r]
        best = min(timed, key=lambda r: r["ms"], default={"kernels": "torch", "chunk_elements": None})
        section("model", bench_model, args, device, dtype, tiles, best["chunk_elements"], best["kernels"])


if __name__ == "__main__":
    main()
