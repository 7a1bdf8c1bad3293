"""What a training run reports: ``OUTPUT/metrics.jsonl`` (one JSON object per optimizer step), plain lines and,
when ``tensorboard`` is installed, TensorBoard events in ``OUTPUT/tensorboard``. Rank 0 writes; the numbers are
global (reduced over the ranks by the loop).

Fields of every line: ``step``, ``loss`` (the mean over every valid target of the step, all ranks and
micro-batches), ``grad_norm`` (before clipping), ``lr`` (the step's), ``tokens`` (input tokens of the step over all
ranks), ``targets`` (valid targets: the loss's normaliser), ``tokens_per_s``, ``step_time_s``, ``peak_mem_bytes``
(the largest over the ranks: CUDA peak allocated during the step, on the CPU the process's peak RSS),
``data_position`` (global rows consumed after the step), ``epoch``; ``target_tokens`` (= ``targets``: over one
epoch of conversation data their sum is the data's target tokens); with ``--eval-data``, at evaluation steps,
``eval_loss``, ``eval_targets``, ``eval_time_s`` (TensorBoard: ``eval/…``); ``aux_loss`` with a router auxiliary loss; and
for MoE models ``expert_load``: per layer ``{"layer", "tokens": [per expert, global], "max_over_mean"}``.

The file is only ever appended to. Every run (a resume included) first appends ``{"event": "start", "step": S,
"time": …}``: its lines supersede the lines of steps after ``S`` written before (a run that went past its last
checkpoint before it stopped). :func:`read_metrics` returns the lines in force, one per step.

With ``lines`` (the command's ``--no-progress``: otherwise :mod:`~xpar_zoo.train.reporting` prints the lines), a
plain line every ``--log-every`` steps and at the last, without terminal control codes.
"""

from __future__ import annotations

import json
import os
import resource
import time
from pathlib import Path
from typing import Any

import torch

METRICS_FILE = "metrics.jsonl"


def peak_memory_bytes(device: torch.device) -> int:
    """This process's peak memory of the step: CUDA peak allocated since the last call (then reset), or the
    process's peak resident set on the CPU."""
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        return int(peak)
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # KiB on Linux


def read_metrics(output: str | os.PathLike) -> list[dict[str, Any]]:
    """The lines of ``OUTPUT/metrics.jsonl`` in force, one per step (see the module docstring)."""
    path = Path(output) / METRICS_FILE
    if not path.is_file():
        return []
    lines: list[dict[str, Any]] = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        record = json.loads(line)
        if "event" in record:
            if record["event"] == "start":
                lines = [r for r in lines if r["step"] <= record["step"]]
            continue
        lines.append(record)
    return lines


def step_line(record: dict[str, Any], total: int) -> str:
    """One plain line for a step (no terminal control codes)."""
    return (f"step {record['step']}/{total}  loss {record['loss']:.4f}  lr {record['lr']:.3g}  grad_norm "
            f"{record['grad_norm']:.3g}  {record['tokens_per_s']:.0f} tok/s  {record['step_time_s']:.2f} s/step")


class MetricsLog:
    """Rank 0's sinks for the per-step metrics; on other ranks every method does nothing."""

    def __init__(self, output: Path, *, active: bool, start_step: int, total_steps: int, tensorboard: bool,
                 log_every: int = 10, lines: bool = True):
        self.active, self.lines = active, lines
        self.path = output / METRICS_FILE
        self.total_steps, self.log_every = total_steps, log_every
        self._tb = None
        if not active:
            return
        with open(self.path, "a") as f:  # appended, never truncated: see the module docstring
            f.write(json.dumps({"event": "start", "step": start_step, "time": time.time()}) + "\n")
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ModuleNotFoundError:  # tensorboard is optional: pip install 'xpar_zoo[tensorboard]'
                pass
            else:
                self._tb = SummaryWriter(str(output / "tensorboard"), purge_step=start_step + 1)

    def write(self, record: dict[str, Any]) -> None:
        if not self.active:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.lines and (record["step"] % self.log_every == 0 or record["step"] == self.total_steps):
            print(step_line(record, self.total_steps), flush=True)
        if self._tb is not None:
            step = record["step"]
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    tag = f"eval/{key[5:]}" if key.startswith("eval_") else f"train/{key}"
                    self._tb.add_scalar(tag, value, step)
            for layer in record.get("expert_load", ()):
                self._tb.add_scalar(f"expert_load/max_over_mean/layer_{layer['layer']}", layer["max_over_mean"], step)

    def message(self, text: str) -> None:
        if not self.active:
            return
        print(text, flush=True)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
