"""Image inputs for the zoo's parity proofs of multimodal MoE models: token ids with image placeholders and the pixel
inputs a tiny config's vision tower takes, one micro-batch per rank (the single-process reference concatenates
them on dim 0, which is how these models batch images).

Two layouts: the Qwen-VL one that most of transformers' multimodal MoE models share (:func:`image_batches`:
``pixel_values`` of ``[patches, channels · temporal_patch · patch²]``, an ``image_grid_thw`` row per image, and in
the text one image placeholder per ``spatial_merge_size²`` patches, which ``mm_token_type_ids`` marks), and the
LLaVA one (:func:`pixel_batches`: ``pixel_values`` of ``[images, 3, H, W]`` and a fixed number of placeholders per
image), and Gemma4's flattened, positioned patches (:func:`patch_batches`). The proofs' data names the variant:
:data:`INPUTS`. :func:`mixed_batches` lays out rows with any number of images (or none), packed documents, and
Qwen3-VL videos.
"""

from __future__ import annotations

import torch

from .proofs import IMAGE_TOKENS  # noqa: F401  (the tiny configs' special token ids: one source)

TEXT_VOCAB = 120
_GRID = (1, 4, 4)  # one frame of 4×4 patches per image
_PIXELS = 16  # the side of a LLaVA-layout image


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


def pixel_batches(config, world: int, placeholders: int, image_sizes: bool = False, batch: int = 2, seq: int = 12,
                  seed: int = 5) -> tuple[torch.Tensor, list[dict[str, torch.Tensor]]]:
    """Token ids ``[world, batch, seq]`` (each row: text, then the ``placeholders`` tokens its image becomes, then
    text; text tokens from 20 up, above the small special ids these models use) and, per rank, ``pixel_values`` of
    ``[batch, 3, 16, 16]`` (and ``image_sizes`` where the model takes them)."""
    token = getattr(config, "image_token_id", None)
    token = config.image_token_index if token is None else token
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(20, TEXT_VOCAB, (world, batch, seq), generator=g)
    ids[..., 1:1 + placeholders] = token
    extra = []
    for _ in range(world):
        inputs = {"pixel_values": torch.randn(batch, 3, _PIXELS, _PIXELS, generator=g)}
        if image_sizes:
            inputs["image_sizes"] = torch.tensor([[_PIXELS, _PIXELS]] * batch)
        extra.append(inputs)
    return ids, extra


def patch_batches(config, world: int, side: int = 6, batch: int = 2, seq: int = 12, seed: int = 5
                  ) -> tuple[torch.Tensor, list[dict[str, torch.Tensor]]]:
    """Gemma4's layout: each image as ``side²`` flattened patches (``pixel_values [batch, side², 3 · patch²]``) with
    their ``(x, y)`` positions (``image_position_ids``), pooled into ``side² / pooling_kernel_size²`` placeholders."""
    vision = config.vision_config
    placeholders = side**2 // vision.pooling_kernel_size**2
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(20, TEXT_VOCAB, (world, batch, seq), generator=g)
    ids[..., 1:1 + placeholders] = config.image_token_id
    grid = torch.stack(torch.meshgrid(torch.arange(side), torch.arange(side), indexing="xy"), -1).reshape(-1, 2)
    extra = [{"pixel_values": torch.randn(batch, side**2, 3 * vision.patch_size**2, generator=g),
              "image_position_ids": grid.expand(batch, -1, -1).clone()} for _ in range(world)]
    return ids, extra


# Images per row of each rank (4 ranks × 2 rows): two images in one row, a rank with images in its second row only,
# two ranks without any (the global batch mixes text-only and image rows, as SFT data does).
MIXED_ROWS = ((2, 0), (0, 0), (0, 1), (0, 0))
# The rows (rank, row) of the mixed rows that hold a video after their images, where the model takes videos: rank 1's
# second row (a rank without images; its targets are not all ignored, :func:`xpar_zoo.testing.parity.make_labels`).
VIDEO_ROWS = ((1, 1),)
VIDEO_SEQ = 40  # the rows' length where they hold a video: a packed row's first document (half a row) holds it
_VIDEO_GRID = (2, 4, 4)  # two frames (temporal patches) of 4×4 patches
_TIMESTAMP = (27, 48)  # the text tokens of a frame's timestamp ("<0.5 seconds>")
# Packed rows: two documents per row, each with its images (an image in a row's second document only, ranks with and
# without images); with :data:`VIDEO_ROWS`, rank 1's second row holds the video in its first document.
PACKED_ROWS = (((1, 1), (0, 0)), ((0, 0), (0, 1)), ((1, 0), (0, 0)), ((0, 0), (0, 0)))


