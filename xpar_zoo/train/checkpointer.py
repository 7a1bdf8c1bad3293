"""Checkpoints of ``xpar-zoo train``: the :class:`Checkpointer` the loop hands each finished step, which decides
itself what to save (every ``--save-every`` steps, the last step and a stop by signal under ``checkpoints/``, keeping
``--keep-last``; with ``--save-best`` the lowest ``eval_loss`` so far under ``best/``), and resuming: the saved
state checked against this run's data before the model loads, then loaded with this run's optimizer settings.

A checkpoint's ``extra_state`` holds the step, the data position (with the fingerprint of the rows it counts), the
schedule, the world size and the settings."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ..checkpoint import EXTRA_FILE, load_checkpoint, save_checkpoint
from ..checkpoint.layout import complete_record
from ..errors import TrainConfigError
from ..io.integrity import verify_files
from .config import TrainConfig
from .data import PackedCorpus
from .lora import is_lora
from .metrics import read_metrics
from .optim import apply_optimizer_settings
from .outputs import BEST, CHECKPOINTS


class Checkpointer:
    """Saves the run's checkpoints when they are due (:meth:`after_step`) and resumes from one (:meth:`load`);
    ``say`` gets rank 0's line for each save."""

    def __init__(self, cfg: TrainConfig, corpus: PackedCorpus, say: Callable[[str], None] = print):
        self.cfg, self.corpus, self.say = cfg, corpus, say
        self.best = math.inf  # the lowest eval_loss saved under best/ (a resumed run: read_best)

    def read_best(self, step: int) -> None:
        """Every rank: the lowest ``eval_loss`` up to ``step`` a resumed run logged (rank 0 reads it)."""
        from ..parallel.distributed import run_everywhere

        self.best = run_everywhere(lambda: best_eval_loss(Path(self.cfg.output), step), rank0_only=True)

    def after_step(self, run: Any, record: dict, *, stopping: bool = False) -> None:
        """Every rank, after step ``record["step"]`` is logged: the best checkpoint when its ``eval_loss`` is the
        lowest so far (``--save-best``), the periodic one every ``--save-every`` steps, on the run's last step
        (``--stop-after`` or ``--steps``) and when a signal is ``stopping`` the run."""
        cfg, step, position = self.cfg, record["step"], record["data_position"]
        final = stopping or step == (cfg.stop_after or cfg.steps)
        if cfg.save_best and "eval_loss" in record and record["eval_loss"] < self.best:
            self.best = record["eval_loss"]
            path = self.save(run, step, position, root=Path(cfg.output) / BEST, keep_last=1)
            self.say(f"step {step}: eval_loss {self.best:.4f}, the lowest so far: saved {path}")
        if final or (cfg.save_every and step % cfg.save_every == 0):
            path = self.save(run, step, position)  # every rank
            self.say(f"step {step}: saved {path}")

    def save(self, run: Any, step: int, position: int, root: Path | None = None, keep_last: int | None = None
             ) -> Path:
        """The run's model, optimizer and extra state at ``step`` (data ``position``) under ``root`` (default
        ``checkpoints/``). A collective."""
        cfg, corpus, model = self.cfg, self.corpus, run.model
        extra = {
            "step": step,
            "data": {"position": position, "fingerprint": corpus.fingerprint(), "rows_per_epoch": corpus.rows_per_epoch,
                     "seq_len": corpus.seq_len, "seed": corpus.seed, "source": corpus.source},
            "scheduler": run.scheduler.state_dict(),
            "world_size": dist.get_world_size(),
            "config": cfg.to_json(),
        }
        return save_checkpoint(root or Path(cfg.output) / CHECKPOINTS, model, run.optimizer, extra_state=extra,
                               step=step, keep_last=keep_last or cfg.keep_last, trainable_only=is_lora(model))

    def load(self, ckpt: Path, model, optimizer) -> tuple[int, int]:
        """Resume from ``ckpt``: the model and optimizer loaded (with this run's optimizer settings); returns the
        step and the data position it continues from. A collective."""
        extra = load_checkpoint(ckpt, model, optimizer, trainable_only=is_lora(model))
        apply_optimizer_settings(optimizer, self.cfg)
        return int(extra["step"]), int(extra["data"]["position"])


def best_eval_loss(output: Path, step: int) -> float:
    """Rank 0: the lowest ``eval_loss`` in ``metrics.jsonl`` up to ``step`` (a resumed ``--save-best`` run)."""
    seen = [m["eval_loss"] for m in read_metrics(output) if m.get("step", 0) <= step and "eval_loss" in m]
    return min(seen, default=math.inf)


def check_resumable(ckpt: Path, corpus: PackedCorpus) -> None:
    """Rank 0, before the model is loaded: the checkpoint's data position means the same rows for this run. A
    saved state that fails its checksum is named as damage; a real difference names only what differs."""
    damage = verify_files(ckpt, *_recorded(ckpt, EXTRA_FILE))
    if damage:
        raise TrainConfigError(f"{ckpt} is damaged ({damage[0]}): move it aside to resume from the checkpoint "
                               "before it")
    data = json.loads((ckpt / EXTRA_FILE).read_text()).get("data") or {}
    if data.get("fingerprint") == corpus.fingerprint():
        return
    ours = {"source": corpus.source, "seq_len": corpus.seq_len, "seed": corpus.seed,
            "rows_per_epoch": corpus.rows_per_epoch}
    differ = [f"{k} {data.get(k)!r} then, {v!r} now" for k, v in ours.items() if data.get(k) != v]
    what = "; ".join(differ) if differ else f"the tokens of {corpus.source} changed since"
    raise TrainConfigError(f"{ckpt} was trained on other data ({what}): its data position would not continue the "
                           "same order; resume with the same data, seq_len and seed, or start a new --output")


def _recorded(ckpt: Path, name: str) -> tuple[dict[str, str], dict[str, int]]:
    """The checksum and size the checkpoint's COMPLETE marker records for file ``name`` (empty when none)."""
    try:
        record = complete_record(ckpt)
        return {name: record["checksums"][name]}, {name: record["files"][name]}
    except (OSError, ValueError, KeyError, TypeError):
        return {}, {}
