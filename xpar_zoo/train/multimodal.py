"""Image–text conversations for multimodal models: images checked, conversations rendered with the model's own
processor and chat template, packed whole with their images.

- Records: ``messages`` whose content may be a list of parts, ``{"type": "text", "text": …}``,
  ``{"type": "image", "image": "img/1.png"}`` (a path relative to the data file; several images or none per
  record; a path outside the data folder's tree only with ``--allow-absolute-paths``). :func:`check_images` opens
  every image before anything trains, and names the record and the file of a missing, empty, unreadable or
  zero-size one.
- :func:`load_processor`: ``AutoProcessor``; where the processor's video processor cannot load (it needs
  torchvision), the same processor class built from its image processor and tokenizer, with its chat template;
  video parts are then refused with one line.
- :func:`render_media`: the processor's chat template renders the conversation, the processor expands each image
  placeholder and makes the pixel inputs (``--max-pixels`` / ``--min-pixels`` passed to it); the targets are those
  of text SFT (:mod:`xpar_zoo.train.chat`): the template's ``{% generation %}`` spans or the rendered prefixes,
  moved past each placeholder's expansion by the processor's replacement offsets.
- :class:`MediaCorpus`: the conversations packed whole (:class:`~xpar_zoo.train.packing.ConversationCorpus`) with
  their images: a row's pixel inputs are its conversations', in order; token-level inputs (``mm_token_type_ids``)
  are placed with their tokens. Multimodal RoPE positions are the model's own, per packed document
  (:func:`xpar_zoo.styles.encoders.document_positions`, once the model is loaded).
"""

from __future__ import annotations

import bisect
import hashlib
import importlib
import importlib.util
import json
from pathlib import Path

import numpy as np
import torch

from ..errors import DataError
from .chat import (
    Example,
    RenderStats,
    has_generation_markers,
    media_parts,
    pad_token_id,
    prefix_spans,
    spans_to_mask,
    trim_after_eos,
)
from .packing import ConversationCorpus

TOKEN_INPUTS = ("mm_token_type_ids", "token_type_ids")  # processor outputs with a value per token
DROPPED = ("input_ids", "attention_mask", "offset_mapping", "text_replacement_offsets")


def is_multimodal(config) -> bool:
    """Whether a model config has a vision tower (a ``vision_config``)."""
    return getattr(config, "vision_config", None) is not None


# ---- images ------------------------------------------------------------------------------------------------------
def _open_image(path: Path):
    from PIL import Image

    with Image.open(path) as image:
        image.load()
        return image.convert("RGB")


def resolve_image(where: str, value: str, base: Path, allow_absolute: bool, kind: str = "image") -> Path:
    """The file an image part names (relative to ``base``, the data file's folder), checked: inside ``base``'s tree
    unless ``allow_absolute``, present, not empty, readable as an image, not of zero size. :class:`DataError`
    naming the record and the file otherwise. ``kind="video"``: a video part's file, checked up to "not empty"
    (the processor's video processor decodes it)."""
    given = Path(value).expanduser()
    path = (given if given.is_absolute() else base / given).resolve()
    if not allow_absolute and not path.is_relative_to(base.resolve()):
        raise DataError(f"{where}: {kind} {value}: outside the data folder {base} (an absolute path or '..'); pass "
                        "--allow-absolute-paths to read it")
    if not path.is_file():
        raise DataError(f"{where}: {kind} {value}: no such file ({path})")
    if path.stat().st_size == 0:
        raise DataError(f"{where}: {kind} {value}: an empty file (0 bytes)")
    if kind == "video":
        return path
    try:
        image = _open_image(path)
    except Exception as e:  # PIL raises many kinds (UnidentifiedImageError, OSError, SyntaxError, …)
        raise DataError(f"{where}: image {value}: not a readable image ({type(e).__name__}: "
                        f"{(str(e).splitlines() or [''])[0][:120]})") from None
    if 0 in image.size:
        raise DataError(f"{where}: image {value}: zero-size image ({image.size[0]}x{image.size[1]})")
    return path


