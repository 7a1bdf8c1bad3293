"""Multimodal encoders on every rank: a global batch with images in some rows only trains like any other.

The vision tower of a parallelized multimodal model is made of FSDP units, whose forward all-gathers and backward
reduce-scatters are collectives: every rank must run the tower whenever any rank does, or the ranks' collectives
stop matching. :func:`install_encoder_agreement` wraps the model's forward so that, per modality (image, video):

1. one all-reduce of a flag per forward says whether any rank holds that modality's pixels;
2. where one does, every rank runs the encoder at the same point (before the model's own forward), through the
   model's own ``get_image_features`` / ``get_video_features``, and hands the result in as transformers' own
   ``mm_encoder_outputs`` (the precomputed-features input of every multimodal model it proves);
3. under sp/cp this wrapper is outside the split: the whole rows' images are encoded, each rank of the sequence
   group its share and the group's features all-gathered (:mod:`xpar_zoo.styles.encoder_shares`), and their
   multimodal RoPE positions computed on the whole rows (:func:`document_positions`); the split keeps each rank's
   features (:mod:`xpar_zoo.styles.sequence_media`);
4. a rank without that modality encodes a dummy input (:func:`dummy_pixels`: zero pixels, one merged patch group)
   and passes its features cut to zero rows: the model scatters nothing into its embeddings, and backward
   carries exact zeros through the tower (the slice's gradient) — the same FSDP collectives in the same order as
   on ranks with images, and gradients unchanged, since a zero adds nothing to the sum the reduce-scatter makes.

Where no rank holds a modality, nothing changes (the tower does not run; its gradients stay ``None`` on every rank,
as in one process). Why this rather than an unconditional all-gather: ``docs/design.md``, "Images in some rows only".
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import nn

from ..loss.global_batch import wrap_forward
from ..parallel.mesh import PlanShard
from .encoder_shares import deal, gather_features, image_rows, sequence_shards, share_index, take

# (modality, the forward's pixel input, the model's encoder method)
MODALITIES = (("image", "pixel_values", "get_image_features"), ("video", "pixel_values_videos", "get_video_features"))


def encodes_modalities(model: nn.Module) -> bool:
    """Whether ``model`` is a multimodal transformers model whose forward takes precomputed encoder outputs
    (``mm_encoder_outputs``) and that encodes images with ``get_image_features``."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    return "mm_encoder_outputs" in params and callable(getattr(model, "get_image_features", None))


def _getter_params(model: nn.Module, getter: str) -> Mapping[str, inspect.Parameter]:
    return inspect.signature(getattr(model, getter)).parameters


def dummy_pixels(model: nn.Module, modality: str = "image") -> tuple[torch.Tensor, dict]:
    """The smallest input the model's encoder of ``modality`` takes, all zeros: pixels and the keyword arguments
    that go with them. The layout follows the encoder's signature: a patch grid (``*_grid_thw``: one frame of
    ``spatial_merge_size²`` patches, the Qwen-VL family), positioned patches (``*_position_ids``: one pooling
    window, Gemma 4), or whole images (``[1, channels, image_size, image_size]``, LLaVA-style)."""
    getter = dict((m, g) for m, _, g in MODALITIES)[modality]
    params = _getter_params(model, getter)
    vision = model.config.vision_config
    patch = int(getattr(vision, "patch_size", 14))
    channels = int(getattr(vision, "in_channels", getattr(vision, "num_channels", 3)))
    device = next((p.device for p in model.parameters() if p.device.type != "meta"), torch.device("cpu"))
    grid = f"{modality}_grid_thw"
    if grid in params:
        merge = int(getattr(vision, "spatial_merge_size", 2))
        width = channels * int(getattr(vision, "temporal_patch_size", 1)) * patch**2
        return (torch.zeros(merge * merge, width, device=device),
                {grid: torch.tensor([[1, merge, merge]], device=device)})
    positions = f"{modality}_position_ids"
    if positions in params:
        k = int(getattr(vision, "pooling_kernel_size", 1))
        xy = torch.stack(torch.meshgrid(torch.arange(k), torch.arange(k), indexing="xy"), -1).reshape(1, -1, 2)
        kwargs = {positions: xy.to(device)}
        if "num_frames_per_video" in params:
            kwargs["num_frames_per_video"] = torch.tensor([1], device=device)
        return torch.zeros(1, k * k, channels * patch**2, device=device), kwargs
    side = int(getattr(vision, "image_size", patch))
    kwargs = {"image_sizes": torch.tensor([[side, side]], device=device)} if "image_sizes" in params else {}
    return torch.zeros(1, channels, side, side, device=device), kwargs


