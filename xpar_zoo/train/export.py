"""What ``xpar-zoo train`` writes after its last step (:func:`export_outputs`): the model in the hub's format
(merged under LoRA), written whole or not at all, and PEFT's adapter files."""

from __future__ import annotations

import sys
from pathlib import Path

from torch import nn

from .config import TrainConfig
from .lora import export_adapter, export_merged, is_lora
from .metrics import MetricsLog
from .multimodal import copy_processor_files, is_multimodal
from .outputs import ExportTarget


def export_outputs(cfg: TrainConfig, *, model: nn.Module, tokenizer, rank: int, log: MetricsLog) -> None:
    """After the last step: the hub-format export (merged under LoRA) and PEFT's adapter files, where asked for."""
    if cfg.export_hf:
        _export_hf(cfg, model, tokenizer, rank)
        log.message(f"exported the {'merged ' if is_lora(model) else ''}model in the hub's format to "
                    f"{cfg.export_hf}")
    if cfg.export_adapter:
        export_adapter(model, cfg.export_adapter, tokenizer, rank, cfg.model)
        log.message(f"exported the LoRA adapter (PEFT's files) to {cfg.export_adapter}")


def _export_hf(cfg: TrainConfig, model: nn.Module, tokenizer, rank: int) -> None:
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
