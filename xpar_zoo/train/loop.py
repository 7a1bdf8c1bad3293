"""``train(config)``: the training run behind ``xpar-zoo train``. Before step 1 it reads its inputs
(:mod:`.inputs`) and builds the model and the components (:mod:`.load`); then the loop, which calls the components:
the optimizer and schedule (:mod:`.optim`), the router auxiliary loss (:mod:`.router_loss`), the evaluator
(:mod:`.evaluate`) and the checkpointer (:mod:`.checkpointer`), each deciding itself when it is due; after the last
step, the exports (:mod:`.export`).

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

import datetime
import math
import signal
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..compat import attn_implementation
from ..environment import launcher_local_rank, launcher_world_size
from ..errors import counted
from ..loss.balance import load_summary, update_correction_biases
from ..loss.global_batch import count_targets, global_count
from ..parallel.clip import clip_grad_norm_
from ..styles.encoders import document_positions
from ..styles.sequence import ATTENTION_PREFIX
from . import sft_config
from .agreement import check_same_settings
from .config import TrainConfig
from .data import flatten_rows, micro_batches, rows_per_step
from .export import export_outputs
from .inputs import Inputs, read_inputs
from .load import Run, build_run
from .metrics import MetricsLog, peak_memory_bytes
from .outputs import removed_if_refused
from .reporting import Reporter
from .stop import StopAtOnce, StopOnSignal, Stopped

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
    if dist.is_initialized() or launcher_world_size() <= 1:
        return False
    timeout = datetime.timedelta(minutes=timeout_minutes)
    if torch.cuda.is_available():
        torch.cuda.set_device(launcher_local_rank(0))
        dist.init_process_group("cpu:gloo,cuda:nccl", timeout=timeout)
    else:
        dist.init_process_group("gloo", timeout=timeout)
    return True


def _forward_backward(run: Run, batches: list[dict[str, torch.Tensor]], n_items: torch.Tensor
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


def optimizer_step(run: Run, position: int) -> dict[str, Any]:
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


def _announce(log: MetricsLog, *, run: Run, inputs: Inputs, mesh, step: int) -> None:
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


def _run_steps(run: Run, *, log: MetricsLog, report: Reporter, step: int, position: int
               ) -> tuple[int, dict | None]:
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
    with (StopAtOnce(rank, "before step 1 (reading the data, loading the model)", cfg.output),
          removed_if_refused(cfg, active=rank == 0)):
        inputs = read_inputs(cfg, world=world)
        cfg, output = inputs.cfg, Path(inputs.cfg.output)
        run, mesh, step, position = build_run(inputs, device=device, rank=rank, world=world)
    sinks = sft_config.reporters(cfg)
    log = MetricsLog(output, active=rank == 0, start_step=step, total_steps=cfg.steps,
                     tensorboard="tensorboard" in sinks, log_every=cfg.log_every,
                     lines=not cfg.progress)  # with --progress the Reporter's line per step says it
    report = Reporter(cfg, output, active=rank == 0, start_step=step, total_steps=cfg.steps, wandb="wandb" in sinks)
    run.checkpointer.say = log.message
    if cfg.eval_data:
        run.checkpointer.read_best(step)
    _announce(log, run=run, inputs=inputs, mesh=mesh, step=step)
    record = None
    try:
        step, record = _run_steps(run, log=log, report=report, step=step, position=position)
        if step == cfg.steps:
            with StopAtOnce(rank, "while exporting (nothing exported: the unfinished export is removed)", output):
                export_outputs(cfg, model=run.model, tokenizer=inputs.tokenizer, rank=rank, log=log)
    finally:
        run.load.remove()
        log.close()
        report.close()
    return TrainResult(model=run.model, step=step, last=record, output=output)