def check_images(examples: list[Example], base: Path, allow_absolute: bool, videos: bool) -> list[Example]:
    """Every example with its image and video parts' paths resolved and checked (:func:`resolve_image`); video
    parts refused with one line where the processor has no video processor (``videos`` false)."""
    if importlib.util.find_spec("PIL") is None and any(media_parts(ex) for ex in examples):
        raise DataError("image parts need Pillow to open the images: pip install 'xpar_zoo[vision]'")
    for ex in examples:
        for part in media_parts(ex):
            if part["type"] == "video" and not videos:
                raise DataError(f"{ex.where}: a video part ({part['video']}): this processor's video processor "
                                "needs torchvision, which does not load here; install a torchvision built for this "
                                "torch, or train on images")
            part["path"] = resolve_image(ex.where, part[part["type"]], base, allow_absolute, part["type"])
    return examples


# ---- the processor ------------------------------------------------------------------------------------------------
def _torchvision_loads() -> bool:
    try:
        importlib.import_module("torchvision")
    except Exception:  # absent, or built for another torch ("operator torchvision::nms does not exist")
        return False
    return True


def _processor_class(directory: Path, config):
    import transformers
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    name = None
    for file in ("processor_config.json", "preprocessor_config.json"):
        if (directory / file).is_file():
            name = name or json.loads((directory / file).read_text()).get("processor_class")
    name = name or PROCESSOR_MAPPING_NAMES.get(config.model_type)
    if not name or not hasattr(transformers, name):
        raise DataError(f"{directory}: no processor class for {config.model_type} (processor_config.json names "
                        "none); image–text data needs the model's processor files")
    return getattr(transformers, name)


def _processor_without_video(directory: Path, config):
    """The processor class of ``directory`` built from its image processor, tokenizer (and feature extractor),
    with the processor's chat template and settings, and no video processor."""
    from transformers import AutoFeatureExtractor, AutoImageProcessor, AutoTokenizer

    from ..compat import processor_without_video

    cls = _processor_class(directory, config)
    loaders = {"image_processor": AutoImageProcessor, "tokenizer": AutoTokenizer,
               "feature_extractor": AutoFeatureExtractor}
    parts = {name: loaders[name].from_pretrained(directory) for name in cls.get_attributes() if "video" not in name}
    settings = {}
    if (directory / "processor_config.json").is_file():
        settings = {k: v for k, v in json.loads((directory / "processor_config.json").read_text()).items()
                    if k != "processor_class" and not isinstance(v, dict)}
    template = directory / "chat_template.jinja"
    chat = template.read_text() if template.is_file() else getattr(parts.get("tokenizer"), "chat_template", None)
    return processor_without_video(cls, parts, chat_template=chat, **settings)


def load_processor(name_or_dir: str, config):
    """The model's processor (``AutoProcessor``), or without torchvision the same class without its video
    processor; :class:`DataError` (one line) when there is none."""
    from transformers import AutoProcessor

    from ..hub.resolve import resolve_config

    try:
        return AutoProcessor.from_pretrained(name_or_dir)
    except Exception as e:  # ImportError without torchvision, OSError / ValueError without processor files
        first = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:160]}"
        if _torchvision_loads():
            raise DataError(f"no processor in {name_or_dir} ({first}); image–text data needs the model's "
                            "processor files (preprocessor_config.json, tokenizer, chat template)") from None
    try:
        return _processor_without_video(resolve_config(name_or_dir).parent, config)
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise DataError(f"no processor in {name_or_dir} ({type(e).__name__}: "
                        f"{(str(e).splitlines() or [''])[0][:160]}); image–text data needs the model's processor "
                        "files") from None


def has_video_processor(processor) -> bool:
    return getattr(processor, "video_processor", None) is not None


# ---- rendering ------------------------------------------------------------------------------------------------
def _messages(ex: Example) -> list[dict]:
    """The example's messages as the chat template takes them: media parts without their paths."""
    return [{**m, "content": [{"type": p["type"]} if p["type"] != "text" else p for p in m["content"]]}
            if isinstance(m.get("content"), list) else m for m in ex.messages]


def _generation_spans(processor, messages: list[dict], tools) -> list[tuple[int, int]]:
    from transformers.utils.chat_template_utils import render_jinja_template

    _, indices = render_jinja_template(conversations=[messages], tools=tools, chat_template=processor.chat_template,
                                       return_assistant_tokens_mask=True, **processor.tokenizer.special_tokens_map)
    return [tuple(span) for span in indices[0]]


