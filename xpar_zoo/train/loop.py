"""``train(config)``: the training run behind ``xpar-zoo train``: setup, then the loop, which calls its components:
the optimizer and schedule (:mod:`.optim`), the router auxiliary loss (:mod:`.router_loss`), the evaluator
(:mod:`.evaluate`) and the checkpointer (:mod:`.checkpointer`), each deciding itself when it is due.

One optimizer step on every rank:

1. take this rank's ``grad_accum`` micro-batches of the step (:mod:`xpar_zoo.train.data`) and count the valid
   targets of all of them over every rank (:func:`xpar_zoo.loss.global_batch.global_count`, one all-reduce);
   with ``sp``/``cp`` the ranks of a sequence group read the same full-length rows (part ``index`` of ``count``,
   :func:`xpar_zoo.data_shard`) and the model keeps each rank's tokens, so rows, tokens and targets are counted
   once per sequence group (by its first rank), never once per rank;
2. forward and backward each micro-batch with ``num_items_in_batch`` = that count, so the accumulated gradients
   are exactly those of the step's global-batch mean; FSDP reduce-scatters only after the last micro-batch
   (``set_requires_gradient_sync``); with a router auxiliary loss, each micro-batch adds its global-batch share;
3. :func:`xpar_zoo.clip_grad_norm_`, AdamW, the LR schedule; the correction-bias update from the step's global
   expert load; metrics; the evaluation and the checkpoints that are due (model, optimizer, schedule, data
   position, RNG).
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import os
import signal
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..compat import attn_implementation, flash_attention_available
from ..errors import DataError, TrainConfigError, counted
from ..loss.balance import (
    ExpertLoad,
    correction_biases,
    load_summary,
    update_correction_biases,
)
from ..loss.global_batch import count_targets, global_count
from ..parallel.clip import clip_grad_norm_
from ..parallel.distributed import run_everywhere
from ..styles.encoders import document_positions
from ..styles.sequence import ATTENTION_PREFIX, data_shard, set_inner_attention
from . import sft_config
from .agreement import check_same_settings, resume_changes
from .chat import conversation_corpus, has_parts, load_examples, pad_token_id
from .checkpointer import Checkpointer, check_resumable
from .config import DTYPES, TrainConfig, parallel_options, validate
from .data import (
    PackedCorpus,
    flatten_rows,
    load_tokenizer,
    micro_batches,
    read_documents,
    rows_per_step,
    tokenize,
)
from .evaluate import Evaluator
from .lora import export_adapter, export_merged, from_pretrained_kwargs, is_lora
from .metrics import MetricsLog, peak_memory_bytes
from .multimodal import (
    copy_processor_files,
    freeze_vision,
    images_kwargs,
    is_multimodal,
    load_processor,
    media_corpus,
)
from .optim import build_optimizer, build_scheduler
from .outputs import (
    ExportTarget,
    OutputPlan,
    check_finished_resume,
    check_outputs,
)
from .packing import EpochLimit, steps_for_epochs
from .reporting import Reporter
from .router_loss import RouterAux, router_aux
from .stop import StopAtOnce, StopOnSignal, Stopped
from .tiny_vl import resolve_model

# transformers' masking utilities build a block-causal mask from restarting position_ids for these (no attention
# mask, no cache); its flash-attention kernels run packed rows as varlen from position_ids in a batch of one row.
DOCUMENT_MASKING = ("eager", "sdpa", "flex_attention")


@dataclass
class TrainResult:
    """What a run leaves in memory (for tests and notebooks): the model, the last step, its metrics."""

    model: nn.Module
    step: int
    last: dict[str, Any] | None
    output: Path


def init_distributed(timeout_minutes: float = 30.0) -> bool:
    """Initialise the default process group from a launcher's environment (torchrun: ``WORLD_SIZE`` > 1) when none
    exists: NCCL on this node's CUDA device ``LOCAL_RANK`` (gloo beside it for CPU objects), gloo without CUDA.
    Returns whether it initialised one."""
    if dist.is_initialized() or int(os.environ.get("WORLD_SIZE", "1") or 1) <= 1:
        return False
    timeout = datetime.timedelta(minutes=timeout_minutes)
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("cpu:gloo,cuda:nccl", timeout=timeout)
    else:
        dist.init_process_group("gloo", timeout=timeout)
    return True


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


def _model_config(name: str):
    from ..hub.resolve import resolve_config
    from ..loader import load_config

    return load_config(resolve_config(name).parent)


@dataclass(kw_only=True)
class _Run:
    """What every step of a run uses: the model and its components (optimizer and schedule, router loss, expert
    load and biases, checkpointer, evaluator), the data, and where this rank stands."""

    cfg: TrainConfig
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    corpus: PackedCorpus
    load: ExpertLoad
    biases: list
    aux: RouterAux | None
    checkpointer: Checkpointer
    evaluator: Evaluator | None = None
    flatten: bool
    device: torch.device
    world: int
    rank: int
    part: int = 0  # this rank's data part (xpar_zoo.data_shard): the ranks of a sequence group read the same rows
    parts: int = 1  # the data parts of a step (world / (sp·cp))
    counts_once: bool = True  # the first rank of its sequence group: counts its group's rows, tokens, targets


def check_attention_here(name: str | None, device_type: str = "cuda") -> None:
    """Raise :class:`TrainConfigError` (one line) when ``--attn-implementation`` cannot train here: flash attention
    on a machine without its kernels, flex_attention on the CPU (torch has no flex backward there). On each rank
    before the model loads (not at parse time: a dry run may plan a GPU run on a machine without them)."""
    if name == "flex_attention" and device_type == "cpu":
        raise TrainConfigError("--attn-implementation flex_attention cannot train on the CPU (torch has no flex "
                               "backward there); use sdpa or eager, or train on a GPU")
    if name in ("flash_attention_2", "flash_attention_3") and not flash_attention_available(name):
        raise TrainConfigError(f"--attn-implementation {name}: no flash-attn kernels on this machine (a GPU with the "
                               "flash-attn package, or transformers' hub kernels); use sdpa or flex_attention")


def _load_model(cfg: TrainConfig, mesh, rank: int, **peft) -> nn.Module:
    """The model from ``cfg.model`` on ``mesh`` (``peft``: ``from_pretrained``'s LoRA arguments), in training mode
    with the run's attention and recompute settings."""
    from ..loader import from_pretrained

    check_attention_here(cfg.attn_implementation, getattr(mesh, "device_type", "cuda"))
    model = from_pretrained(cfg.model, mesh=mesh, dtype=DTYPES.get(cfg.dtype) if cfg.dtype else None,
                            mixed_precision=cfg.mixed_precision, options=parallel_options(cfg),
                            progress=cfg.progress and rank == 0 and sys.stderr.isatty(), **peft)
    if cfg.freeze_vision:
        freeze_vision(model)
    model.train()
    model.config.use_cache = False  # with a cache transformers would not build the packed-document mask
    if cfg.attn_implementation and mesh.sequence_size > 1:
        set_inner_attention(model, cfg.attn_implementation)  # inside the sp/cp attention, not instead of it
    elif cfg.attn_implementation:
        model.set_attn_implementation(cfg.attn_implementation)
    if cfg.recompute:
        model.activation_checkpointing_enable()
    return model


def _forward_backward(run: _Run, batches: list[dict[str, torch.Tensor]], n_items: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Every micro-batch of the step forward and backward; FSDP reduces after the last one only. Returns this
    rank's summed loss shares and mean auxiliary-loss share."""
    loss_sum = torch.zeros((), dtype=torch.float64, device=run.device)
    aux_sum = torch.zeros((), dtype=torch.float64, device=run.device)
    extra = {"output_router_logits": True} if run.aux else {}
    for m, batch in enumerate(batches):
        run.model.set_requires_gradient_sync(m == len(batches) - 1)
        batch = document_positions(run.model, batch)  # a multimodal model's 3-D RoPE, per packed document
        if run.flatten:
            batch = flatten_rows(batch)
        batch = {k: v.to(run.device) for k, v in batch.items()}
        out = run.model(**batch, num_items_in_batch=n_items, use_cache=False, **extra)
        loss = out.loss
        loss_sum += loss.detach().double()
        if run.aux:
            loss, share = run.aux.add(out, loss, len(batches))
            aux_sum += share
        loss.backward()
    return loss_sum, aux_sum


def optimizer_step(run: _Run, position: int) -> dict[str, Any]:
    """One optimizer step on the rows from global row ``position``; returns its metrics (without ``step``)."""
    cfg, device = run.cfg, run.device
    start = time.perf_counter()
    lr = run.scheduler.get_last_lr()[0]
    batches = micro_batches(run.corpus, position, run.part, run.parts, cfg.micro_batch, cfg.grad_accum)
    # full-length rows on every rank of a sequence group: its first rank counts them, once
    local_targets = sum(int(count_targets(b["labels"])) for b in batches) if run.counts_once else 0
    loss_sum, aux_sum = _forward_backward(run, batches, global_count(local_targets, device=device))
    grad_norm = clip_grad_norm_(run.model, cfg.max_grad_norm if cfg.max_grad_norm > 0 else math.inf)
    run.optimizer.step()
    run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    counts = run.load.take()
    if run.biases:
        update_correction_biases(run.biases, counts, cfg.expert_bias_update_rate)
    tokens = sum(b["input_ids"].numel() for b in batches) if run.counts_once else 0
    totals = torch.stack([loss_sum, aux_sum] + [torch.tensor(float(n), dtype=torch.float64, device=device)
                                                for n in (tokens, local_targets)])
    peak = torch.tensor([peak_memory_bytes(device)], dtype=torch.int64, device=device)
    if run.world > 1:
        dist.all_reduce(totals)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    loss, aux, tokens, targets = totals.tolist()
    elapsed = time.perf_counter() - start
    position += rows_per_step(run.parts, cfg.micro_batch, cfg.grad_accum)
    record = {"loss": loss / run.world, "grad_norm": float(grad_norm), "lr": lr, "tokens": int(tokens),
              "target_tokens": int(targets), "tokens_per_s": tokens / elapsed, "step_time_s": elapsed,
              "peak_mem_bytes": int(peak.item()), "data_position": position,
              "epoch": (position - 1) // run.corpus.rows_per_epoch}
    if run.aux:
        record["aux_loss"] = aux / run.world
    if counts is not None:
        record["expert_load"] = load_summary(run.load.layers, counts)
    return record


def _export(cfg: TrainConfig, model: nn.Module, tokenizer, rank: int) -> None:
    """The hub's own format into a staging directory beside ``--export-hf``, moved into place once complete (an
    existing export, with ``--force``, is replaced only then)."""
    target = ExportTarget(Path(cfg.export_hf))
    try:
        if is_lora(model):  # merged weights, W + s·BA
            export_merged(model, target.path)
        else:
            model.save_pretrained(target.path, progress=cfg.progress and sys.stderr.isatty())  # every rank: rank 0 writes
        if rank == 0 and tokenizer is not None:
            tokenizer.save_pretrained(target.path)
        if rank == 0 and is_multimodal(model.config):
            copy_processor_files(cfg.model, target.path)
        target.commit()
    except BaseException:
        target.discard()
        raise


def quiet_other_ranks(rank: int) -> None:
    """Warnings once, not once per rank: on ranks other than 0, transformers' and PEFT's logging shows errors only
    and Python warnings are ignored (every rank runs the same code on the same settings, so rank 0's are all)."""
    if rank == 0:
        return
    import logging

    warnings.simplefilter("ignore")
    for name in ("transformers", "peft", "accelerate", "datasets"):
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except ImportError:  # pragma: no cover - transformers is a dependency
        pass


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


@dataclass
class _Inputs:
    """What a run reads before the model loads: the settings as resolved, the data, the checkpoint to resume."""

    cfg: TrainConfig
    model_config: Any
    corpus: PackedCorpus
    tokenizer: Any
    eval_corpus: Any
    ckpt: Path | None
    changes: list[str]


def _read_inputs(cfg: TrainConfig, world: int) -> _Inputs:
    """Every check and read that comes before the model loads: the checkpoint to resume and what changed since, the
    model's config and the mesh against it, the data (and held-out data), the settings agreed across ranks."""
    output = Path(cfg.output)
    plan, changes = run_everywhere(lambda: _checkpoint_to_resume(cfg), rank0_only=True)
    ckpt = plan.resume_from
    cfg = dataclasses.replace(cfg, model=run_everywhere(lambda: resolve_model(cfg.model, output), rank0_only=True))
    model_config = run_everywhere(lambda: _model_config(cfg.model))
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
    return _Inputs(cfg, model_config, corpus, tokenizer, eval_corpus, ckpt, changes)


def _build_run(inputs: _Inputs, device: torch.device, rank: int, world: int) -> tuple[_Run, Any, int, int]:
    """The parallelized model, its optimizer and schedule (resumed from the checkpoint, if any): the run, its mesh,
    and the step and data position it starts from."""
    from ..parallel.mesh import Mesh

    cfg = inputs.cfg
    sizes = dict(cfg.mesh)
    mesh = Mesh(replicate=sizes.pop("replicate", 1), **sizes)
    peft = from_pretrained_kwargs(cfg, inputs.model_config)
    if peft:
        torch.manual_seed(cfg.seed)  # a new adapter is drawn from --seed (rank 0's RNG)
    model = _load_model(cfg, mesh, rank, **peft)
    attn = attn_implementation(model.config)
    load = ExpertLoad(model, device)
    biases = correction_biases(model, load) if cfg.expert_bias_update_rate else []
    if cfg.expert_bias_update_rate and not biases:
        raise TrainConfigError(f"--expert-bias-update-rate {cfg.expert_bias_update_rate}: {type(model).__name__} "
                               "has no router with an e_score_correction_bias (DeepSeek-V3 / GLM-4-MoE style)")
    optimizer = build_optimizer(model, cfg)
    checkpointer = Checkpointer(cfg, inputs.corpus)
    step, position = checkpointer.load(inputs.ckpt, model, optimizer) if inputs.ckpt is not None else (0, 0)
    part, parts = data_shard(model)
    flatten = attn.startswith("flash_attention")
    evaluator = None
    if cfg.eval_data:
        evaluator = Evaluator(inputs.eval_corpus, world=world, rank=rank, part=part, parts=parts,
                              micro_batch=cfg.micro_batch, max_batches=cfg.eval_batches, flatten=flatten,
                              device=device, pad_id=pad_token_id(inputs.tokenizer), every=cfg.eval_every)
    run = _Run(cfg=cfg, model=model, optimizer=optimizer, scheduler=build_scheduler(optimizer, cfg, step),
               corpus=inputs.corpus, load=load, biases=biases, aux=router_aux(model, cfg), checkpointer=checkpointer,
               evaluator=evaluator, flatten=flatten, device=device, world=world, rank=rank, part=part, parts=parts,
               counts_once=mesh.sequence_rank("sp") == 0 and mesh.sequence_rank("cp") == 0)
    return run, mesh, step, position


def _announce(log: MetricsLog, run: _Run, inputs: _Inputs, mesh, step: int) -> None:
    """Rank 0's opening lines: what trains on which mesh, from where, what changed on resume, the data's summary
    and a note when the attention does not mask packed documents."""
    cfg, model, world, parts = run.cfg, run.model, run.world, run.parts
    group = f" ({counted(parts, 'sequence group')} of {world // parts} ranks)" if parts != world else ""
    log.message(f"xpar-zoo train: {model.config.architectures or [model.config.model_type]} on {mesh}, "
                f"{counted(world, 'rank')}{group} x {counted(cfg.micro_batch, 'row')} x "
                f"{counted(cfg.grad_accum, 'micro-batch', 'micro-batches')} of {cfg.seq_len} tokens per step; "
                f"{run.corpus.num_tokens} tokens, {counted(run.corpus.rows_per_epoch, 'row')} per epoch; "
                + (f"resumed from {inputs.ckpt} at step {step}" if inputs.ckpt else "from step 0"))
    for line in inputs.changes:
        log.message(f"changed on resume: {line}")
    for data in (run.corpus, inputs.eval_corpus):
        if getattr(data, "summary", ""):
            log.message(data.summary)
    if note := packed_documents_note(attn_implementation(model.config), run.flatten):
        log.message(note)


def packed_documents_note(attn: str, flatten: bool) -> str | None:
    """The start's note when attention ``attn`` does not mask packed documents from each other (``None``: it does:
    transformers' :data:`DOCUMENT_MASKING` from the restarting positions, flash on rows flattened into one, and the
    sp/cp attention around any inner one, from the whole rows' positions)."""
    if attn in DOCUMENT_MASKING or flatten or attn.startswith(ATTENTION_PREFIX):
        return None
    return (f"note: attention implementation {attn!r}: packed documents are not masked from each other "
            f"(transformers does so for {', '.join(DOCUMENT_MASKING)} and flash_attention_*)")


def _run_steps(run: _Run, log: MetricsLog, report: Reporter, step: int, position: int) -> tuple[int, dict | None]:
    """Train from ``step`` to the last step: each step's metrics (and the evaluation when due) logged, the
    checkpoints the checkpointer finds due saved; on an agreed SIGINT/SIGTERM, save and raise :class:`Stopped`.
    Returns the last step and its record."""
    last_step = run.cfg.stop_after or run.cfg.steps
    record = None
    with StopOnSignal(announce=log.message, output=run.cfg.output) as stop:
        while step < last_step:
            record = {"step": step + 1, **optimizer_step(run, position)}
            step, position = record["step"], record["data_position"]
            if run.evaluator is not None and run.evaluator.due(step, last_step):
                record.update(run.evaluator(run.model))
                run.load.take()  # the evaluation's tokens are no step's expert load
            log.write(record)
            report.write(record)
            if (line := report.line(record)) is not None:
                log.message(line)
            signum = stop.agreed(run.device)
            run.checkpointer.after_step(run, record, stopping=bool(signum))
            if signum:
                name = signal.Signals(signum).name
                log.message(f"{name}: saved step-{step}; rerun with --resume to continue")
                raise Stopped(signum, f"stopped by {name} after step {step}")
    return step, record


def _export_outputs(cfg: TrainConfig, model: nn.Module, tokenizer, rank: int, log: MetricsLog) -> None:
    """After the last step: the hub-format export (merged under LoRA) and PEFT's adapter files, where asked for."""
    if cfg.export_hf:
        _export(cfg, model, tokenizer, rank)
        log.message(f"exported the {'merged ' if is_lora(model) else ''}model in the hub's format to "
                    f"{cfg.export_hf}")
    if cfg.export_adapter:
        export_adapter(model, cfg.export_adapter, tokenizer, rank, cfg.model)
        log.message(f"exported the LoRA adapter (PEFT's files) to {cfg.export_adapter}")


def train(cfg: TrainConfig) -> TrainResult:
    """Run the training ``cfg`` describes on every rank of the default process group (initialised from the
    launcher's environment when needed; a plain process runs as world 1). A collective: every rank calls it with
    the same settings (checked first). Returns the trained model and the last step's metrics. Raises
    :class:`~xpar_zoo.train.stop.Stopped` after saving when SIGINT or SIGTERM stopped it."""
    from ..parallel.mesh import init_single_process

    if not dist.is_initialized() and not init_distributed(cfg.timeout_minutes):
        init_single_process()
    rank, world = dist.get_rank(), dist.get_world_size()
    quiet_other_ranks(rank)
    check_same_settings(cfg)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    with StopAtOnce(rank, "before step 1 (reading the data, loading the model)", cfg.output):
        inputs = _read_inputs(cfg, world)
        cfg, output = inputs.cfg, Path(inputs.cfg.output)
        run, mesh, step, position = _build_run(inputs, device, rank, world)
    sinks = sft_config.reporters(cfg)
    log = MetricsLog(output, active=rank == 0, start_step=step, total_steps=cfg.steps,
                     tensorboard="tensorboard" in sinks, log_every=cfg.log_every,
                     lines=not cfg.progress)  # with --progress the Reporter's line per step says it
    report = Reporter(cfg, output, active=rank == 0, start_step=step, total_steps=cfg.steps, wandb="wandb" in sinks)
    run.checkpointer.say = log.message
    if cfg.eval_data:
        run.checkpointer.read_best(step)
    _announce(log, run, inputs, mesh, step)
    record = None
    try:
        step, record = _run_steps(run, log, report, step, position)
        if step == cfg.steps:
            with StopAtOnce(rank, "while exporting (nothing exported: the unfinished export is removed)", output):
                _export_outputs(cfg, run.model, inputs.tokenizer, rank, log)
    finally:
        run.load.remove()
        log.close()
        report.close()
    return TrainResult(model=run.model, step=step, last=record, output=output)
