"""Image–text conversations in `xpar-zoo train` (xpar_zoo.train.multimodal): rendered by the model's own processor
(loaded without its video processor where torchvision does not load), placeholders and pixels exactly as the
processor makes them, assistant-only targets, whole conversations packed with their images and each packed
document's multimodal RoPE positions the model's own; every bad image is one line naming the record and the file."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from xpar_zoo.errors import DataError
from xpar_zoo.train.chat import load_examples, media_parts
from xpar_zoo.train.multimodal import (
    check_images,
    load_processor,
    media_corpus,
    render_media,
)
from xpar_zoo.train.tiny_vl import (
    save_processor_files,
    tiny_vl_config,
    tiny_vl_tokenizer,
)

DATA = Path(__file__).resolve().parents[2] / "examples" / "data"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The tiny VL model's config and processor files (no weights: rendering reads none)."""
    directory = tmp_path_factory.mktemp("tiny_vl")
    tokenizer = tiny_vl_tokenizer()
    tiny_vl_config(tokenizer).save_pretrained(directory)
    save_processor_files(directory, tokenizer)
    return directory


@pytest.fixture(scope="module")
def processor(model_dir):
    from transformers import AutoConfig

    return load_processor(str(model_dir), AutoConfig.from_pretrained(model_dir))


def _examples(records, base: Path):
    base.mkdir(parents=True, exist_ok=True)
    path = base / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path, load_examples(path)


def _chat(*parts, answer="Red."):
    return {"messages": [{"role": "user", "content": list(parts)}, {"role": "assistant", "content": answer}]}


def _image(path):
    return {"type": "image", "image": path}


def test_the_processor_loads_without_torchvision_and_keeps_its_class_and_template(processor):
    assert type(processor).__name__ == "Qwen3VLProcessor"
    assert processor.video_processor is None and "<|image_pad|>" in processor.chat_template


