"""Multimodal RoPE positions of packed rows (xpar_zoo.styles.encoders.document_positions): each document's 3-D
positions are those transformers' own ``get_rope_index`` gives that document alone, with its images and videos,
where videos are a run of tokens per frame (Qwen3-VL: frames separated by their timestamps' text) and where they are
a run per video (ERNIE-VL), documents holding two videos, images, or text only."""

import pytest
import torch

from xpar_zoo.styles.encoders import document_positions
from xpar_zoo.testing import parity
from xpar_zoo.zoo.registry import build_meta

TEXT = 7  # a text token id (below the tiny configs' special ids)
TIMESTAMP = (27, 48)  # a frame's timestamp text, as Qwen3VLProcessor writes it


def _vision(cfg, kind: str, grid: tuple[int, int, int], per_frame: bool) -> tuple[list[int], list[int]]:
    """The tokens and token types of one image or video of ``grid`` inside vision start / end (a video: each frame's
    timestamp and vision start / end around its placeholders where ``per_frame``, else one run)."""
    vision = cfg.vision_config
    merge, t = vision.spatial_merge_size, grid[0]
    token, code = (cfg.image_token_id, 1) if kind == "image" else (cfg.video_token_id, 2)
    if kind == "video" and per_frame:
        frame = [*TIMESTAMP, cfg.vision_start_token_id, *[token] * (grid[1] * grid[2] // merge**2),
                 cfg.vision_end_token_id]
        tokens = [cfg.vision_start_token_id, *frame * t, cfg.vision_end_token_id]
    else:
        t //= getattr(vision, "temporal_merge_size", 1) if kind == "video" else 1
        tokens = [cfg.vision_start_token_id, *[token] * (t * grid[1] * grid[2] // merge**2), cfg.vision_end_token_id]
    return tokens, [code * (x == token) for x in tokens]


def _document(cfg, parts, per_frame: bool) -> dict:
    """One document: text tokens between ``parts`` (``("image" | "video", grid)``), its types and grids."""
    tokens, types, grids = [TEXT, TEXT], [0, 0], {"image": [], "video": []}
    for kind, grid in parts:
        more, kinds = _vision(cfg, kind, grid, per_frame)
        tokens += [*more, TEXT]
        types += [*kinds, 0]
        grids[kind].append(grid)
    return {"ids": tokens, "types": types, **grids}


def _packed(rows: list[list[dict]]) -> dict:
    """Rows of packed documents (``_document``'s) padded with text to the longest: ids, token types, text positions
    restarting at each document, the documents' grids in order."""
    seq = max(sum(len(d["ids"]) for d in row) for row in rows)
    batch = {"input_ids": torch.full((len(rows), seq), TEXT),
             "mm_token_type_ids": torch.zeros(len(rows), seq, dtype=torch.long),
             "position_ids": torch.zeros(len(rows), seq, dtype=torch.long)}
    for b, row in enumerate(rows):
        at = 0
        for d in row + [{"ids": [TEXT] * (seq - sum(len(d["ids"]) for d in row)), "types": []}]:
            n = len(d["ids"])
            batch["input_ids"][b, at:at + n] = torch.tensor(d["ids"], dtype=torch.long)
            batch["mm_token_type_ids"][b, at:at + len(d["types"])] = torch.tensor(d["types"], dtype=torch.long)
            batch["position_ids"][b, at:at + n] = torch.arange(n)
            at += n
    for kind in ("image", "video"):
        batch[f"{kind}_grid_thw"] = torch.tensor([g for row in rows for d in row for g in d[kind]])
    return batch


# Two rows of two documents: two videos and an image in one, a text-only one, a video and an image.
VIDEO, IMAGE = (4, 4, 4), (1, 4, 4)
ROWS = ([[("video", VIDEO), ("image", IMAGE), ("video", (2, 4, 4))], [("image", IMAGE)]],
        [[], [("video", VIDEO), ("image", IMAGE)]])


@pytest.mark.parametrize("arch,per_frame", [("qwen3_vl_moe", True), ("ernie4_5_vl_moe", False)])
def test_each_packed_documents_positions_are_its_own_with_its_videos(arch, per_frame):
    cfg = parity.tiny_config(arch)
    model = build_meta(cfg, torch.float32)
    rows = [[_document(cfg, parts, per_frame) for parts in row] for row in ROWS]
    batch = _packed(rows)
    seq = batch["input_ids"].shape[1]
    out = document_positions(model, batch)["position_ids"]
    assert out.shape == (4, 2, seq) and torch.equal(out[0], batch["position_ids"])
    host = model.model
    for b, row in enumerate(rows):
        at = 0
        for d in row:
            n = len(d["ids"])
            grids = {f"{k}_grid_thw": torch.tensor(d[k]) if d[k] else None for k in ("image", "video")}
            alone, _ = host.get_rope_index(torch.tensor([d["ids"]]), torch.tensor([d["types"]]), **grids)
            assert torch.equal(out[1:, b, at:at + n], alone[:, 0]), (arch, b, at)
            at += n


def test_video_grids_that_match_no_run_of_video_tokens_are_one_line():
    cfg = parity.tiny_config("qwen3_vl_moe")
    doc = _document(cfg, [("video", VIDEO)], per_frame=True)
    batch = {"input_ids": torch.tensor([doc["ids"]]), "mm_token_type_ids": torch.tensor([doc["types"]]),
             "position_ids": torch.arange(len(doc["ids"]))[None], "video_grid_thw": torch.tensor([VIDEO, VIDEO])}
    with pytest.raises(ValueError, match=r"^the rows hold 4 runs of video tokens, neither one per video \(2 .*\(8\)$"):
        document_positions(build_meta(cfg, torch.float32), batch)


@pytest.mark.parametrize("with_types", [False, True])
def test_qwen3_omni_thinkers_packed_documents_are_at_its_own_positions(with_types):
    """Qwen3-Omni's thinker finds images by their tokens (its ``get_rope_index`` takes no ``mm_token_type_ids``, and
    its processor gives none): each document's positions are those its ``get_rope_index`` gives it alone."""
    cfg = parity.tiny_config("qwen3_omni_moe_thinker")
    model = build_meta(cfg, torch.float32)
    rows = [[_document(cfg, [("image", IMAGE), ("image", (1, 2, 4))], False), _document(cfg, [("image", IMAGE)], False)],
            [_document(cfg, [], False), _document(cfg, [("image", (1, 4, 2))], False)]]
    batch = _packed(rows)
    if not with_types:
        del batch["mm_token_type_ids"]
    out = document_positions(model, batch)["position_ids"]
    assert out.shape == (4, *batch["input_ids"].shape) and torch.equal(out[0], batch["position_ids"])
    assert not torch.equal(out[1], out[2])  # 3-D positions at the images
    for b, row in enumerate(rows):
        at = 0
        for d in row:
            n = len(d["ids"])
            alone, _ = model.get_rope_index(torch.tensor([d["ids"]]), torch.tensor(d["image"]) if d["image"] else None,
                                            attention_mask=torch.ones(1, n, dtype=torch.long))
            assert torch.equal(out[1:, b, at:at + n], alone[:, 0].long()), (b, at)
            at += n


@pytest.mark.parametrize("kind", ["video", "audio"])
def test_qwen3_omni_thinkers_video_or_audio_rows_are_one_line(kind):
    cfg = parity.tiny_config("qwen3_omni_moe_thinker")
    doc = _document(cfg, [("image", IMAGE)], False)
    ids = torch.tensor([doc["ids"] + [getattr(cfg, f"{kind}_token_id"), TEXT]])
    batch = {"input_ids": ids, "position_ids": torch.arange(ids.shape[1])[None], "image_grid_thw": torch.tensor([IMAGE])}
    with pytest.raises(ValueError, match=rf"^qwen3_omni_moe_thinker: rows with {kind} are not trained .*image–text "
                                         "records$"):
        document_positions(build_meta(cfg, torch.float32), batch)


def test_qwen3_omni_thinkers_loss_at_these_positions_is_its_own():
    """A row of one document with images: the thinker's loss at :func:`document_positions`' positions is the loss at
    the positions it computes itself (and not the loss at plain 1-D positions)."""
    from transformers import Qwen3OmniMoeThinkerForConditionalGeneration

    from xpar_zoo.testing import modality

    cfg = parity.tiny_config("qwen3_omni_moe_thinker")
    torch.manual_seed(0)
    model = Qwen3OmniMoeThinkerForConditionalGeneration(cfg).float().eval()
    ids, inputs = modality.mixed_batches("image", cfg, 2)
    ids, images = ids[0], {k: v for k, v in inputs[0].items() if k != "mm_token_type_ids"}
    plain = torch.arange(ids.shape[1]).expand_as(ids)
    ours = document_positions(model, {"input_ids": ids, "position_ids": plain, **images})["position_ids"]
    with torch.no_grad():
        own, at_ours, at_plain = (model(input_ids=ids, labels=ids, **images, **kw).loss for kw in (
            {"attention_mask": torch.ones_like(ids)}, {"position_ids": ours}, {"position_ids": plain}))
    assert own == at_ours and own != at_plain