def _no_rows(value):
    """``value`` (an encoder's output, or a piece of it) with every tensor cut to zero rows (still in the graph)."""
    if torch.is_tensor(value):
        return value[:0] if value.dim() else value * 0
    if isinstance(value, (list, tuple)):
        return type(value)(_no_rows(v) for v in value)
    if isinstance(value, Mapping):  # transformers' ModelOutput: its set fields
        for key in list(value.keys()):
            value[key] = _no_rows(value[key])
    return value


def _encode(model: nn.Module, getter: str, pixels: torch.Tensor, kwargs: Mapping):
    """The model's own encoder of ``pixels``, with the arguments of ``kwargs`` that it takes."""
    params = _getter_params(model, getter)
    return getattr(model, getter)(pixels, return_dict=True, **{k: v for k, v in kwargs.items() if k in params})


def dealable(model: nn.Module, modality: str, kwargs: Mapping) -> bool:
    """Whether ``modality``'s pixel inputs can be dealt over a sequence group image by image
    (:mod:`~xpar_zoo.styles.encoder_shares`): images always, videos in the patch-grid layout."""
    return modality == "image" or torch.is_tensor(kwargs.get(f"{modality}_grid_thw"))


def _encode_share(model: nn.Module, modality: str, pixels: torch.Tensor, call: Mapping,
                  shards: tuple[PlanShard, PlanShard], device: torch.device):
    """This rank's share of the whole rows' ``modality`` inputs encoded, and the group's features gathered
    (:mod:`~xpar_zoo.styles.encoder_shares`); a rank with an empty share encodes the dummy, keeping zero rows."""
    getter = dict((m, g) for m, _, g in MODALITIES)[modality]
    params = _getter_params(model, getter)
    kwargs = {k: v for k, v in call.items() if k in params}
    sizes = image_rows(pixels, kwargs, f"{modality}_grid_thw")
    index, parts = share_index(shards)
    mine = deal(sizes, parts)[index]
    if len(mine):
        out = _encode(model, getter, *take(pixels, kwargs, sizes, mine))
    else:
        out = _no_rows(_encode(model, getter, *dummy_pixels(model, modality)))
    return gather_features(out, shards, device)