class _Shift:
    """Character positions of the rendered text moved past the placeholders the processor expanded before them."""

    def __init__(self, replacements: list[dict]):
        self.ends = [r["span"][1] for r in replacements]
        self.gained = [0] + [r["new_span"][1] - r["span"][1] for r in replacements]

    def __call__(self, char: int) -> int:
        return char + self.gained[bisect.bisect_right(self.ends, char)]


def _encode(processor, text: str, ex: Example, images_kwargs: dict) -> dict:
    images = [part["image_data"] for part in media_parts(ex) if part["type"] == "image"]
    videos = [str(part["path"]) for part in media_parts(ex) if part["type"] == "video"]
    return processor(text=[text], images=images or None, videos=videos or None, return_offsets_mapping=True,
                     return_text_replacement_offsets=True, images_kwargs=images_kwargs, return_tensors="pt")


def render_media(processor, ex: Example, loss_on: str, images_kwargs: dict) -> tuple[np.ndarray, np.ndarray, dict]:
    """Token ids (int64), target mask (bool) and the processor's other inputs (pixels per image, token types) of
    one conversation (see the module docstring)."""
    messages = _messages(ex)
    text = processor.apply_chat_template(messages, tools=ex.tools, tokenize=False)
    for part in media_parts(ex):
        if part["type"] == "image":
            part["image_data"] = _open_image(part["path"])
    try:
        enc = _encode(processor, text, ex, images_kwargs)
    finally:
        for part in media_parts(ex):
            part.pop("image_data", None)
    ids = enc["input_ids"][0].numpy().astype(np.int64)
    offsets = enc["offset_mapping"][0].tolist()
    shift = _Shift(enc.get("text_replacement_offsets", [[]])[0] or [])
    rendered = Example(ex.where, messages=messages, completion_from=ex.completion_from, tools=ex.tools)
    if loss_on == "all":
        mask = np.ones(len(ids), dtype=bool)
    elif has_generation_markers(processor):
        spans = [(shift(a), shift(b)) for a, b in _generation_spans(processor, messages, ex.tools)]
        mask = spans_to_mask(offsets, spans)
    else:
        first = ex.completion_from if loss_on == "completion" else 0
        spans = [(shift(a), shift(b)) for a, b in prefix_spans(processor, rendered, text, first)]
        mask = trim_after_eos(ids, spans_to_mask(offsets, spans), processor.tokenizer.eos_token_id)
    if loss_on == "completion":
        mask &= np.asarray([a >= shift(_prompt_chars(processor, rendered)) for a, _ in offsets], dtype=bool)
    if len(mask):
        mask[0] = False
    inputs = {k: v[0] if k in TOKEN_INPUTS else v for k, v in enc.items() if k not in DROPPED}
    return ids, mask, inputs


def _prompt_chars(processor, ex: Example) -> int:
    prompt = processor.apply_chat_template(ex.messages[:ex.completion_from], tools=ex.tools, tokenize=False,
                                           add_generation_prompt=True)
    return len(prompt)


def images_kwargs(max_pixels: int | None, min_pixels: int | None) -> dict:
    """The processor's image settings ``--max-pixels`` / ``--min-pixels`` give (none: the processor's own)."""
    return {k: v for k, v in (("max_pixels", max_pixels), ("min_pixels", min_pixels)) if v is not None}


# ---- the corpus ------------------------------------------------------------------------------------------------
def _stack(tensors: list[torch.Tensor], pad: int) -> torch.Tensor:
    """``tensors`` concatenated on dim 0, each padded on its later dims to the largest (Gemma 4's patches;
    ``pad``: the padding value, -1 for positions as the processor pads them)."""
    shape = [max(t.shape[d] for t in tensors) for d in range(1, tensors[0].dim())]
    padded = []
    for t in tensors:
        if list(t.shape[1:]) != shape:
            out = t.new_full((t.shape[0], *shape), pad)
            out[tuple(slice(0, n) for n in t.shape)] = t
            t = out
        padded.append(t)
    return torch.cat(padded)


