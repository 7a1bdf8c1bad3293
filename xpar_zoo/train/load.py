"""What ``xpar-zoo train`` builds before step 1 from what it read (:mod:`.inputs`): the parallelized model
(:func:`load_model`) and the run's components around it (:func:`build_run`): optimizer and schedule, router loss,
expert load and biases, checkpointer (resumed from the checkpoint, if any), evaluator."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..compat import attn_implementation, flash_attention_available
from ..errors import TrainConfigError
from ..loss.balance import ExpertLoad, correction_biases
from ..styles.sequence import data_shard, set_inner_attention
from .chat import pad_token_id
from .checkpointer import Checkpointer
from .config import DTYPES, TrainConfig, parallel_options
from .data import PackedCorpus
from .evaluate import Evaluator
from .inputs import Inputs
from .lora import from_pretrained_kwargs
from .multimodal import freeze_vision
from .optim import build_optimizer, build_scheduler
from .router_loss import RouterAux, router_aux


@dataclass(kw_only=True)
class Run:
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


def load_model(cfg: TrainConfig, *, mesh, rank: int, **peft) -> nn.Module:
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


def build_run(inputs: Inputs, *, device: torch.device, rank: int, world: int) -> tuple[Run, Any, int, int]:
    """The parallelized model, its optimizer and schedule (resumed from the checkpoint, if any): the run, its mesh,
    and the step and data position it starts from."""
    from ..parallel.mesh import Mesh

    cfg = inputs.cfg
    sizes = dict(cfg.mesh)
    mesh = Mesh(replicate=sizes.pop("replicate", 1), **sizes)
    peft = from_pretrained_kwargs(cfg, inputs.model_config)
    if peft:
        torch.manual_seed(cfg.seed)  # a new adapter is drawn from --seed (rank 0's RNG)
    model = load_model(cfg, mesh=mesh, rank=rank, **peft)
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
    run = Run(cfg=cfg, model=model, optimizer=optimizer, scheduler=build_scheduler(optimizer, cfg, step),
               corpus=inputs.corpus, load=load, biases=biases, aux=router_aux(model, cfg), checkpointer=checkpointer,
               evaluator=evaluator, flatten=flatten, device=device, world=world, rank=rank, part=part, parts=parts,
               counts_once=mesh.sequence_rank("sp") == 0 and mesh.sequence_rank("cp") == 0)
    return run, mesh, step, position
