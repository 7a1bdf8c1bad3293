"""Images dealt over a sequence group: under sp/cp every rank of a group holds the same whole rows, so each encodes
only its share of the rows' images and the group all-gathers the features.

:func:`deal` splits the images (or videos) of the whole rows into ``sp·cp`` contiguous shares of about equal size
(patch rows), in group order (cp outside sp, as :func:`gather_features` gathers); :func:`take` cuts a share's pixel
inputs; the model's own encoder runs on them (a rank whose share is empty encodes the zero dummy and keeps zero rows,
so the tower's FSDP collectives match). :func:`gather_features` joins every rank's features of the per-image lists
of the encoder's output (``pooler_output``, ``deepstack_features``: a list of one tensor per image, each row one
placeholder's feature) into one tensor of the group's images in order: all-gather over sp, then over cp, whose
backward sums the group's gradients for this rank's rows into its share's features (a reduce-scatter), so each rank's
tower gradient is its share's over the whole rows and FSDP's sum over the ranks is the single-process gradient.
Other tensors of the output stay this rank's (the models merge the per-image lists).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from ..errors import ModelStateError
from ..parallel.collectives import GatherRows, group_row_counts
from ..parallel.mesh import PlanShard
from ..parallel.state import parallel_state


def sequence_shards(model: nn.Module) -> tuple[PlanShard, PlanShard] | None:
    """This rank's place in its ``sp`` and ``cp`` groups, or ``None`` when ``model`` does not split its rows."""
    state = parallel_state(model)
    if state is None or state.mesh.sequence_size <= 1:
        return None
    mesh = state.mesh
    return tuple(PlanShard(mesh.sequence_group(d), getattr(mesh, d), mesh.sequence_rank(d), 0) for d in ("sp", "cp"))


def share_index(shards: tuple[PlanShard, PlanShard]) -> tuple[int, int]:
    """``(this rank's share, shares)``: cp outside sp, the order :func:`gather_features` joins them in."""
    sp, cp = shards
    return cp.rank * sp.size + sp.rank, sp.size * cp.size


def image_rows(pixels: torch.Tensor, kwargs: Mapping, grid_key: str) -> list[int]:
    """The rows of ``pixels`` each image (or video) takes: ``t·h·w`` patches of its ``grid_key`` row (the Qwen-VL
    layout), else one row each (whole images, or Gemma 4's positioned patches of one image a row)."""
    grid = kwargs.get(grid_key)
    if torch.is_tensor(grid):
        return [int(n) for n in grid.prod(-1).tolist()]
    return [1] * pixels.shape[0]


def deal(sizes: list[int], parts: int) -> list[range]:
    """Contiguous shares of the images of ``sizes`` (their rows) for ``parts`` ranks, about equal in rows: an image
    goes to the part its middle row falls in (some parts may be empty)."""
    total = max(sum(sizes), 1)
    owner, before = [], 0
    for size in sizes:
        owner.append(min(parts - 1, int((before + size / 2) * parts // total)))
        before += size
    return [range(owner.index(p), len(owner) - owner[::-1].index(p)) if p in owner else range(0) for p in range(parts)]


def take(pixels: torch.Tensor, kwargs: Mapping, sizes: list[int], images: range) -> tuple[torch.Tensor, dict]:
    """The pixel rows of ``images`` and of every per-image tensor of ``kwargs`` (dim 0 one row per image)."""
    lo, hi = sum(sizes[:images.start]), sum(sizes[:images.stop])
    out = {k: v[images.start:images.stop] if torch.is_tensor(v) and v.dim() and v.shape[0] == len(sizes) else v
           for k, v in kwargs.items()}
    return pixels[lo:hi], out


def _per_image(value) -> bool:
    return isinstance(value, (list, tuple)) and bool(value) and all(torch.is_tensor(t) for t in value)


def _feature_rows(output) -> int:
    lists = [v for v in output.values() if _per_image(v)]
    if not lists:
        raise ModelStateError(f"sp/cp: the image encoder's output ({type(output).__name__}) holds no per-image list "
                              "of features to gather over the sequence group")
    return sum(t.shape[0] for t in lists[0])


def gather_features(output, shards: tuple[PlanShard, PlanShard], device: torch.device):
    """``output`` (this rank's share's encoder output) with every per-image list of features replaced by one tensor
    of the whole group's images in order (see the module docstring)."""
    rows = _feature_rows(output)
    counts = []
    n = rows
    for shard in shards:  # sp, then cp: the rows each rank of the group brings
        counts.append(group_row_counts(n, shard, device) if shard.size > 1 else [n])
        n = sum(counts[-1])

    def join(value):
        if _per_image(value):
            x = torch.cat(list(value))
            if x.shape[0] != rows:
                raise ModelStateError(f"sp/cp: an image encoder's per-image list holds {x.shape[0]} rows, its "
                                      f"features {rows}")
            for shard, sizes in zip(shards, counts):
                if shard.size > 1:
                    x = GatherRows.apply(x, sizes, shard)
            return (x,)
        if isinstance(value, (list, tuple)):
            return type(value)(join(v) for v in value)
        return value

    for key in list(output.keys()):
        output[key] = join(output[key])
    return output
