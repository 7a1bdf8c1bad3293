"""Compile the Triton experts (and fused-loss) kernels for the H200 (sm_90) on a machine with no GPU, and report what the compiler
made of them: registers, spilled bytes, shared memory, software-pipelining stages, and whether the GEMMs use wgmma.

    python bench/compile_sm90.py                # the default tiles
    python bench/compile_sm90.py --sweep        # every tile candidate of bench/gpu_moe.py
    python bench/compile_sm90.py --json         # one JSON object per launch (the tests read this)

Each kernel is compiled exactly as a real launch of one training step of the Qwen3-30B-A3B MoE block would compile
it: the launches are recorded (not run) from ``moe_experts`` forward + backward on CPU tensors of the real hidden and
intermediate sizes, and Triton's JIT specialisation is reproduced (integer arguments equal to 1 become constants,
multiples of 16 and tensor pointers carry the divisibility-16 hint). Triton ships ``ptxas`` and ``cuobjdump``, so
this needs no CUDA install. It must run without ``TRITON_INTERPRET``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

import torch

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("compile_sm90.py compiles real kernels: run it without TRITON_INTERPRET=1")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from xpar_zoo.kernels import loss_triton as lt  # noqa: E402
from xpar_zoo.kernels import moe_triton as mt  # noqa: E402

H200 = GPUTarget("cuda", 90, 32)
TYPES = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32", torch.int32: "*i32",
         torch.int64: "*i64", torch.bool: "*i1"}


def record_launches(tiles: mt.Tiles, hidden=2048, inter=768, experts=128, top_k=8, tokens=256,
                    dtype=torch.bfloat16) -> list[tuple]:
    """``(kernel, args, meta, tiles)`` of every launch in one forward + backward of ``moe_experts`` (both backward
    variants) and of the EP path's ``grouped_swiglu(..., perm=...)``."""
    launches = []
    real = mt._launch
    mt._launch = lambda kernel, grid, t, *args, **meta: launches.append((kernel, args, meta, t))
    try:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(tokens, hidden, generator=g).to(dtype).requires_grad_()
        weights, index = torch.randn(tokens, experts, generator=g).softmax(-1).topk(top_k)
        weights = weights.to(dtype).requires_grad_()
        gate_up = torch.empty(experts, 2 * inter, hidden, dtype=dtype, requires_grad=True)
        down = torch.empty(experts, hidden, inter, dtype=dtype, requires_grad=True)
        for fuse in (True, False):
            mt.moe_experts(x, index, weights, gate_up, down, tiles, fuse_router_grad=fuse).sum().backward()
        # the EP path: rows regrouped through a permutation inside the GEMMs
        rows = torch.randn(tokens * top_k, hidden, generator=g).to(dtype).requires_grad_()
        counts = torch.full((experts,), tokens * top_k // experts, dtype=torch.long)
        perm = torch.randperm(rows.shape[0], generator=g)
        mt.grouped_swiglu(rows, gate_up, down, counts, tiles, perm=perm).sum().backward()
    finally:
        mt._launch = real
    return launches + record_loss_launches()


def record_loss_launches(rows=64, vocab=151936, dtype=torch.bfloat16) -> list[tuple]:
    """The fused loss's two chunk kernels on a bf16 chunk of Qwen3's vocab (Triton's default 4 warps, 3 stages)."""
    launches = []
    real = lt._launch
    lt._launch = lambda kernel, grid, *args, **meta: launches.append((kernel, args, meta, mt.Tiles(warps=4, stages=3)))
    try:
        z = torch.empty(rows, vocab, dtype=dtype)
        target, owned = torch.zeros(rows, dtype=torch.long), torch.ones(rows, dtype=torch.bool)
        lse = lt.row_stats(z, target, owned)[0]
        lt.softmax_grad_(z, lse, target, owned, torch.ones(rows))
    finally:
        lt._launch = real
    return launches


def _specialise(kernel, args, meta):
    """Signature, constants and attributes the JIT would derive from these arguments."""
    names = [n for n in kernel.arg_names if n not in meta]
    signature, constants, attrs = {}, dict(meta), {}
    for name, value in zip(names, args):
        index = kernel.arg_names.index(name)
        if isinstance(value, torch.Tensor):
            signature[name] = TYPES[value.dtype]
            attrs[(index,)] = [["tt.divisibility", 16]]
        elif isinstance(value, bool) or value == 1:
            constants[name] = value
        else:
            signature[name] = "i32" if -2**31 <= value < 2**31 else "i64"
            if value % 16 == 0:
                attrs[(index,)] = [["tt.divisibility", 16]]
    for name in constants:
        signature[name] = "constexpr"
    return signature, constants, attrs


def _resources(cubin: bytes) -> dict:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+)", out)
    return {"registers": int(m[1]), "spill_bytes": int(m[2])} if m else {"cuobjdump": out[-300:]}


def compile_launch(kernel, signature, constants, attrs, meta, tiles: mt.Tiles) -> dict:
    src = ASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=attrs)
    compiled = triton.compile(src, target=H200, options={"num_warps": tiles.warps, "num_stages": tiles.stages})
    ptx = compiled.asm["ptx"]
    shown = {k: v for k, v in constants.items() if k != "G_P2"}
    return {"kernel": kernel.__name__, "meta": shown, "warps": tiles.warps, "stages": tiles.stages,
            "shared_bytes": compiled.metadata.shared, "wgmma": "wgmma" in ptx, **_resources(compiled.asm["cubin"])}


def report(tiles: mt.Tiles) -> list[dict]:
    seen, rows = set(), []
    for kernel, args, meta, t in record_launches(tiles):
        signature, constants, attrs = _specialise(kernel, args, meta)
        key = (kernel.__name__, tuple(signature.items()), tuple(sorted(constants.items())))
        if key not in seen:  # e.g. the two backward GEMMs differ only in which weight stride is 1
            seen.add(key)
            rows.append(compile_launch(kernel, signature, constants, attrs, meta, t))
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    candidates = [mt.Tiles()]
    if a.sweep:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from gpu_moe import TILE_CANDIDATES

        candidates = [mt.Tiles(**c) for c in TILE_CANDIDATES]
    for tiles in candidates:
        if not a.json:
            print(tiles)
        for row in report(tiles):
            print(json.dumps(row) if a.json else f"  {row['kernel']:18s} {row['meta']}  regs {row.get('registers')}"
                  f"  spill {row.get('spill_bytes')} B  shared {row['shared_bytes']} B  wgmma {row['wgmma']}")


if __name__ == "__main__":
    main()