def _one_image(inputs: str, config, g: torch.Generator) -> tuple[list[int], dict[str, torch.Tensor]]:
    """The placeholder tokens and the pixel inputs of one image of the layout ``inputs`` (``image``: the Qwen-VL
    grid, ``patches``: Gemma4's positioned patches)."""
    vision = config.vision_config
    if inputs == "patches":
        side = 6
        grid = torch.stack(torch.meshgrid(torch.arange(side), torch.arange(side), indexing="xy"), -1).reshape(1, -1, 2)
        tokens = [config.image_token_id] * (side**2 // vision.pooling_kernel_size**2)
        return tokens, {"pixel_values": torch.randn(1, side**2, 3 * vision.patch_size**2, generator=g),
                        "image_position_ids": grid}
    if inputs != "image":
        raise ValueError(f"mixed rows are built for the 'image' and 'patches' layouts, not {inputs!r}")
    merge = getattr(vision, "spatial_merge_size", 2)
    t, h, w = _GRID
    channels = getattr(vision, "in_channels", getattr(vision, "num_channels", 3))
    pixels = channels * getattr(vision, "temporal_patch_size", 1) * vision.patch_size**2
    tokens = [config.vision_start_token_id] + [config.image_token_id] * (t * (h // merge) * (w // merge))
    return tokens + [config.vision_end_token_id], {"pixel_values": torch.randn(t * h * w, pixels, generator=g),
                                                    "image_grid_thw": torch.tensor([_GRID])}


def _one_video(config, g: torch.Generator) -> tuple[list[int], dict[str, torch.Tensor]]:
    """The tokens and the pixel inputs of one video in the Qwen3-VL layout, as ``Qwen3VLProcessor`` renders the chat
    template's ``<|vision_start|><|video_pad|><|vision_end|>``: per frame its timestamp's text, then vision start, the
    frame's placeholders (``h·w / spatial_merge_size²``) and vision end, all inside the template's vision start and
    end; ``pixel_values_videos`` ``[t·h·w, channels · temporal_patch · patch²]`` and a ``video_grid_thw`` row."""
    vision = config.vision_config
    merge = vision.spatial_merge_size
    t, h, w = _VIDEO_GRID
    frame = [*_TIMESTAMP, config.vision_start_token_id, *[config.video_token_id] * (h * w // merge**2),
             config.vision_end_token_id]
    pixels = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    return ([config.vision_start_token_id, *frame * t, config.vision_end_token_id],
            {"pixel_values_videos": torch.randn(t * h * w, pixels, generator=g),
             "video_grid_thw": torch.tensor([_VIDEO_GRID])})


def _media(inputs: str, config, g: torch.Generator, images: int, video: bool) -> list[tuple[list[int], dict]]:
    """The tokens and pixel inputs of a document's ``images`` images, then of its video where ``video``."""
    return [_one_image(inputs, config, g) for _ in range(images)] + ([_one_video(config, g)] if video else [])


def mixed_batches(inputs: str, config, world: int, rows: tuple[tuple, ...] = MIXED_ROWS, seq: int = 20,
                  seed: int = 5, videos: tuple[tuple[int, int], ...] = ()
                  ) -> tuple[torch.Tensor, list[dict[str, torch.Tensor]]]:
    """Token ids ``[world, batch, seq]`` whose row ``b`` of rank ``r`` holds ``rows[r][b]`` images (none: text
    only) and, per rank, the pixel inputs of its images (none where it has none) and ``mm_token_type_ids`` (on every
    rank, as the processors give them). A tuple ``rows[r][b]`` packs the row: one document of ``seq / len`` tokens
    per entry, holding that many images; then ``position_ids`` ``[batch, seq]`` restart at every document (one
    document per row elsewhere). Each ``(r, b)`` of ``videos`` holds a video after its images (in its first
    document; :func:`_one_video`: ``pixel_values_videos``, ``video_grid_thw``, type 2 in ``mm_token_type_ids``)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(20, TEXT_VOCAB, (world, len(rows[0]), seq), generator=g)
    extra = []
    for r in range(world):
        parts, positions = [], []
        for b, counts in enumerate(rows[r]):
            documents = counts if isinstance(counts, tuple) else (counts,)
            length = seq // len(documents)
            positions.append(torch.arange(seq) % length if isinstance(counts, tuple) else torch.arange(seq))
            for d, count in enumerate(documents):
                at = d * length + 1
                for tokens, pixels in _media(inputs, config, g, count, d == 0 and (r, b) in videos):
                    ids[r, b, at:at + len(tokens)] = torch.tensor(tokens)
                    at += len(tokens) + 1
                    parts.append(pixels)
        mine = {k: torch.cat([p[k] for p in parts if k in p]) for k in dict.fromkeys(k for p in parts for k in p)}
        mine["mm_token_type_ids"] = ((ids[r] == config.image_token_id).long()
                                     + 2 * (ids[r] == getattr(config, "video_token_id", -1)).long())
        if any(isinstance(c, tuple) for row in rows for c in row):
            mine["position_ids"] = torch.stack(positions)
        extra.append(mine)
    return ids, extra


# The inputs a proof trains on (:attr:`xpar_zoo.testing.proofs.Proof.inputs`): a builder and its arguments.
INPUTS = {
    "image": (image_batches, {}),
    "image_row_newline": (image_batches, {"row_newline": True}),  # HY-V4-VL
    "pixels_2": (pixel_batches, {"placeholders": 2}),  # Aria: its projector's 2 queries for 16 patches
    "pixels_sized_4": (pixel_batches, {"placeholders": 4, "image_sizes": True}),  # Pixtral-style: (16/4/2)² patches
    "patches": (patch_batches, {}),  # Gemma4
}


def batches(inputs: str, config, world: int) -> tuple[torch.Tensor, list[dict[str, torch.Tensor]]]:
    """Token ids ``[world, batch, seq]`` and each rank's image inputs for a proof's ``inputs`` (:data:`INPUTS`)."""
    builder, kwargs = INPUTS[inputs]
    return builder(config, world, **kwargs)
