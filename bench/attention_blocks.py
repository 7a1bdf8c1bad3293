"""The time cost of the blocked sp/cp attention (issue 30, not a test): the masked attention of ``--layers`` layers of
cp rank 1 (b=1, 4 query / 2 key-value heads of 32, fp32, one thread), forward+backward, under the whole
``[1, 1, S/cp, S]`` mask against :func:`xpar_zoo.styles.sequence_inner.blocked_attention` at the default block budget,
and the blocks without their checkpoint (masks kept for backward: what the recompute costs), and for sdpa cp's
lower-right path (:func:`xpar_zoo.styles.sequence_inner.lower_right_attention`, no dense mask); min of ``--reps``
interleaved repeats.

    python bench/attention_blocks.py [--inner sdpa] [--seq 8192] [--cp 4]
"""

from __future__ import annotations

import argparse
import time
import types

import torch


def main() -> None:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.models.qwen3.modeling_qwen3 import eager_attention_forward

    from xpar_zoo.parallel.options import ParallelOptions
    from xpar_zoo.styles import (
        sequence_inner,
        sequence_layout,
        sequence_masks,
        sequence_paths,
    )

    ap = argparse.ArgumentParser()
    ap.add_argument("--inner", default="sdpa", choices=["sdpa", "eager"])
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--cp", type=int, default=4)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    fn = sdpa_attention_forward if args.inner == "sdpa" else eager_attention_forward
    module = types.SimpleNamespace(num_key_value_groups=2, is_causal=True, training=True)

    def call(q, k, v, mask):
        return fn(module, q, k, v, mask, dropout=0.0, scaling=0.3)[0]

    seq, cp = args.seq, args.cp
    layout = sequence_layout.token_layout(seq, 1, cp, 0, 1)
    tensors = [(torch.randn(1, 4, seq // cp, 32, requires_grad=True), torch.randn(1, 2, seq, 32, requires_grad=True),
                torch.randn(1, 2, seq, 32, requires_grad=True)) for _ in range(args.layers)]
    budget = ParallelOptions.from_env().block_budget("cpu")
    rows = sequence_paths.attention_block_rows(1, 4, seq // cp, seq, 4, args.inner == "eager", budget) or seq // cp

    def whole(batch, q, k, v):
        return call(q, k, v, batch.mask(True, None, q.dtype))

    def blocked(batch, q, k, v):
        return sequence_inner.blocked_attention(call, q, k, v, batch, True, None, rows)

    def unchecked(batch, q, k, v):
        return torch.cat([sequence_inner._attention_block(call, batch, True, None, s, keys, q[:, :, s:s + n], k, v)
                          for s, n, keys in batch.blocks(rows, True, None)], dim=1)

    def lower_right(batch, q, k, v):
        return sequence_inner.lower_right_attention(q, k, v, batch, 0.0, 0.3)

    paths = {"whole mask": whole, "blocked": blocked, "blocked, no checkpoint": unchecked}
    if args.inner == "sdpa":
        paths["lower-right"] = lower_right
    times: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(args.reps):
        for name, attend in paths.items():
            batch = sequence_masks.SequenceForward(layout.queries, layout.keys, None, None)
            t0 = time.perf_counter()
            sum(attend(batch, *t).sum() for t in tensors).backward()
            times[name].append(time.perf_counter() - t0)
    best = {name: min(t) for name, t in times.items()}
    print(f"{args.inner}, cp={cp}, {seq} tokens, {args.layers} layers, {rows} queries per block: "
          + ", ".join(f"{name} {t:.3f} s" for name, t in best.items())
          + f"; blocked / whole {best['blocked'] / best['whole mask']:.2f}")


if __name__ == "__main__":
    main()
