"""What ``xpar-zoo train`` reads before the model loads (:func:`read_inputs`): the checkpoint to resume and what
changed since, the model's config and the mesh against it, the data and held-out data (:func:`load_corpus`), the
steps ``--epochs`` reads (:func:`resolve_epochs`); the settings agreed across ranks."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..compat import attn_implementation
from ..errors import DataError, TrainConfigError
from ..parallel.distributed import run_everywhere
from ..styles.encoders import media_refusal
from .agreement import check_same_settings, resume_changes
from .chat import conversation_corpus, has_parts, load_examples, media_parts, pad_token_id
from .checkpointer import check_resumable
from .config import TrainConfig, validate
from .data import (
    PackedCorpus,
    load_tokenizer,
    read_documents,
    rows_per_step,
    tokenize,
)
from .multimodal import (
    images_kwargs,
    is_multimodal,
    load_processor,
    media_corpus,
)
from .outputs import (
    OutputPlan,
    check_finished_resume,
    check_outputs,
)
from .packing import EpochLimit, steps_for_epochs
from .tiny_vl import resolve_model


@dataclass(kw_only=True)
class Inputs:
    """What a run reads before the model loads: the settings as resolved, the data, the checkpoint to resume."""

    cfg: TrainConfig
    model_config: Any
    corpus: PackedCorpus
    tokenizer: Any
    eval_corpus: Any
    ckpt: Path | None
    changes: list[str]


def read_inputs(cfg: TrainConfig, *, world: int) -> Inputs:
    """Every check and read that comes before the model loads: the checkpoint to resume and what changed since, the
    model's config and the mesh against it, the data (and held-out data), the settings agreed across ranks."""
    output = Path(cfg.output)
    plan, changes = run_everywhere(lambda: _checkpoint_to_resume(cfg), rank0_only=True)
    ckpt = plan.resume_from
    cfg = dataclasses.replace(cfg, model=run_everywhere(lambda: resolve_model(cfg.model, output), rank0_only=True))
    model_config = run_everywhere(lambda: read_model_config(cfg.model))
    run_everywhere(lambda: check_mesh(cfg, model_config, world), rank0_only=True)
    corpus, tokenizer = run_everywhere(lambda: load_corpus(cfg, text_vocab_size(model_config),
                                                           model_config=model_config))
    cfg, corpus = run_everywhere(lambda: resolve_epochs(cfg, corpus, tokenizer, world))
    run_everywhere(lambda: check_finished_resume(plan, cfg.steps, cfg), rank0_only=True)
    check_same_settings(cfg, data_fingerprint=corpus.fingerprint())  # also proves the fingerprint can be saved
    eval_corpus = None
    if cfg.eval_data:
        eval_corpus = run_everywhere(lambda: load_corpus(cfg, text_vocab_size(model_config), cfg.eval_data,
                                                                  model_config=model_config)[0])
    if ckpt is not None:
        run_everywhere(lambda: check_resumable(ckpt, corpus), rank0_only=True)
    run_everywhere(plan.apply, rank0_only=True)  # --force over a run: only now that every input is checked
    return Inputs(cfg=cfg, model_config=model_config, corpus=corpus, tokenizer=tokenizer, eval_corpus=eval_corpus,
                  ckpt=ckpt, changes=changes)


def _checkpoint_to_resume(cfg: TrainConfig) -> tuple[OutputPlan, list[str]]:
    """Rank 0, before anything is loaded: every output checked (:func:`~xpar_zoo.train.outputs.check_outputs`):
    what the run does with ``--output`` (its ``resume_from``: ``None`` starts at step 0) and the settings this run
    changes from the checkpoint (one line each; refused ones raise). Each line of the plan (a newer checkpoint
    skipped and why, what ``--force`` replaces) is said here."""
    plan = check_outputs(cfg)
    for line in plan.describe():
        if plan.resume_from is None or not line.startswith("--resume"):  # the opening line says where it resumes
            print(line, flush=True)
    if plan.resume_from is None:
        return plan, []
    changes = resume_changes(plan.saved, cfg, plan.step)
    check_finished_resume(plan, cfg.steps, cfg)  # (None with --epochs: checked once the data gives the steps)
    return plan, changes


