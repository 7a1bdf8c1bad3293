"""Image inputs for the zoo's parity proofs of multimodal MoE models: token ids with image placeholders and the pixel
inputs a tiny config's vision tower takes, one micro-batch per rank (the single-process reference concatenates
them on dim 0, which is how these models batch images).

The layout is the Qwen-VL one that most of transformers' multimodal MoE models share: ``pixel_values`` of
``[patches, channels · temporal_patch · patch²]``, an ``image_grid_thw`` row per image, and in the text one image
placeholder per ``spatial_merge_size²`` patches (``mm_token_type_ids`` marks them, 1 for image). The proofs' data
names the variant: :data:`INPUTS`.
"""

from __future__ import annotations

import torch

# Special token ids of the tiny configs (inside their 128-token vocab; the text tokens stay below them).
IMAGE_TOKENS = dict(image_token_id=120, video_token_id=121, vision_start_token_id=122, vision_end_token_id=123)
TEXT_VOCAB = 120
_GRID = (1, 4, 4)  # one frame of 4×4 patches per image
# The inputs a proof trains on (:attr:`xpar_zoo.testing.proofs.Proof.inputs`) -> the keyword arguments of image_batches.
INPUTS = {"image": {}, "image_row_newline": {"row_newline": True}}


def image_batches(config, world: int, batch: int = 2, seq: int = 12, seed: int = 5, row_newline: bool = False
                  ) -> tuple[torch.Tensor, list[dict[str, torch.Tensor]]]:
    """Token ids ``[world, batch, seq]`` (each row: text, vision start, the image's placeholders, vision end, text)
    and, per rank, the image inputs of its rows (``pixel_values``, ``image_grid_thw``, ``mm_token_type_ids``).
    ``row_newline``: one more placeholder per row of merged patches (HY-V4-VL's newline tokens)."""
    vision = config.vision_config
    merge = getattr(vision, "spatial_merge_size", 2)
    t, h, w = _GRID
    patches = t * h * w
    placeholders = t * (h // merge) * (w // merge + row_newline)
    if placeholders + 4 > seq:
        raise ValueError(f"a row of {seq} tokens cannot hold an image of {placeholders} placeholders")
    row = 1 + placeholders + 1
    channels = getattr(vision, "in_channels", getattr(vision, "num_channels", 3))
    pixels = channels * getattr(vision, "temporal_patch_size", 1) * vision.patch_size**2
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, TEXT_VOCAB, (world, batch, seq), generator=g)
    ids[..., 1] = config.vision_start_token_id
    ids[..., 2:row] = config.image_token_id
    ids[..., row] = config.vision_end_token_id
    extra = []
    for rank in range(world):
        extra.append({"pixel_values": torch.randn(batch * patches, pixels, generator=g),
                      "image_grid_thw": torch.tensor([_GRID] * batch),
                      "mm_token_type_ids": (ids[rank] == config.image_token_id).long()})
    return ids, extra