def test_two_images_render_as_the_processor_expands_them_with_assistant_only_targets(processor, tmp_path):
    shutil.copytree(DATA / "images", tmp_path / "images")
    path, (kind, examples) = _examples([_chat(_image("images/red_square.png"), _image("images/blue_circle.png"),
                                              {"type": "text", "text": "Same colour?"}, answer="No.")], tmp_path)
    check_images(examples, tmp_path, allow_absolute=False, videos=False)
    ids, mask, inputs = render_media(processor, examples[0], "assistant", {})
    from PIL import Image

    images = [Image.open(tmp_path / "images" / n).convert("RGB") for n in ("red_square.png", "blue_circle.png")]
    own = processor.image_processor(images, return_tensors="pt")
    assert torch.equal(inputs["pixel_values"], own["pixel_values"])
    assert torch.equal(inputs["image_grid_thw"], own["image_grid_thw"])
    tokens = processor.tokenizer.convert_ids_to_tokens(ids.tolist())
    runs = "".join("I" if t == "<|image_pad|>" else "." for t in tokens).split(".")
    assert [len(r) for r in runs if r] == (own["image_grid_thw"].prod(-1) // 4).tolist()
    assert torch.equal(inputs["mm_token_type_ids"], torch.tensor([t == "<|image_pad|>" for t in tokens]).long())
    assert processor.tokenizer.decode(ids[mask]) == "No.<|im_end|>"


@pytest.mark.parametrize("case,value,expected", [
    ("missing", "images/none.png", "image images/none.png: no such file"),
    ("empty", "images/empty.png", "image images/empty.png: an empty file (0 bytes)"),
    ("unreadable", "images/text.png", "image images/text.png: not a readable image"),
    ("outside", "../outside.png", "image ../outside.png: outside the data folder"),
    ("absolute", "ABSOLUTE", "outside the data folder"),
])
def test_a_bad_image_is_one_line_naming_the_record_and_the_file(tmp_path, case, value, expected):
    base = tmp_path / "data"
    (base / "images").mkdir(parents=True)
    shutil.copy(DATA / "images" / "red_square.png", tmp_path / "outside.png")
    (base / "images" / "empty.png").write_bytes(b"")
    (base / "images" / "text.png").write_text("not a picture")
    value = str(tmp_path / "outside.png") if value == "ABSOLUTE" else value
    path, (_, examples) = _examples([_chat({"type": "text", "text": "hi"}), _chat(_image(value))], base)
    with pytest.raises(DataError) as e:
        check_images(examples, base, allow_absolute=False, videos=False)
    message = str(e.value)
    assert message.startswith(f"{path}:2: ") and expected in message and "\n" not in message, message
    if case in ("outside", "absolute"):
        assert "--allow-absolute-paths" in message
        check_images(examples, base, allow_absolute=True, videos=False)  # read when allowed


def test_a_video_part_without_torchvision_is_one_line(tmp_path):
    path, (_, examples) = _examples([_chat({"type": "video", "video": "clip.mp4"})], tmp_path)
    with pytest.raises(DataError, match=r"data.jsonl:1: a video part \(clip.mp4\): .* needs torchvision"):
        check_images(examples, tmp_path, allow_absolute=False, videos=False)


def test_a_video_part_is_checked_as_a_file_where_the_processor_takes_videos(tmp_path):
    """A video file (not an image PIL reads) passes where the processor has a video processor; a missing one is
    one line naming the record and the file."""
    (tmp_path / "clip.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42")
    _, (_, examples) = _examples([_chat({"type": "video", "video": "clip.mp4"}, _image("missing.png"))], tmp_path)
    with pytest.raises(DataError, match=r"data.jsonl:1: image missing.png: no such file"):
        check_images(examples, tmp_path, allow_absolute=False, videos=True)  # the video passed first
    path, (_, examples) = _examples([_chat({"type": "video", "video": "gone.mp4"})], tmp_path)
    with pytest.raises(DataError, match=r"data.jsonl:1: video gone.mp4: no such file"):
        check_images(examples, tmp_path, allow_absolute=False, videos=True)


def test_train_with_a_video_part_without_torchvision_is_one_line_before_any_work(processor, model_dir, tmp_path,
                                                                                 capsys):
    from xpar_zoo.commands import cli

    if processor.video_processor is not None:
        pytest.skip("torchvision loads here: the processor renders videos")
    text = {"type": "text", "text": "What moves?"}
    path, _ = _examples([_chat(text), _chat({"type": "video", "video": "clip.mp4"}, text)], tmp_path)
    argv = ["train", "--model", str(model_dir), "--data", str(path), "--output", str(tmp_path / "out"),
            "--steps", "1", "--seq-len", "128", "--mesh", "none", "--dry-run"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"{path}:2: a video part (clip.mp4): " in err and "torchvision" in err, err


def test_the_proofs_video_rows_are_laid_out_as_the_processor_expands_a_video(processor):
    """:func:`xpar_zoo.testing.modality.mixed_batches`' video (two frames of 4×4 patches) against the tokens
    ``Qwen3VLProcessor`` makes of the chat template's video part (its frame timestamps as text; no torchvision
    needed for the text side): the same sequence of vision start / end, video placeholders and text runs."""
    import copy
    from types import SimpleNamespace

    from xpar_zoo.testing import modality, parity

    cfg = parity.tiny_config("qwen3_vl_moe")
    ids, inputs = modality.mixed_batches("image", cfg, 4, videos=((1, 1),))
    video = copy.copy(processor)
    video.video_processor = SimpleNamespace(merge_size=2, temporal_patch_size=2)
    grid = inputs[1]["video_grid_thw"]
    metadata = SimpleNamespace(fps=2.0, frames_indices=list(range(int(grid[0, 0]) * 2)))
    expanded = video.replace_video_token({"video_grid_thw": grid, "video_metadata": [metadata]}, 0)
    text = video.apply_chat_template([{"role": "user", "content": [{"type": "video", "video": "v.mp4"}]}],
                                     tokenize=False)
    [text], _ = video.get_text_with_replacements([text], videos_replacements=[expanded])
    tokenizer = processor.tokenizer
    names = {tokenizer.convert_tokens_to_ids(t): t for t in ("<|vision_start|>", "<|vision_end|>", "<|video_pad|>")}
    ours = {cfg.vision_start_token_id: "<|vision_start|>", cfg.vision_end_token_id: "<|vision_end|>",
            cfg.video_token_id: "<|video_pad|>"}

    def layout(tokens, special):  # first vision start to last vision end: each run of other tokens as one "text"
        out = [special.get(t, "text") for t in tokens]
        out = out[out.index("<|vision_start|>"):len(out) - out[::-1].index("<|vision_end|>")]
        return [x for i, x in enumerate(out) if x != "text" or out[i - 1] != "text"]

    row = ids[1, 1].tolist()
    assert layout(row, ours) == layout(tokenizer(text)["input_ids"], names), text
    assert inputs[1]["mm_token_type_ids"][1].tolist() == [2 * (t == cfg.video_token_id) for t in row]
    assert inputs[1]["pixel_values_videos"].shape[0] == int(grid.prod())


def test_a_bad_part_is_one_line():
    from xpar_zoo.train.chat import to_example

    with pytest.raises(DataError, match=r"r:1: messages\[0\].content\[0\]: a image part needs 'image'"):
        to_example("r:1", _chat({"type": "image"}))


def test_packed_rows_hold_whole_conversations_their_images_and_each_documents_own_positions(processor, model_dir):
    from transformers import AutoConfig

    from xpar_zoo.styles.encoders import document_positions
    from xpar_zoo.zoo.registry import build_meta

    config = AutoConfig.from_pretrained(model_dir)
    kind, examples = load_examples(DATA / "tiny_vl.jsonl")
    corpus = media_corpus(DATA / "tiny_vl.jsonl", kind, examples, processor, loss_on=None, seq_len=160, seed=0,
                          vocab_size=config.text_config.vocab_size, settings={}, allow_absolute=False)
    model = build_meta(config, torch.float32)
    rows = corpus.rows(0, 4)
    batch = document_positions(model, rows)
    assert batch["position_ids"].shape == (4, 4, 160)
    images = iter(rows["image_grid_thw"])
    patches = 0
    for r in range(4):
        text = rows["position_ids"][r]
        starts = (text == 0).nonzero().flatten().tolist() + [160]
        for s, e in zip(starts[:-1], starts[1:]):
            ids = rows["input_ids"][r, s:e][None]
            types = rows["mm_token_type_ids"][r, s:e][None]
            runs = int(((types[0, 1:] == 1) & (types[0, :-1] == 0)).sum())
            grids = [next(images) for _ in range(runs)]
            own = model.model.compute_3d_position_ids(
                input_ids=ids, inputs_embeds=torch.zeros(1, e - s, 1), mm_token_type_ids=types,
                image_grid_thw=torch.stack(grids) if grids else None)
            want = own if own is not None else torch.arange(e - s).expand(3, 1, -1)
            assert torch.equal(batch["position_ids"][1:, r:r + 1, s:e], want), (r, s, e)
            patches += sum(int(g.prod()) for g in grids)
    assert next(images, None) is None and rows["pixel_values"].shape[0] == patches
    assert np.isclose(corpus.fill, corpus.num_tokens / (corpus.rows_per_epoch * 160))



def test_qwen3_omni_thinkers_video_records_are_one_line_before_any_work(tmp_path):
    """Qwen3-Omni's thinker trains image–text records (its multimodal RoPE positions of a video need the clip's
    timing, which packed rows do not carry): a video part is refused before the processor loads."""
    from types import SimpleNamespace

    from xpar_zoo.testing import parity
    from xpar_zoo.train.inputs import load_corpus

    path, _ = _examples([_chat(_image("a.png")), _chat({"type": "video", "video": "clip.mp4"})], tmp_path)
    with pytest.raises(DataError, match=r"^\S+data.jsonl: qwen3_omni_moe_thinker: rows with video are not trained "
                                        r"\(.*\); train it on image–text records$"):
        load_corpus(SimpleNamespace(tokenizer=None, model="none"), 128, str(path),
                    parity.tiny_config("qwen3_omni_moe_thinker"))

def test_media_parts_keep_their_order():
    from xpar_zoo.train.chat import to_example

    ex = to_example("r:1", _chat(_image("a.png"), {"type": "text", "text": "x"}, _image("b.png")))
    assert [p["image"] for p in media_parts(ex)] == ["a.png", "b.png"]


def test_image_parts_on_a_text_only_model_are_one_line(tmp_path):
    from xpar_zoo.train.chat import conversation_corpus
    from xpar_zoo.train.tiny import tiny_tokenizer

    path, (kind, examples) = _examples([_chat({"type": "text", "text": "hi"})], tmp_path)
    with pytest.raises(DataError, match=r"data.jsonl:1: message content as a list of parts .* text-only"):
        conversation_corpus(path, kind, examples, tiny_tokenizer(), loss_on=None, seq_len=64, seed=0,
                            truncate=None, vocab_size=300)


def _conversation(cfg, first: int, images: int = 0, videos: tuple = ()) -> tuple[np.ndarray, dict]:
    """A rendered conversation's token ids and processor inputs, as Qwen3VLProcessor makes them, built by hand (no
    torchvision): ``images`` images of 4×4 patches, then videos of the grids ``videos`` (each frame its timestamp's
    text and its placeholders inside vision start / end), between text tokens from ``first``; pixels filled with
    ``first``."""
    start, end, merge = cfg.vision_start_token_id, cfg.vision_end_token_id, cfg.vision_config.spatial_merge_size
    ids, media = [first, first + 1], {}
    for _ in range(images):
        ids += [start, *[cfg.image_token_id] * (16 // merge**2), end, first + 2]
    for t, h, w in videos:
        frame = [first + 3, first + 4, start, *[cfg.video_token_id] * (h * w // merge**2), end]
        ids += [start, *frame * t, end, first + 5]
    if images:
        media.update(pixel_values=torch.full((16 * images, 4), float(first)),
                     image_grid_thw=torch.tensor([[1, 4, 4]] * images))
    if videos:
        media.update(pixel_values_videos=torch.full((sum(t * h * w for t, h, w in videos), 4), float(first)),
                     video_grid_thw=torch.tensor(videos))
    x = np.asarray(ids, dtype=np.int64)
    media["mm_token_type_ids"] = torch.from_numpy((x == cfg.image_token_id) + 2 * (x == cfg.video_token_id))
    return x, media


def test_packed_video_conversations_hold_their_videos_and_each_documents_own_positions(model_dir):
    """Conversations with videos (one or two, beside images) packed whole by the training data's corpus: each row's
    video inputs are its conversations' in order, and every packed document's multimodal RoPE positions are those
    transformers' ``get_rope_index`` gives that conversation alone."""
    from transformers import AutoConfig

    from xpar_zoo.styles.encoders import document_positions
    from xpar_zoo.train.multimodal import MediaCorpus
    from xpar_zoo.zoo.registry import build_meta

    config = AutoConfig.from_pretrained(model_dir)
    model = build_meta(config, torch.float32)
    convs = [_conversation(config, 10, videos=((2, 4, 4),)),
             _conversation(config, 20, images=1, videos=((2, 4, 4), (1, 4, 4))),  # two videos, beside a text one
             _conversation(config, 30),
             _conversation(config, 40, images=2),  # beside the first video
             _conversation(config, 50, videos=((1, 4, 4),))]
    corpus = MediaCorpus([x for x, _ in convs], [np.ones(len(x), bool) for x, _ in convs], [m for _, m in convs],
                         seq_len=48, seed=0, pad_id=0, source="videos", digest="")
    assert corpus.rows_per_epoch < len(convs)  # packed
    rows = corpus.rows(0, corpus.rows_per_epoch)
    batch = document_positions(model, rows)
    held = []
    for r in range(corpus.rows_per_epoch):
        starts = (rows["position_ids"][r] == 0).nonzero().flatten().tolist() + [48]
        for s, e in zip(starts[:-1], starts[1:]):
            ids = rows["input_ids"][r, s:e]
            if not ids.any():
                continue  # the row's padding
            x, media = convs[int(ids[0]) // 10 - 1]
            assert ids.tolist() == x.tolist()
            held.append(media)
            own, _ = model.model.get_rope_index(ids[None], media["mm_token_type_ids"][None],
                                                image_grid_thw=media.get("image_grid_thw"),
                                                video_grid_thw=media.get("video_grid_thw"))
            assert torch.equal(batch["position_ids"][1:, r, s:e], own[:, 0]), (r, s)
    assert len(held) == len(convs)
    for key in ("pixel_values_videos", "video_grid_thw", "pixel_values", "image_grid_thw"):
        assert torch.equal(rows[key], torch.cat([m[key] for m in held if key in m])), key
