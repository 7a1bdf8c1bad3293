"""GPU MoE benchmark (issue 9): xpar_zoo's experts path against transformers' ``grouped_mm`` and ``eager`` experts,
side by side in one run, plus a 4-layer Qwen3-30B-A3B-shaped model's training tokens/s.

    python bench/gpu_moe.py                 # on a GPU: correctness, then timings; JSON to $OUT/gpu_moe.json
    python bench/gpu_moe.py --smoke         # tiny shapes, any device (checks that the script runs)

The block is Qwen3-30B-A3B's MoE block (H=2048, I=768, E=128, top-8) on T=16384 tokens, bf16, forward + backward.
Expert FLOPs counted as 18·T·k·H·I (gate_up and down GEMMs, forward once, backward twice); router FLOPs ignored.
Every figure is reported with the ratio to transformers' ``grouped_mm`` from the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch

import xpar_zoo.moe  # noqa: F401  (registers the "xpar_zoo" experts implementation)

IMPLS = ("xpar_zoo", "grouped_mm", "eager")


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


def moe_block(hidden, inter, experts, top_k, device, dtype, impl, seed=0):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=inter, num_experts=experts,
                            num_experts_per_tok=top_k, norm_topk_prob=True)
    config._experts_implementation = impl
    torch.manual_seed(seed)
    block = Qwen3MoeSparseMoeBlock(config)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.02)
    return block.to(device=device, dtype=dtype)


def check_block(args, device, dtype) -> dict:
    """Outputs and gradients of every implementation against eager in fp32 (bf16 tolerance)."""
    h, i, e, k, t = args.hidden, args.inter, args.experts, args.top_k, args.check_tokens
    torch.manual_seed(1)
    x = torch.randn(1, t, h, device=device)
    ref_block = moe_block(h, i, e, k, device, torch.float32, "eager")
    xr = x.clone().requires_grad_()
    ref_out = ref_block(xr)
    ref_out.float().pow(2).mean().backward()
    out = {}
    for impl in IMPLS:
        block = moe_block(h, i, e, k, device, dtype, impl)
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
    return out


def bench_block(args, device, dtype) -> dict:
    h, i, e, k, t = args.hidden, args.inter, args.experts, args.top_k, args.tokens
    flops = 18 * t * k * h * i
    torch.manual_seed(2)
    x = torch.randn(1, t, h, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn(1, t, h, device=device, dtype=dtype)
    res = {}
    for impl in IMPLS:
        if impl == "eager" and args.skip_eager:
            continue
        block = moe_block(h, i, e, k, device, dtype, impl)

        def step():
            block.zero_grad(set_to_none=True)
            block(x).backward(grad)

        sec = time_fn(step, device, warmup=args.warmup, iters=args.iters)
        res[impl] = {"ms": sec * 1e3, "tflops": flops / sec / 1e12}
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


def bench_model(args, device, dtype) -> dict:
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    res = {}
    for impl in IMPLS:
        if impl == "eager" and args.skip_eager:
            continue
        config = Qwen3MoeConfig(hidden_size=args.hidden, moe_intermediate_size=args.inter, num_experts=args.experts,
                                num_experts_per_tok=args.top_k, num_hidden_layers=args.layers,
                                num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
                                intermediate_size=6144, attn_implementation="sdpa")
        torch.manual_seed(0)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, experts_implementation=impl)
        ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), device=device)

        def step():
            model.zero_grad(set_to_none=True)
            model(input_ids=ids, labels=ids).loss.backward()

        sec = time_fn(step, device, warmup=2, iters=args.model_iters)
        res[impl] = {"tokens_per_s": args.batch * args.seq / sec, "ms": sec * 1e3}
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    base = res["grouped_mm"]["tokens_per_s"]
    for r in res.values():
        r["ratio_vs_grouped_mm"] = r["tokens_per_s"] / base
    return res


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--smoke", action="store_true", help="tiny shapes (any device)")
    p.add_argument("--skip-eager", action="store_true")
    p.add_argument("--no-model", action="store_true")
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16
    if args.smoke:
        dims = dict(hidden=64, inter=32, experts=8, top_k=2, tokens=256, check_tokens=64, layers=2, batch=1, seq=64,
                    warmup=1, iters=2, model_iters=2)
    else:
        dims = dict(hidden=2048, inter=768, experts=128, top_k=8, tokens=16384, check_tokens=2048, layers=4, batch=4,
                    seq=4096, warmup=3, iters=10, model_iters=5)
    for key, value in dims.items():
        setattr(args, key, value)
    import transformers

    report = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name() if device.type == "cuda"
              else platform.processor() or "cpu", "torch": torch.__version__, "transformers": transformers.__version__,
              "dims": dims}
    report["check"] = check_block(args, device, dtype)
    print(json.dumps({"check": report["check"]}, indent=1), flush=True)
    report["block"] = bench_block(args, device, dtype)
    print(json.dumps({"block": report["block"]}, indent=1), flush=True)
    if not args.no_model:
        report["model"] = bench_model(args, device, dtype)
        print(json.dumps({"model": report["model"]}, indent=1), flush=True)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "gpu_moe.json"), "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