def _held(kwargs: Mapping, device: torch.device) -> list[bool]:
    """Per modality: whether any rank holds its pixels in this forward (one all-reduce)."""
    flags = torch.tensor([kwargs.get(pixel) is not None for _, pixel, _ in MODALITIES], dtype=torch.int32,
                         device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return [bool(f) for f in flags.tolist()]


def encoder_host(model: nn.Module) -> nn.Module | None:
    """The module whose forward runs the encoders: ``model`` itself where it :func:`encodes_modalities`, else the
    first submodule that does (the base model inside a task class that lacks the input), else ``None``."""
    return next((m for m in model.modules() if encodes_modalities(m)), None)


def _splits_rows(model: nn.Module) -> bool:
    """Whether ``model`` runs on an sp/cp mesh (its rows are split after this wrapper)."""
    from ..parallel.state import parallel_state

    state = parallel_state(model)
    return state is not None and state.mesh.sequence_size > 1


def install_encoder_agreement(model: nn.Module, device_type: str) -> bool:
    """Wrap the forward of ``model``'s :func:`encoder_host` as the module docstring says (on a multi-rank group);
    returns whether it did. Every rank's forward is then a collective, as every parallelized model's already is."""
    model = encoder_host(model)
    if model is None or not dist.is_initialized() or dist.get_world_size() == 1:
        return False
    signature = inspect.signature(model.forward)
    var_kw = next((p.name for p in signature.parameters.values() if p.kind is p.VAR_KEYWORD), None)
    device = torch.device(device_type, torch.cuda.current_device()) if device_type == "cuda" else torch.device(device_type)
    names = [m for m, _, g in MODALITIES if callable(getattr(model, g, None))]

    def forward(original, labels, extra, args, kwargs):
        call = signature.bind_partial(*args, **kwargs).arguments
        call.update(call.pop(var_kw, None) or {})
        held = _held(call, device)
        if not any(held):
            return original(*args, **kwargs)
        shards = sequence_shards(model)
        outputs = dict(call.get("mm_encoder_outputs") or {})
        for (modality, pixel, getter), anyone in zip(MODALITIES, held):
            if not anyone or modality not in names or outputs.get(modality) is not None:
                continue
            if call.get(pixel) is not None and shards is not None and dealable(model, modality, call):
                outputs[modality] = _encode_share(model, modality, call.pop(pixel), call, shards, device)
            elif call.get(pixel) is not None:
                outputs[modality] = _encode(model, getter, call.pop(pixel), call)
            else:
                pixels, dummy = dummy_pixels(model, modality)
                outputs[modality] = _no_rows(_encode(model, getter, pixels, dummy))
            call.pop(pixel, None)
        call["mm_encoder_outputs"] = outputs
        if _splits_rows(model) and call.get("position_ids") is None and "input_ids" in call:
            whole = torch.arange(call["input_ids"].shape[1], device=call["input_ids"].device)
            call = document_positions(model, {**call, "position_ids": whole.expand_as(call["input_ids"])})
        return original(**call)

    wrap_forward(model, forward)
    return True


def _runs(types: torch.Tensor, value: int) -> int:
    """How many runs of consecutive ``value`` tokens ``types`` holds (one per image, or per video frame)."""
    hit = (types == value).to(torch.int8)
    return int(((hit[1:] - hit[:-1]) == 1).sum()) + int(hit[:1].sum()) if len(hit) else 0


def _take_videos(grids: list[torch.Tensor], runs: int, per_frame: bool) -> list[torch.Tensor]:
    """The first video grids of ``grids`` (taken off it) that ``runs`` runs of video tokens hold: a run per frame
    (temporal patch) where ``per_frame``, else a run per video."""
    taken = []
    while runs > 0 and grids:
        taken.append(grids.pop(0))
        runs -= int(taken[-1][0]) if per_frame else 1
    return taken


def _runs_are_frames(runs: int, grids: list[torch.Tensor]) -> bool:
    """Whether a batch's ``runs`` runs of video tokens are one per frame of its video ``grids`` (frames separated
    by their timestamps' text: Qwen3-VL, GLM-4V) rather than one per video (ERNIE-VL, HY-V4-VL); ``ValueError``
    naming both counts when they are neither."""
    frames = sum(int(g[0]) for g in grids)
    if runs not in (frames, len(grids)):
        raise ValueError(f"the rows hold {runs} runs of video tokens, neither one per video ({len(grids)} in "
                         f"video_grid_thw) nor one per frame ({frames})")
    return runs == frames


def _documents(text: torch.Tensor) -> list[tuple[int, int, int]]:
    """``(row, start, end)`` of every document of ``text`` positions ``[batch, seq]`` (a document starts where its
    positions restart at 0)."""
    out = []
    for b in range(text.shape[0]):
        starts = (text[b] == 0).nonzero().flatten().tolist() + [text.shape[1]]
        out += [(b, s, e) for s, e in zip(starts[:-1], starts[1:])]
    return out


# Families whose ``get_rope_index`` finds images by their tokens (it takes no ``mm_token_type_ids``) and needs the
# clips' timing for video and audio, which packed training rows do not carry: their rows are image–text only.
TOKEN_FOUND_IMAGES = frozenset({"qwen3_omni_moe_thinker"})


def media_refusal(config, kinds: set[str]) -> str | None:
    """Why ``config``'s model cannot train rows holding media ``kinds`` (``"image"``, ``"video"``, ``"audio"``)
    at its own positions; ``None`` where it can."""
    other = sorted(kinds - {"image"})
    if getattr(config, "model_type", None) in TOKEN_FOUND_IMAGES and other:
        return (f"{config.model_type}: rows with {' or '.join(other)} are not trained (its multimodal RoPE positions "
                "need the clips' timing, which packed rows do not carry); train it on image–text records")
    return None


def _token_types(host: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """``mm_token_type_ids`` of ``ids`` (1 at image placeholders) for a ``host`` whose ``get_rope_index`` finds
    images by their tokens; ``ValueError`` (:func:`media_refusal`) where the rows hold video or audio placeholders."""
    config = host.config
    found = {kind: getattr(config, f"{kind}_token_id", None) for kind in ("image", "video", "audio")}
    refused = media_refusal(config, {k for k, t in found.items() if t is not None and bool((ids == t).any())})
    if refused:
        raise ValueError(refused)
    return (ids == found["image"]).to(torch.int64) if found["image"] is not None else torch.zeros_like(ids)


def _rope_index(host: nn.Module, ids: torch.Tensor, kinds: torch.Tensor, images: list, clips: list,
                typed: bool) -> torch.Tensor:
    """``host.get_rope_index``'s 3-D positions ``[3, 1, len]`` of one document ``ids`` ``[1, len]``, called with the
    arguments its signature takes (``typed``: token types, else an all-ones attention mask where it finds images
    by tokens)."""
    grids = {"image_grid_thw": torch.stack(images) if images else None,
             "video_grid_thw": torch.stack(clips) if clips else None}
    if typed:
        return host.get_rope_index(ids, kinds[None], **grids)[0]
    return host.get_rope_index(ids, **grids, attention_mask=torch.ones_like(ids))[0]


def document_positions(model: nn.Module, batch: dict) -> dict:
    """``batch`` with multimodal RoPE positions where the model uses them (a module with ``get_rope_index``, and
    ``mm_token_type_ids`` in the batch, or image placeholders where it finds images by their tokens: Qwen3-Omni's
    thinker, whose video and audio are refused, :func:`media_refusal`): ``position_ids`` ``[4, batch, seq]``, the
    text positions (which restart at every packed document: transformers' packed-document mask reads them) over the
    model's own 3-D positions, each document's computed alone by ``get_rope_index`` from its tokens and its images'
    and videos' grids. Otherwise unchanged."""
    host = next((m for m in model.modules() if callable(getattr(m, "get_rope_index", None))), None)
    text = batch.get("position_ids")
    if host is None or text is None or text.dim() != 2:
        return batch
    ids = batch["input_ids"]
    types = batch.get("mm_token_type_ids")
    typed = "mm_token_type_ids" in inspect.signature(host.get_rope_index).parameters
    if not typed:
        types = _token_types(host, ids)
        types = types if bool(types.any()) else None
    if types is None:
        return batch
    images = list(batch.get("image_grid_thw", ()))
    videos = list(batch.get("video_grid_thw", ()))
    documents = _documents(text)
    per_frame = _runs_are_frames(sum(_runs(types[b, s:e], 2) for b, s, e in documents), videos) if videos else True
    rope = torch.zeros(3, *ids.shape, dtype=torch.int64, device=ids.device)
    for b, s, e in documents:
        kinds = types[b, s:e]
        mine = [images.pop(0) for _ in range(_runs(kinds, 1))]
        clips = _take_videos(videos, _runs(kinds, 2), per_frame)
        rope[:, b, s:e] = _rope_index(host, ids[b:b + 1, s:e], kinds, mine, clips, typed)[:, 0]
    return {**batch, "position_ids": torch.cat([text[None].to(rope.device), rope])}
