"""LoRA in ``xpar-zoo train``: the ``--lora-*`` and ``--adapter`` settings as ``xpar_zoo.from_pretrained``'s
``peft_config=`` / ``adapter=``, and the exports at the end of a run (``--export-hf``: merged hub weights written
from the live shards; ``--export-adapter``: PEFT's own adapter files). Checkpoints of a LoRA run hold the adapters
and their optimizer state only (``save_checkpoint(..., trainable_only=True)``); the base comes from ``--model``.
"""

from __future__ import annotations

import os
from pathlib import Path

from torch import nn

from .sft_config import lora_enabled, lora_targets


def from_pretrained_kwargs(cfg, model_config) -> dict:
    """``peft_config=LoraConfig(...)`` for ``--lora-rank`` (attention ``--lora-targets`` and, with
    ``--lora-experts``, every fused expert tensor of the model's plan), ``adapter=DIR`` for ``--adapter``, or
    nothing."""
    if cfg.adapter is not None:
        return {"adapter": cfg.adapter}
    if cfg.lora_rank is None:
        return {}
    from peft import LoraConfig

    from ..integrations.peft import expert_parameters
    from ..zoo.registry import get_plan

    experts = expert_parameters(get_plan(model_config.model_type)) if cfg.lora_experts else []
    config = LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha if cfg.lora_alpha is not None else 2 * cfg.lora_rank,
                        lora_dropout=cfg.lora_dropout, target_modules=lora_targets(cfg) or None,
                        target_parameters=experts or None)
    return {"peft_config": config}


def is_lora(model: nn.Module) -> bool:
    return bool(getattr(model, "peft_config", None))


def export_merged(model: nn.Module, directory: str | os.PathLike, progress: bool = False) -> Path:
    """Write a parallelized PEFT LoRA model's merged weights (``W + s·BA``, as PEFT's ``merge_and_unload``) in the
    hub's own format, from the live shards. A collective; rank 0 writes."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from ..hub.save_pretrained import save_pretrained
    from ..integrations.peft_files import AdapterMerge, adapter_metadata

    specs = {n: (tuple(t.shape), t.dtype) for n, t in get_model_state_dict(model).items()}
    merge = AdapterMerge(model.config, adapter_metadata(model), specs)
    return save_pretrained(model, directory, merge=merge, progress=progress)


def export(cfg, model: nn.Module, tokenizer, rank: int) -> list[str]:
    """The exports a run asks for at its end (every rank calls): ``--export-hf`` (merged for LoRA) and
    ``--export-adapter``, the tokenizer beside each. Returns what was written, for the log."""
    import torch.distributed as dist

    written = []
    if cfg.export_hf:
        if is_lora(model):
            export_merged(model, cfg.export_hf)
        else:
            model.save_pretrained(cfg.export_hf)  # every rank: the hub's own format, rank 0 writes
        written.append(f"the {'merged ' if is_lora(model) else ''}model in the hub's format to {cfg.export_hf}")
    if cfg.export_adapter and lora_enabled(cfg):
        from ..integrations.peft_files import save_adapter

        save_adapter(model, cfg.export_adapter)
        written.append(f"the LoRA adapter (PEFT's files) to {cfg.export_adapter}")
    if rank == 0 and tokenizer is not None:
        for directory in (cfg.export_hf, cfg.export_adapter):
            if directory:
                tokenizer.save_pretrained(directory)
    dist.barrier()
    return written