class MediaCorpus(ConversationCorpus):
    """Conversations with their images packed whole into rows (see the module docstring); ``rows`` adds the
    pixel inputs of the rows' images and the token-level inputs."""

    def __init__(self, ids, masks, media: list[dict], seq_len: int, seed: int, pad_id: int, source: str,
                 digest: str):
        super().__init__(ids, masks, seq_len, seed, pad_id, source=source)
        self.media, self.digest = media, digest

    def fingerprint(self) -> str:
        h = hashlib.sha1(super().fingerprint().encode())
        h.update(self.digest.encode())
        return h.hexdigest()[:16]

    def rows(self, first: int, count: int) -> dict[str, torch.Tensor]:
        out = super().rows(first, count)
        convs = [self.bins[int(self._epoch_order(g // self.rows_per_epoch)[g % self.rows_per_epoch])]
                 for g in range(first, first + count)]
        token_keys = sorted({k for m in self.media for k in m if k in TOKEN_INPUTS})
        for key in token_keys:
            values = torch.zeros(count, self.seq_len, dtype=torch.int64)
            for r, bin_ in enumerate(convs):
                at = 0
                for c in bin_:
                    n = int(self.lengths[c])
                    if key in self.media[c]:
                        values[r, at:at + n] = self.media[c][key].to(torch.int64)
                    at += n
            out[key] = values
        held = [self.media[c] for bin_ in convs for c in bin_]
        for key in dict.fromkeys(k for m in held for k in m if k not in TOKEN_INPUTS):
            parts = [m[key] for m in held if key in m]
            out[key] = _stack(parts, -1 if key.endswith("position_ids") else 0)
        return out


def media_corpus(path: Path, kind: str, examples: list[Example], processor, *, loss_on: str | None, seq_len: int,
                 seed: int, vocab_size: int, settings: dict, allow_absolute: bool) -> MediaCorpus:
    """The :class:`MediaCorpus` of ``examples`` (read from ``path``): images checked, every conversation rendered
    (:func:`render_media`; one longer than ``seq_len`` is refused naming it) and packed whole."""
    if kind != "messages":
        raise DataError(f"{path}: image–text data is 'messages' records (prompt/completion records are text)")
    base = path if path.is_dir() else path.parent
    check_images(examples, base, allow_absolute, has_video_processor(processor))
    loss_on = loss_on or "assistant"
    stats = RenderStats(kind=kind)
    ids, masks, media, digest = [], [], [], hashlib.sha1()
    for ex in examples:
        x, mask, inputs = render_media(processor, ex, loss_on, settings)
        stats.examples += 1
        if len(x) > seq_len:
            raise DataError(f"{ex.where}: {len(x)} tokens with its images, longer than seq_len {seq_len}; raise "
                            "--seq-len or lower --max-pixels (a conversation with images is never cut)")
        ids.append(x)
        masks.append(mask)
        media.append(inputs)
        stats.tokens += len(x)
        stats.targets += int(mask.sum())
        for part in media_parts(ex):
            digest.update(part["path"].read_bytes())
    top = max(int(x.max()) for x in ids if len(x))
    if top >= vocab_size:
        raise DataError(f"{path}: token id {top} is outside the model's vocabulary ({vocab_size} rows); use the "
                        "model's processor")
    corpus = MediaCorpus(ids, masks, media, seq_len, seed, pad_token_id(processor.tokenizer), str(path),
                         digest.hexdigest())
    images = sum(1 for ex in examples for p in media_parts(ex) if p["type"] == "image")
    corpus.summary = (f"{path}: {stats.describe(seq_len, None)}, {images} images; loss on {loss_on} tokens; "
                      f"packed whole into {corpus.rows_per_epoch} rows of {seq_len} ({100 * corpus.fill:.0f}% "
                      "filled)")
    corpus.stats = stats
    return corpus


# ---- the model --------------------------------------------------------------------------------------------------
PROCESSOR_FILES = ("preprocessor_config.json", "video_preprocessor_config.json", "processor_config.json",
                   "chat_template.jinja", "chat_template.json")
VISION_MODULES = ("visual", "vision_tower", "vision_model", "vision_encoder", "multi_modal_projector", "embed_vision")


def copy_processor_files(model: str, directory: str | Path) -> list[str]:
    """Copy the processor's files of ``model`` (a directory or hub id) beside an export (the tokenizer is saved
    apart), so that ``AutoProcessor`` loads from the export. Returns the names copied."""
    import shutil

    from ..hub.resolve import resolve_config

    source = resolve_config(model).parent
    copied = [name for name in PROCESSOR_FILES if (source / name).is_file()]
    for name in copied:
        shutil.copyfile(source / name, Path(directory) / name)
    return copied


def vision_linears(model: torch.nn.Module) -> list[str]:
    """The full names of the linear layers of ``model``'s vision tower and projector (:data:`VISION_MODULES`), in
    module order: ``--lora-vision``'s LoRA targets."""
    return [name for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and any(part in VISION_MODULES for part in name.split("."))]


def freeze_vision(model: torch.nn.Module) -> int:
    """``--freeze-vision``: the vision tower's and its projector's parameters stop training; returns how many.
    :class:`~xpar_zoo.errors.TrainConfigError` when the model has none."""
    from ..errors import TrainConfigError

    frozen = 0
    for name, p in model.named_parameters():
        if any(part in VISION_MODULES for part in name.split(".")):
            p.requires_grad_(False)
            frozen += 1
    if not frozen:
        raise TrainConfigError(f"--freeze-vision: {type(model).__name__} has no vision tower "
                               f"({', '.join(VISION_MODULES)})")
    return frozen


# ---- the Trainer's collator ------------------------------------------------------------------------------------
class MediaCollator:
    """A ``data_collator`` for transformers' ``Trainer`` (``XparTrainer``, TRL's trainers through the mixin) of
    image–text ``messages`` records: each rendered as :func:`render_media` renders it (images relative to ``base``,
    checked as :func:`check_images` checks them), rows right-padded, labels ``-100`` off the targets, the rows'
    pixel inputs in order. The model computes its own positions (one conversation per row); pass
    ``remove_unused_columns=False`` so that the Trainer keeps the ``messages`` column."""

    def __init__(self, processor, base: str | Path, loss_on: str = "assistant", max_pixels: int | None = None,
                 min_pixels: int | None = None, allow_absolute_paths: bool = False):
        self.processor, self.base, self.loss_on = processor, Path(base), loss_on
        self.settings = images_kwargs(max_pixels, min_pixels)
        self.allow_absolute = allow_absolute_paths

    def __call__(self, records: list[dict]) -> dict[str, torch.Tensor]:
        from ..loss.global_batch import IGNORE_INDEX
        from .chat import to_example

        examples = check_images([to_example(f"record {i}", dict(r)) for i, r in enumerate(records)], self.base,
                                self.allow_absolute, has_video_processor(self.processor))
        rendered = [render_media(self.processor, ex, self.loss_on, self.settings) for ex in examples]
        width = max(len(ids) for ids, _, _ in rendered)
        pad = pad_token_id(self.processor.tokenizer)
        out = {"input_ids": torch.full((len(rendered), width), pad, dtype=torch.int64),
               "attention_mask": torch.zeros(len(rendered), width, dtype=torch.int64),
               "labels": torch.full((len(rendered), width), IGNORE_INDEX, dtype=torch.int64)}
        for key in dict.fromkeys(k for _, _, m in rendered for k in m if k in TOKEN_INPUTS):
            out[key] = torch.zeros(len(rendered), width, dtype=torch.int64)
        for r, (ids, mask, media) in enumerate(rendered):
            n = len(ids)
            out["input_ids"][r, :n] = torch.from_numpy(ids)
            out["attention_mask"][r, :n] = 1
            out["labels"][r, :n] = torch.from_numpy(np.where(mask, ids, IGNORE_INDEX))
            for key in TOKEN_INPUTS:
                if key in media:
                    out[key][r, :n] = media[key]
        held = [m for _, _, m in rendered]
        for key in dict.fromkeys(k for m in held for k in m if k not in TOKEN_INPUTS):
            out[key] = _stack([m[key] for m in held if key in m], -1 if key.endswith("position_ids") else 0)
        return out
