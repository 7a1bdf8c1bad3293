"""Multimodal rows under sp/cp: the image features and the token-level inputs of a rank's part of whole rows.

The encoders run before the split (:mod:`xpar_zoo.styles.encoders`, outside the sp/cp wrapper) on the whole rows'
images and hand them in as ``mm_encoder_outputs``; the multimodal RoPE positions ``[4, batch, seq]`` are computed
on the whole rows too. :func:`split_media` keeps, of every encoder output, the features of the placeholders this
rank holds, in the order the model scatters them (its tokens' order, row by row), and this rank's tokens of the
token-level inputs; the model then merges them into its part as it would into whole rows. Backward sends each
rank's placeholders' gradients into the tower; FSDP sums them over the ranks, so the tower's gradient is the whole
rows'.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

TOKEN_KWARGS = ("mm_token_type_ids", "token_type_ids")
MODALITY_CODES = {"image": 1, "video": 2}  # mm_token_type_ids of each modality's placeholders
# Families with 1-D positions whose image rows sp/cp split: one feature row per placeholder token, proved with images
# (tests/distributed/test_zoo_mixed_images.py); other families without multimodal RoPE are refused until proved.
ROW_POSITION_FAMILIES = frozenset({"gemma4"})


def refusal(model: nn.Module) -> str | None:
    """Why sp/cp cannot split ``model``'s multimodal rows (``None``: they can, or it is text-only)."""
    from .encoders import encoder_host

    config = model.config
    towers = [k for k in getattr(config, "sub_configs", {}) if k != "text_config" and getattr(config, k, None)]
    if not towers:
        return None
    name = type(model).__name__
    if [k for k in towers if k != "vision_config"]:
        other = ", ".join(k.removesuffix("_config") for k in towers if k != "vision_config")
        return f"{name} has a tower whose rows sp/cp do not split ({other}); sp/cp split image–text rows"
    if encoder_host(model) is not model:
        return f"{name} does not take precomputed image features at its top level (mm_encoder_outputs)"
    if (not any(callable(getattr(m, "get_rope_index", None)) for m in model.modules())
            and getattr(config, "model_type", None) not in ROW_POSITION_FAMILIES):
        return (f"{name} places its image features without multimodal RoPE; sp/cp split the rows of the "
                f"multimodal-RoPE families (Qwen-VL, GLM-4V) and of {', '.join(sorted(ROW_POSITION_FAMILIES))}, "
                "proved with images")
    return None


def bidirectional_images(model: nn.Module) -> bool:
    """Whether ``model``'s sliding-window layers let the tokens of one image see each other both ways
    (transformers' ``use_bidirectional_attention="vision"``, Gemma 4: its mask there is (causal or the same image)
    and the window, where the batch has ``mm_token_type_ids``)."""
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return getattr(text, "use_bidirectional_attention", None) == "vision"


def vision_blocks(types: torch.Tensor | None) -> torch.Tensor | None:
    """``[batch, seq]``: the number of each image (or video) block of the whole rows' ``mm_token_type_ids``
    (consecutive image or video tokens) at its tokens, ``-1`` elsewhere; ``None`` without ``types``."""
    if types is None:
        return None
    vision = (types == MODALITY_CODES["image"]) | (types == MODALITY_CODES["video"])
    starts = vision.clone()
    starts[:, 1:] &= ~vision[:, :-1]
    return torch.where(vision, starts.long().cumsum(1) - 1, -1)


def placeholder_masks(named: dict, token_ids: dict) -> dict[str, torch.Tensor]:
    """``{modality: [batch, seq] bool}``: where the whole rows hold each modality's placeholders."""
    types, ids = named.get("mm_token_type_ids"), named.get("input_ids")
    out = {}
    for modality, code in MODALITY_CODES.items():
        if types is not None:
            out[modality] = types == code
        elif ids is not None and token_ids.get(modality) is not None:
            out[modality] = ids == token_ids[modality]
    return out


def local_features(output, mask: torch.Tensor, local: torch.Tensor):
    """``output`` (an encoder's ``ModelOutput``) with every feature tensor cut to the placeholders of the tokens
    ``local`` of each row (per-image splits joined into one)."""
    n = int(mask.sum())
    order = (mask.flatten().cumsum(0) - 1).view(mask.shape)
    keep = order[:, local][mask[:, local]]

    def pick(value):
        if torch.is_tensor(value):
            return value[keep.to(value.device)] if value.dim() and value.shape[0] == n else value
        if isinstance(value, (list, tuple)):
            if value and all(torch.is_tensor(t) for t in value) and sum(t.shape[0] for t in value) == n:
                return (torch.cat(list(value))[keep.to(value[0].device)],)
            return type(value)(pick(v) for v in value)
        return value

    out = copy.copy(output)
    for key in list(output.keys()):
        out[key] = pick(output[key])
    return out


def split_media(named: dict, out: dict, local: torch.Tensor, token_ids: dict) -> None:
    """Into ``out`` (the split batch): this rank's features of ``named``'s ``mm_encoder_outputs`` and its tokens
    of the token-level inputs."""
    shape = (named.get("input_ids") if named.get("input_ids") is not None else named["inputs_embeds"]).shape[:2]
    encoded = named.get("mm_encoder_outputs")
    if encoded:
        masks = placeholder_masks(named, token_ids)
        out["mm_encoder_outputs"] = {m: local_features(o, masks[m], local.to(masks[m].device))
                                     if o is not None and m in masks else o for m, o in encoded.items()}
    for key in TOKEN_KWARGS:
        value = named.get(key)
        if torch.is_tensor(value) and tuple(value.shape[:2]) == tuple(shape):
            out[key] = value[:, local.to(value.device)]


def split_positions(positions: torch.Tensor, seq_len: int, batch: int) -> torch.Tensor:
    """Whole rows' ``position_ids`` as ``[rows, batch, seq]``: one row of text positions, or the text positions over
    a multimodal model's 3-D ones (``[4, batch, seq]``, as :func:`xpar_zoo.styles.encoders.document_positions`
    makes them); ``None`` when it is neither."""
    if positions.dim() == 2 and positions.shape[-1] == seq_len:
        return positions.expand(batch, seq_len)[None]
    if positions.dim() == 3 and positions.shape[0] == 4 and positions.shape[-1] == seq_len:
        return positions.expand(4, batch, seq_len)
    return None
