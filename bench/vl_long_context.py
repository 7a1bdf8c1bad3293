"""Long context on a vision-language MoE model (issue 38): the per-rank activation peak of one forward+backward of
``tiny-qwen3-vl-moe`` (:mod:`xpar_zoo.train.tiny_vl`'s config) on rows of ``--seq`` tokens holding ``--images``
images, under ``Mesh(sp=4)`` and ``Mesh(cp=4)`` against FSDP alone (``Mesh()``), and the vision tower's share: the
same meshes on the same rows with every image's placeholders turned into text tokens and no pixels (the tower does
not run), the difference being what the images add.

    python bench/vl_long_context.py [--seq 8192] [--images 4] [--grid 32] [--no-write]

Measured as bench/long_context.py measures (its :func:`cpu_model`, ``WORLD``, ``MB``;
:func:`xpar_zoo.testing.parity.live_peak_bytes`): the peak of live CPU tensor bytes during the step above those live
when it starts, worst rank, after a warm-up step on a short row; the step time is rank 0's of one more step with
images, unprofiled. Every rank of a sequence group passes the same
whole rows with their pixels (as the API asks); FSDP alone gives every rank its own row of the same layout. An image
is one frame of ``grid × grid`` patches (synthetic pixels, ``image_grid_thw`` and ``mm_token_type_ids`` as the
processor makes them: ``grid² / 4`` placeholders between vision start and end tokens). fp32, sdpa, one row per
micro-batch.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from long_context import MB, WORLD, peak_and_time, run_line, worst_peak, write_results  # noqa: E402  (the measuring bench's helpers: one source)

MESHES = {"fsdp": {}, "sp4": {"sp": 4}, "cp4": {"cp": 4}}
LABELS = {"fsdp": "FSDP alone `Mesh()`", "sp4": "`Mesh(sp=4)`", "cp4": "`Mesh(cp=4)`"}
WARMUP_SEQ = 512


def vl_config(seq: int):
    """``tiny-qwen3-vl-moe``'s config, its positions long enough for ``seq`` tokens, sdpa."""
    from xpar_zoo.train.tiny_vl import tiny_vl_config, tiny_vl_tokenizer

    config = tiny_vl_config(tiny_vl_tokenizer())
    config.text_config.max_position_embeddings = max(seq * 2, 4096)
    config._attn_implementation = "sdpa"
    config.text_config._attn_implementation = "sdpa"
    config.vision_config._attn_implementation = "sdpa"
    config.use_cache = config.text_config.use_cache = False
    return config


def vl_row(config, seq: int, images: int, grid: int, seed: int, with_images: bool = True) -> dict:
    """One row of ``seq`` tokens: text with ``images`` images spread along it (vision start, ``grid² / 4``
    placeholders, vision end), their pixels and grids; ``with_images=False``: the placeholders are text, no pixels."""
    import torch

    vision = config.vision_config
    merge = vision.spatial_merge_size
    placeholders = (grid // merge) ** 2
    width = 3 * vision.temporal_patch_size * vision.patch_size**2
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(20, 250, (1, seq), generator=g)
    stride = seq // images
    if placeholders + 2 >= stride:
        raise ValueError(f"{images} images of {placeholders} placeholders do not fit a row of {seq} tokens")
    if with_images:
        for i in range(images):
            at = i * stride + 8
            ids[0, at] = config.vision_start_token_id
            ids[0, at + 1:at + 1 + placeholders] = config.image_token_id
            ids[0, at + 1 + placeholders] = config.vision_end_token_id
    labels = ids.masked_fill(ids == config.image_token_id, -100)
    row = {"input_ids": ids, "labels": labels}
    if with_images:
        row.update(pixel_values=torch.randn(images * grid * grid, width, generator=g),
                   image_grid_thw=torch.tensor([[1, grid, grid]] * images),
                   mm_token_type_ids=(ids == config.image_token_id).long())
    return row


def _step(model, row: dict):
    def run():
        model(**row).loss.backward()
        model.zero_grad(set_to_none=True)
    return run


def _runs(seq: int, images: int, grid: int, meshes: list[str], trace_dir: str) -> dict | None:
    """On every rank: per mesh, the worst rank's peak with images and without (the same rows, text only)."""
    import torch
    import torch.distributed as dist
    from transformers.utils import logging

    import xpar_zoo
    from xpar_zoo.testing import parity

    logging.set_verbosity_error()
    rank = dist.get_rank()
    config = vl_config(seq)
    out = {}
    for name in meshes:
        mesh = MESHES[name]
        torch.manual_seed(0)
        model = xpar_zoo.parallelize(parity.build_model(config), xpar_zoo.Mesh(**mesh))
        model.train()
        seed = 0 if mesh else rank  # a sequence group's ranks pass the same rows
        _step(model, vl_row(config, WARMUP_SEQ, 1, grid, seed))()
        images_row, text_row = (vl_row(config, seq, images, grid, seed, shown) for shown in (True, False))
        timed = peak_and_time(_step(model, images_row), f"{trace_dir}/{name}-images-{rank}.json")
        text = worst_peak(_step(model, text_row), f"{trace_dir}/{name}-text-{rank}.json")
        out[name] = {"images": timed["peak"], "text": text, "seconds": timed["seconds"]}
        del model
        gc.collect()
    return out if rank == 0 else None


def _table(res: dict, args) -> list[str]:
    base = res["fsdp"]["images"]
    lines = [f"| mesh | peak with {args.images} images (MiB) | × FSDP alone | same rows, text only (MiB) | × FSDP alone "
             "| images add (MiB) | images' share of the peak | step (s) |", "|---|---|---|---|---|---|---|---|"]
    for name, r in res.items():
        add = r["images"] - r["text"]
        lines.append(f"| {LABELS[name]} | {r['images'] / MB:.1f} | {r['images'] / base:.2f}× | {r['text'] / MB:.1f} | "
                     f"{r['text'] / res['fsdp']['text']:.2f}× | {add / MB:.1f} | {add / r['images']:.0%} | "
                     f"{r['seconds']:.1f} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--images", type=int, default=4, help="images per row")
    ap.add_argument("--grid", type=int, default=32, help="an image's side in patches (grid² / 4 placeholders)")
    ap.add_argument("--meshes", default=",".join(MESHES), help="meshes to run, fsdp first")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from xpar_zoo.testing import launch

    load = os.getloadavg()[0]
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        res = launch.run(_runs, WORLD, args.seq, args.images, args.grid, args.meshes.split(","), tmp, timeout_s=1800)
    tokens = args.images * (args.grid // 2) ** 2
    lines = ["## Long context on a vision-language MoE model: sp / cp against FSDP alone, and the vision tower (issue 38)",
             "", run_line(f"python bench/vl_long_context.py --seq {args.seq} --images {args.images} --grid {args.grid}",
                          t0, load),
             "- model: `tiny-qwen3-vl-moe` fp32 (2 layers, hidden 64, 8 experts of 32, top-2; a one-block vision tower "
             "of width 16, patches of 4, merged 2 × 2) with positions for the row; sdpa; 4 gloo ranks; one row per "
             f"micro-batch of {args.seq} tokens holding {args.images} images of {args.grid} × {args.grid} patches "
             f"({tokens} placeholders); worst rank's live peak of one forward+backward above its start", ""]
    lines += _table(res, args)
    write_results("\n".join(lines) + "\n", args.no_write)


if __name__ == "__main__":
    main()
