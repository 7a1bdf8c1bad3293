"""LoRA in ``xpar-zoo train``: the ``--lora-*`` and ``--adapter`` settings as ``xpar_zoo.from_pretrained``'s
``peft_config=`` / ``adapter=``, and the exports at the end of a run (``--export-hf``: merged hub weights written
from the live shards; ``--export-adapter``: PEFT's own adapter files). Checkpoints of a LoRA run hold the adapters
and their optimizer state only (``save_checkpoint(..., trainable_only=True)``); the base comes from ``--model``.
"""

from __future__ import annotations

import os
from pathlib import Path

from torch import nn

from ..errors import TrainConfigError
from .multimodal import vision_linears
from .sft_config import lora_targets


def from_pretrained_kwargs(cfg, model_config) -> dict:
    """``peft_config=LoraConfig(...)`` for ``--lora-rank`` (attention ``--lora-targets`` and, with
    ``--lora-experts``, every fused expert tensor of the model's plan), ``adapter=DIR`` for ``--adapter``, or
    nothing."""
    if cfg.adapter is not None:
        return {"adapter": cfg.adapter}
    if cfg.lora_rank is None:
        return {}
    from peft import LoraConfig

    from ..styles.lora import expert_parameters
    from ..zoo.registry import get_plan

    experts = expert_parameters(get_plan(model_config.model_type)) if cfg.lora_experts else []
    config = LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha if cfg.lora_alpha is not None else 2 * cfg.lora_rank,
                        lora_dropout=cfg.lora_dropout, target_modules=lora_modules(cfg, model_config) or None,
                        target_parameters=experts or None)
    return {"peft_config": config}


def lora_modules(cfg, model_config) -> list[str]:
    """The modules LoRA adapts: ``--lora-targets`` and, with ``--lora-vision``, every linear layer of the vision
    tower and its projector (by full name, :func:`~xpar_zoo.train.multimodal.vision_linears` of the model built on
    meta)."""
    targets = lora_targets(cfg)
    if not cfg.lora_vision:
        return targets
    import torch

    from ..zoo.registry import build_meta

    linears = vision_linears(build_meta(model_config, torch.float32))
    if not linears:
        raise TrainConfigError(f"--lora-vision: {model_config.model_type} has no vision tower with linear layers")
    return targets + linears


def is_lora(model: nn.Module) -> bool:
    return bool(getattr(model, "peft_config", None))


def export_merged(model: nn.Module, directory: str | os.PathLike, progress: bool = False) -> Path:
    """Write a parallelized PEFT LoRA model's merged weights (``W + s·BA``, as PEFT's ``merge_and_unload``) in the
    hub's own format, from the live shards. A collective; rank 0 writes."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from ..hub.adapter_files import AdapterMerge, adapter_metadata
    from ..hub.save_pretrained import save_pretrained

    specs = {n: (tuple(t.shape), t.dtype) for n, t in get_model_state_dict(model).items()}
    merge = AdapterMerge(model.config, adapter_metadata(model), specs)
    return save_pretrained(model, directory, merge=merge, progress=progress)


def export_adapter(model: nn.Module, directory: str | os.PathLike, tokenizer, rank: int,
                   cfg_model: str | None = None) -> Path:
    """``--export-adapter``: PEFT's adapter files (and the tokenizer; a multimodal model's processor files from
    ``cfg_model``) in ``directory``, written into a staging
    directory beside it that replaces it once complete (an existing one: ``--force``, checked at start). A
    collective."""
    from ..hub.adapter_files import save_adapter
    from .outputs import ExportTarget

    target = ExportTarget(Path(directory))
    try:
        save_adapter(model, target.path, force=True)  # the staging directory: empty, ours
        if rank == 0 and tokenizer is not None:
            tokenizer.save_pretrained(target.path)
        if rank == 0 and cfg_model is not None and getattr(model.config, "vision_config", None) is not None:
            from .multimodal import copy_processor_files

            copy_processor_files(cfg_model, target.path)
        target.commit()
    except BaseException:
        target.discard()
        raise
    return Path(directory)