def load_corpus(cfg: TrainConfig, vocab_size: int, path: str | None = None, model_config=None
                ) -> tuple[PackedCorpus, Any]:
    """Every rank: read, tokenize and pack the data (``path``, default ``cfg.data``); the tokenizer (``None`` for
    pre-tokenized data without one). Conversations (``messages``, ``prompt``/``completion``) are packed whole
    (:mod:`xpar_zoo.train.chat`, :mod:`xpar_zoo.train.packing`); for a multimodal model, conversations whose
    content has parts (images) are rendered by its processor (:mod:`xpar_zoo.train.multimodal`)."""
    path = path or cfg.data
    conversations = load_examples(path)
    if conversations is not None and is_multimodal(model_config) and any(map(has_parts, conversations[1])):
        refused = media_refusal(model_config, {p["type"] for ex in conversations[1] for p in media_parts(ex)})
        if refused:
            raise DataError(f"{path}: {refused}")
        processor = load_processor(cfg.tokenizer or cfg.model, model_config)
        corpus = media_corpus(Path(path), *conversations, processor, loss_on=cfg.loss_on, seq_len=cfg.seq_len,
                              seed=cfg.seed, vocab_size=vocab_size, allow_absolute=cfg.allow_absolute_paths,
                              settings=images_kwargs(cfg.max_pixels, cfg.min_pixels))
        return corpus, processor.tokenizer
    if conversations is not None:
        tokenizer = load_tokenizer(cfg.tokenizer or cfg.model)
        return conversation_corpus(path, *conversations, tokenizer, loss_on=cfg.loss_on, seq_len=cfg.seq_len,
                                   seed=cfg.seed, truncate=cfg.truncate, vocab_size=vocab_size), tokenizer
    if cfg.loss_on not in (None, "all") or cfg.truncate is not None:
        raise DataError(f"{path}: --loss-on / --truncate apply to conversations ('messages' or 'prompt'/'completion' "
                        "records); plain text trains on every token and is cut into rows")
    docs = read_documents(path, cfg.text_field, cfg.max_line_bytes)
    tokenizer = None
    if docs.texts is not None or cfg.tokenizer:
        tokenizer = load_tokenizer(cfg.tokenizer or cfg.model)
    tokens, lengths = tokenize(docs, tokenizer)
    if len(tokens) and int(tokens.max()) >= vocab_size:
        raise DataError(f"{path}: token id {int(tokens.max())} is outside the model's vocabulary "
                               f"({vocab_size} rows); use the model's tokenizer")
    return PackedCorpus(tokens, lengths, cfg.seq_len, cfg.seed, source=str(path)), tokenizer


def data_parts(cfg: TrainConfig, world: int) -> int:
    """How many equal parts each step's global batch is read in: one per sequence group of ``sp·cp`` ranks
    (``world`` without sp/cp; the ``count`` of :func:`xpar_zoo.data_shard` once the model is loaded)."""
    return world // (cfg.mesh.get("sp", 1) * cfg.mesh.get("cp", 1))


def resolve_epochs(cfg: TrainConfig, corpus, tokenizer, world: int) -> tuple[TrainConfig, Any]:
    """``--epochs N``: the settings with the steps that read N epochs, and the corpus read for N epochs only (the
    last step's rows past the end are padding). Otherwise both as they are."""
    if cfg.epochs is None:
        return cfg, corpus
    per_step = rows_per_step(data_parts(cfg, world), cfg.micro_batch, cfg.grad_accum)
    steps = steps_for_epochs(cfg.epochs, corpus.rows_per_epoch, per_step)
    cfg = dataclasses.replace(cfg, steps=steps)
    try:
        validate(dataclasses.replace(cfg, epochs=None))
    except TrainConfigError as e:
        raise TrainConfigError(f"--epochs {cfg.epochs} is {steps} steps of {corpus.rows_per_epoch} rows per epoch: "
                               f"{e}") from None
    return cfg, EpochLimit(corpus, cfg.epochs, pad_token_id(tokenizer) if tokenizer is not None else 0)


def text_vocab_size(config) -> int:
    """The language model's vocabulary: a multimodal config keeps it in its text config."""
    return int(config.get_text_config().vocab_size)


def read_model_config(name: str):
    """The transformers config of ``name`` (a hub id or a directory), read without any weight."""
    from ..hub.resolve import resolve_config
    from ..loader import load_config

    return load_config(resolve_config(name).parent)


def check_mesh(cfg: TrainConfig, model_config, world: int) -> None:
    """Before the model loads: the mesh's plan names are the model's plans, and its sizes fit the world (on one
    process, said as such: start ranks, or train without the mesh); with ``sp``/``cp``, the model, its attention
    and ``--seq-len`` can be split (:func:`xpar_zoo.sizing.check_long_context`)."""
    from ..errors import MeshError
    from ..parallel.mesh import validate_sequence_sizes, validate_sizes
    from ..sizing import check_long_context
    from ..styles.planned import check_plan_names
    from ..zoo.registry import get_plan

    sizes = dict(cfg.mesh)
    replicate = sizes.pop("replicate", 1)
    sp, cp = sizes.pop("sp", 1), sizes.pop("cp", 1)
    check_plan_names([n for n, size in sizes.items() if size > 1], get_plan(model_config.model_type, model_config))
    try:
        validate_sizes(world, sizes, replicate)
        validate_sequence_sizes(world, replicate, sp, cp)
    except MeshError as e:
        if world > 1:
            raise
        need = max([replicate, *sizes.values()])
        raise MeshError(f"--mesh {','.join(f'{k}={v}' for k, v in cfg.mesh.items())} needs several ranks, and this "
                        f"is one process ({e}): start {need} or more with --nproc-per-node (or torchrun), or pass "
                        "--mesh none to train on one process") from None
    if sp * cp > 1:  # the sizer's rules (heads, attention, mixing sp/cp cannot gather, --seq-len), before the load
        attention = cfg.attn_implementation or attn_implementation(model_config) or "sdpa"
        check_long_context(model_config, world, replicate, cfg.seq_len, sp, cp, attention)
