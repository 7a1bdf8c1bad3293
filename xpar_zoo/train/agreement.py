"""Settings that must agree: across the ranks of a run (checked at start, before anything is loaded: ranks given
different ``--steps`` would otherwise hang until the process-group timeout, different ``--lr`` or ``--data`` train
without a word), and between a checkpoint and the run that resumes it (each changed setting applies with a logged
line, or is refused with the reason: never silently ignored; docs/training.md lists which)."""

from __future__ import annotations

import json
import os
from typing import Any

from ..errors import TrainConfigError
from ..parallel.distributed import all_gather, is_distributed
from .config import LAUNCHER_FLAGS, TrainConfig

# A resumed run may not change these: the checkpoint's data position would not mean the same rows.
RESUME_REFUSED = {
    "data": "the data position counts rows of the checkpoint's data",
    "text_field": "the data position counts rows of the checkpoint's documents",
    "tokenizer": "the data position counts rows of the checkpoint's tokens",
    "seq_len": "the data position counts rows of the checkpoint's row length",
    "seed": "the data order of every epoch follows the seed",
    "loss_on": "the checkpoint's steps trained on other targets of the same rows",
    "truncate": "the data position counts rows of the checkpoint's truncated conversations",
    "lora_rank": "the checkpoint holds adapters of its own rank",
    "lora_targets": "the checkpoint holds adapters of its own target modules",
    "lora_experts": "the checkpoint holds (or lacks) adapters of the experts",
    "lora_vision": "the checkpoint holds (or lacks) adapters of the vision tower",
}
# Settings naming a local file or directory: another spelling of the same path is no change.
PATH_SETTINGS = {"data", "tokenizer", "model"}
# Settings of this job only (where to write, how to report, when to stop): they apply without a word.
PER_JOB = {"output", "resume", "stop_after", "force", "progress", "tensorboard", "log_every", "export_hf",
           "export_adapter", "timeout_minutes", "save_every", "keep_last", "max_line_bytes", "eval_data", "eval_every",
           "eval_batches", "save_best", "report_to", "adapter", "epochs", *LAUNCHER_FLAGS}


def _show(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, dict):
        return ",".join(f"{k}={v}" for k, v in value.items()) or "none"
    if isinstance(value, (list, tuple)):
        return ",".join(_show(v) for v in value)
    return str(value)


def _ranks(ranks: list[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def differences(values: list[Any], what: str) -> str | None:
    """``what: A on ranks 0, 2; B on rank 1`` when the ranks' ``values`` differ, else ``None``."""
    by_value: dict[str, list[int]] = {}
    for r, v in enumerate(values):
        by_value.setdefault(json.dumps(v, sort_keys=True, default=str), []).append(r)
    if len(by_value) == 1:
        return None
    return f"{what}: " + "; ".join(f"{_show(json.loads(v))} on {_ranks(rs)}" for v, rs in by_value.items())


def check_same_settings(cfg: TrainConfig, **resolved: Any) -> None:
    """Raise :class:`TrainConfigError` on every rank, one line naming each setting and the ranks, when the ranks
    were given different settings (every field of ``cfg``, and ``resolved`` values such as the data fingerprint). A
    collective; in one process it checks nothing."""
    if not is_distributed():
        return
    mine = {**cfg.to_json(), **resolved}
    every = all_gather(mine)
    lines = [d for name in mine if (d := differences([s.get(name) for s in every], name))]
    if lines:
        raise TrainConfigError("ranks were given different settings: " + " | ".join(lines)
                               + " (give every rank the same flags and files)")


def _same_path(name: str, old: Any, new: Any) -> bool:
    """Whether ``old`` and ``new`` name the same existing file or directory (``data.jsonl`` and its absolute path)."""
    if name not in PATH_SETTINGS or not isinstance(old, str) or not isinstance(new, str):
        return False
    try:
        return os.path.samefile(old, new)
    except OSError:  # either is missing (or a hub id): compared as given
        return False


def resume_changes(saved: dict[str, Any], cfg: TrainConfig, step: int) -> list[str]:
    """The settings ``cfg`` changes from the checkpoint's (``saved``, at ``step``), one line each ("lr 0.003 →
    0.05 from step 5"); :class:`TrainConfigError` when one cannot change (the reason given)."""
    now = cfg.to_json()
    lines = []
    for name, value in now.items():
        if name in PER_JOB or name not in saved or (name == "steps" and value is None):  # --epochs: known later
            continue
        old = saved[name]
        if json.dumps(old, sort_keys=True) == json.dumps(value, sort_keys=True) or _same_path(name, old, value):
            continue
        if name in RESUME_REFUSED:
            raise TrainConfigError(f"--resume: {name} was {_show(old)} at step {step}, now {_show(value)}: cannot "
                                   f"change on resume ({RESUME_REFUSED[name]}); start a new --output to change it")
        lines.append(f"{name} {_show(old)} → {_show(value)} from step {step + 1}")
    if now.get("steps") is not None and now["steps"] < step:  # --epochs: steps are known once the data is read
        raise TrainConfigError(f"--resume: the checkpoint is at step {step}, past --steps {now['steps']}")
    return lines
