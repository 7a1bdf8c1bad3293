"""What a run shows besides ``metrics.jsonl`` (rank 0): a one-line summary of a step on the console (a progress bar,
the loss, the learning rate, throughput, eval_loss and an ETA) every ``--log-every`` steps (``1``: every step), at
each evaluation and at the last step, with ``--progress`` (the default; ``--no-progress``: the shorter lines of
:class:`~xpar_zoo.train.metrics.MetricsLog`), plain text on a terminal or not; and Weights & Biases (``--report-to
wandb``; ``WANDB_MODE=offline`` works without a network; project from ``WANDB_PROJECT``, default ``xpar-zoo``).
TensorBoard events are written by :class:`~xpar_zoo.train.metrics.MetricsLog`."""

from __future__ import annotations

import datetime
import os
import time
from pathlib import Path
from typing import Any

BAR_WIDTH = 20


def progress_bar(done: int, total: int, width: int = BAR_WIDTH) -> str:
    """``[#########-----------]`` for ``done`` of ``total``."""
    filled = int(width * done / total) if total else width
    return "[" + "#" * filled + "-" * (width - filled) + "]"


def eta(seconds: float) -> str:
    return str(datetime.timedelta(seconds=int(round(max(seconds, 0.0)))))


def step_line(record: dict[str, Any], total: int, elapsed_s: float, steps_done: int) -> str:
    """The console summary of one step: ``step 12/100 [##------] 12% loss 2.3104 lr 1.00e-04 5.1k tok/s
    0.41 s/step ETA 0:00:36``; ``elapsed_s`` over ``steps_done`` steps of this process give the ETA."""
    step = record["step"]
    per_step = elapsed_s / steps_done if steps_done else record["step_time_s"]
    text = (f"step {step:>{len(str(total))}}/{total} {progress_bar(step, total)} {100 * step / total:3.0f}% "
            f"loss {record['loss']:.4f} lr {record['lr']:.2e} {record['tokens_per_s'] / 1e3:.1f}k tok/s "
            f"{record['step_time_s']:.2f} s/step")
    if "eval_loss" in record:
        text += f" eval_loss {record['eval_loss']:.4f}"
    return text + f" ETA {eta(per_step * (total - step))}"


class Reporter:
    """Rank 0: the console lines and the wandb run; on other ranks (``active=False``) every method does nothing."""

    def __init__(self, cfg, output: Path, *, active: bool, start_step: int, total_steps: int, wandb: bool):
        self.active, self.total, self.start_step = active, total_steps, start_step
        self.console, self.every = active and cfg.progress, cfg.log_every  # --no-progress: MetricsLog's lines
        self._start = time.perf_counter()
        self._run = None
        if active and wandb:
            import wandb as wb

            self._run = wb.init(project=os.environ.get("WANDB_PROJECT", "xpar-zoo"), dir=str(output),
                                name=Path(output).name, config=cfg.to_json(), resume="allow")

    def line(self, record: dict[str, Any]) -> str | None:
        """The step's console line every ``--log-every`` steps, at evaluations and at the last step (else ``None``)."""
        step = record["step"]
        if not self.console or not (step % self.every == 0 or step == self.total or "eval_loss" in record):
            return None
        return step_line(record, self.total, time.perf_counter() - self._start, record["step"] - self.start_step)

    def write(self, record: dict[str, Any]) -> None:
        if self._run is not None:
            values = {(f"eval/{k[5:]}" if k.startswith("eval_") else f"train/{k}"): v for k, v in record.items()
                      if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
            self._run.log(values, step=record["step"])

    def close(self) -> None:
        if self._run is not None:
            import wandb

            self._run.finish()
            self._run = None
            wandb.teardown()  # the run's records written out (the service flushes and stops)
