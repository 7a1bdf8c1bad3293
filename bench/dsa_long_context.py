"""Long context on indexed sparse attention (issue 39, not a test): deepseek_v32 (DSA: an indexer picks each query's
top-k keys over the whole row) under ``Mesh(cp=4)`` and ``Mesh(sp=2, cp=2)`` against FSDP alone on the same
full-length rows, and the indexer's own transient on one rank.

    python bench/dsa_long_context.py [--seq 8192] [--indexer-seq 32768] [--no-write]

**Per-rank activation peak.** 4 gloo CPU ranks, fp32, sdpa, one row per micro-batch: the worst rank's peak of live
tensor bytes above those live before one forward+backward (:func:`xpar_zoo.testing.parity.live_peak_bytes`). FSDP
alone runs transformers' indexer on the whole row (``[1, S, heads, S]`` float32 scores and their ReLU per layer)
and its ``[1, 1, S, S]`` masks; under cp each rank scores its ``S/cp`` queries against the whole row's keys, a block
of queries at a time under the CPU's 16 MiB budget, and the attention is blocked too.

**The indexer on one rank.** One process, one thread: the wrapped indexer of one layer (the sp/cp wrapper's, with no
collectives: the rank holds the whole row) on a row of ``--indexer-seq`` tokens, its live peak against the bytes of
the whole-row score tensor transformers' indexer makes.
"""

from __future__ import annotations

import argparse
import collections
import gc
import inspect
import os
import sys
import tempfile
import time
import types
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from long_context import MB, WORLD, peak_and_time, run_line, write_results  # noqa: E402  (the measuring helpers)

CONFIG = {"hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 64,
          "kv_lora_rank": 64, "qk_rope_head_dim": 16, "qk_nope_head_dim": 16, "v_head_dim": 32,
          "n_routed_experts": 16, "num_experts_per_tok": 2, "moe_intermediate_size": 128, "intermediate_size": 256,
          "n_shared_experts": 1, "first_k_dense_replace": 0, "n_group": 1, "topk_group": 1, "num_hidden_layers": 2,
          "vocab_size": 2048, "index_n_heads": 2, "index_head_dim": 32, "index_topk": 256,
          "max_position_embeddings": 131072, "attn_implementation": "sdpa", "use_cache": False, "layer_types": None,
          "mlp_layer_types": None}
RUNS = {"fsdp": {}, "cp4": {"cp": 4}, "sp2_cp2": {"sp": 2, "cp": 2}}
LABELS = {"fsdp": "FSDP alone `Mesh()`", "cp4": "`Mesh(cp=4)`", "sp2_cp2": "`Mesh(sp=2, cp=2)`"}


def _config():
    from xpar_zoo.testing import parity

    return parity.tiny_config("deepseek_v32", **CONFIG)


def _runs(seq: int, trace_dir: str) -> dict:
    import torch
    import torch.distributed as dist
    from transformers.utils import logging

    import xpar_zoo
    from xpar_zoo.testing import parity

    logging.set_verbosity_error()
    rank = dist.get_rank()
    out = {}
    for name, mesh in RUNS.items():
        torch.manual_seed(0)
        model = xpar_zoo.parallelize(parity.build_model(_config()), xpar_zoo.Mesh(**mesh))
        model.train()
        group = bool(mesh)

        def step(n: int, model=model, group=group):
            g = torch.Generator().manual_seed(n + (0 if group else rank))
            ids = torch.randint(0, CONFIG["vocab_size"], (1, n), generator=g)

            def run():
                model(input_ids=ids, labels=ids).loss.backward()
                model.zero_grad(set_to_none=True)
            return run

        step(256)()
        out[name] = peak_and_time(step(seq), f"{trace_dir}/{name}-{rank}.json")
        del model
        gc.collect()
    return out if rank == 0 else None


def _indexer(seq: int, trace: str) -> dict:
    """The wrapped indexer of one layer on one rank holding a whole row of ``seq`` tokens: its live peak and time."""
    import torch

    from xpar_zoo.parallel.options import ParallelOptions
    from xpar_zoo.styles.sequence_indexed import _indexer_forward, indexer_query_bytes
    from xpar_zoo.styles.sequence_layout import token_layout
    from xpar_zoo.styles.sequence_masks import SequenceForward
    from xpar_zoo.testing import parity

    torch.manual_seed(0)
    config = _config()
    attention = parity.build_model(config).model.layers[0].self_attn
    indexer = attention.indexer
    layout = token_layout(seq, 1, 1, 0, 0)
    state = types.SimpleNamespace(sp=1, cp=1, sp_group=None, cp_group=None, sp_rank=0, cp_rank=0,
                                  options=ParallelOptions(), layout=lambda n: token_layout(n, 1, 1, 0, 0),
                                  current=SequenceForward(layout.queries, layout.keys, None, None, layout.local),
                                  paths=collections.Counter())
    original = indexer.forward
    wrapped = _indexer_forward(indexer, state, original, inspect.signature(original))
    hidden = torch.randn(1, seq, config.hidden_size)
    q_resid = torch.randn(1, seq, config.q_lora_rank)
    positions = torch.arange(seq)[None]
    cos, sin = parity.build_model(config).model.rotary_emb(hidden, positions)

    def run():
        wrapped(hidden, q_resid, (cos, sin), None, positions)

    peak = parity.live_peak_bytes(run, trace)
    t0 = time.perf_counter()
    run()
    heads = config.index_n_heads
    return {"peak": peak, "seconds": time.perf_counter() - t0, "scores": seq * heads * seq * 4,
            "transformers": indexer_query_bytes(1, heads, seq) * seq}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--indexer-seq", type=int, default=32768)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    from xpar_zoo.testing import launch

    torch.set_num_threads(1)
    load = os.getloadavg()[0]
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        one = _indexer(args.indexer_seq, f"{tmp}/indexer.json")
        res = launch.run(_runs, WORLD, args.seq, tmp, timeout_s=3000)
    base = res["fsdp"]["peak"]
    lines = ["## Long context on indexed sparse attention: deepseek_v32 under cp against FSDP alone (issue 39)", "",
             run_line(f"python bench/dsa_long_context.py --seq {args.seq} --indexer-seq {args.indexer_seq}", t0, load),
             ("- model: deepseek_v32 fp32, 2 layers, hidden 128, MLA (4 heads, q/kv rank 64), 16 experts of 128 "
              "(top-2) + a shared expert, indexer 2 heads of 32, top-256; sdpa; 4 gloo ranks; one row per "
              "micro-batch; worst rank's live peak of one forward+backward; the CPU's 16 MiB block budget"), "",
             f"| mesh | peak at {args.seq} tokens (MiB) | × FSDP alone | step (s) |", "|---|---|---|---|"]
    for name in RUNS:
        r = res[name]
        lines.append(f"| {LABELS[name]} | {r['peak'] / MB:.1f} | {r['peak'] / base:.2f}× | {r['seconds']:.1f} |")
    lines += ["", (f"- the indexer of one layer on one rank holding a whole row of {args.indexer_seq} tokens (the "
                   f"sp/cp wrapper, blocks of queries under 16 MiB): live peak {one['peak'] / MB:.1f} MiB, "
                   f"{one['seconds']:.1f} s; transformers' indexer on that row makes the whole-row score tensor "
                   f"`[1, S, 2, S]` float32 of {one['scores'] / MB:.0f} MiB (with its ReLU, the summed scores and "
                   f"the mask {one['transformers'] / MB:.0f} MiB)")]
    write_results("\n".join(lines) + "\n", args.no_write)


if __name__ == "__main__":
    main()
