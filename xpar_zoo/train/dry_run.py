"""``xpar-zoo train --dry-run``: the resolved settings, the mesh, the data's token and target counts, what the run
would do with ``--output`` (refuse, with the real run's line; resume; replace with ``--force``) and the sizer's
memory estimate, printed without loading any weight or starting a process group or any rank (the world: the
ranks ``--nproc-per-node`` × ``--nnodes`` would start, else under torchrun its world size, rank 0 printing)."""

from __future__ import annotations

import json
from pathlib import Path

from ..environment import launcher_world_size
from ..errors import counted
from .config import DTYPES, TrainConfig, parallel_options
from .outputs import check_finished_resume, plan_outputs


def _model_config(cfg: TrainConfig):
    """The model's config (no weights): a tiny model's built in memory, else the config file."""
    from .tiny_vl import tiny_model_config

    tiny = tiny_model_config(cfg.model)
    if tiny is not None:
        return tiny
    from ..hub.resolve import resolve_config
    from ..loader import load_config

    return load_config(resolve_config(cfg.model).parent)


def _read_data(cfg: TrainConfig, config, world: int):
    """The run's data and held-out data read as the run would (the tiny model's tokenizer built in memory), and the
    settings with ``--epochs`` resolved: ``(cfg, corpus, held-out corpus or None)``."""
    import dataclasses
    import tempfile

    from .inputs import load_corpus, resolve_epochs, text_vocab_size
    from .tiny_vl import TINY_MODELS, save_tiny_files

    held = None
    with tempfile.TemporaryDirectory() as tmp:
        data_cfg = cfg
        if cfg.model in TINY_MODELS and not cfg.tokenizer:  # its tokenizer (and processor), built in memory too
            save_tiny_files(cfg.model, tmp)
            data_cfg = dataclasses.replace(cfg, tokenizer=tmp)
        corpus, tokenizer = load_corpus(data_cfg, text_vocab_size(config), model_config=config)
        if cfg.eval_data:
            held = load_corpus(data_cfg, text_vocab_size(config), cfg.eval_data, model_config=config)[0]
    cfg, corpus = resolve_epochs(cfg, corpus, tokenizer, world)
    return cfg, corpus, held


def _data_lines(cfg: TrainConfig, config, corpus, held, world: int, replicate: int) -> list[str]:
    """The report's settings, mesh, model and data lines."""
    from .data import rows_per_step
    from .inputs import data_parts

    per_step = rows_per_step(data_parts(cfg, world), cfg.micro_batch, cfg.grad_accum)
    lines = ["xpar-zoo train --dry-run (no weights loaded)", "settings:"]
    lines += [f"  {k}: {json.dumps(v)}" for k, v in sorted(cfg.to_json().items())]
    mesh = ", ".join(f"{k}={v}" for k, v in cfg.mesh.items()) or "FSDP only"
    lines.append(f"mesh: {mesh} over {counted(world, 'rank')}, dense parameters FSDP-sharded over "
                 f"{world // replicate} x {counted(replicate, 'replica')}")
    text = config.get_text_config()
    lines.append(f"model: {config.model_type}, {text.num_hidden_layers} layers, vocabulary {text.vocab_size}")
    data = getattr(corpus, "summary", "") or (f"{cfg.data}: {corpus.num_tokens} tokens (text: every token but a "
                                              "document's first is a target)")
    lines.append(f"data: {data}")
    targets = getattr(corpus, "num_targets", None)
    lines.append(f"data: {corpus.num_tokens} tokens, "
                 + (f"{targets} target tokens, " if targets is not None else "")
                 + f"{corpus.rows_per_epoch} rows of {cfg.seq_len} per epoch; {per_step} rows per step; "
                 f"{cfg.steps} steps" + (f" ({cfg.epochs} epochs)" if cfg.epochs else ""))
    if held is not None:
        lines.append(f"eval: {getattr(held, 'summary', '') or f'{held.num_tokens} tokens'}")
    return lines


def _estimate_lines(cfg: TrainConfig, config, world: int, sizes: dict, replicate: int, sequence: dict) -> list[str]:
    """The sizer's per-rank memory estimate of the run (LoRA counted when it trains a new adapter)."""
    from .. import sizing
    from .lora import lora_modules
    from .sft_config import lora_enabled

    lora = {}
    if lora_enabled(cfg) and cfg.lora_rank is not None:
        from ..styles.lora import expert_parameters
        from ..zoo.registry import get_plan

        lora = dict(lora_rank=cfg.lora_rank, lora_modules=lora_modules(cfg, config),
                    lora_parameters=expert_parameters(get_plan(config.model_type)) if cfg.lora_experts else [])
    short = {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}
    saved = str(getattr(config, "dtype", None) or "float32").replace("torch.", "")
    param_dtype = "bf16" if cfg.mixed_precision else short.get(DTYPES[cfg.dtype] if cfg.dtype else saved, "fp32")
    est = sizing.estimate(config, world, sizes, replicate, micro_batch=cfg.micro_batch, seq=cfg.seq_len,
                          param_dtype=param_dtype, recompute=cfg.recompute, options=parallel_options(cfg),
                          **sequence, **lora,
                          **({"attention": cfg.attn_implementation}
                             if cfg.attn_implementation in sizing.ATTENTION_IMPLEMENTATIONS else {}))
    lines = ["memory estimate (xpar_zoo.sizing, per rank):", sizing.format_estimate(est)]
    if cfg.adapter:
        lines.append(f"LoRA: the saved adapter {Path(cfg.adapter)} (not counted by the estimate)")
    return lines


def dry_run(cfg: TrainConfig, world: int | None = None) -> str:
    """The report of ``--dry-run`` (see the module docstring) for ``world`` ranks (default: the launcher's
    ``WORLD_SIZE``, else 1); raises what the run would raise on bad settings or data."""
    from ..parallel.mesh import validate_sequence_sizes, validate_sizes

    world = world or launcher_world_size()
    sizes = dict(cfg.mesh)
    replicate = sizes.pop("replicate", 1)
    sequence = {d: sizes.pop(d, 1) for d in ("sp", "cp")}
    validate_sizes(world, sizes, replicate)
    validate_sequence_sizes(world, replicate, sequence["sp"], sequence["cp"])
    plan = plan_outputs(cfg)  # what the run would refuse (raised: the same line) or replace in --output
    config = _model_config(cfg)
    cfg, corpus, held = _read_data(cfg, config, world)
    check_finished_resume(plan, cfg.steps)
    lines = _data_lines(cfg, config, corpus, held, world, replicate)
    lines += [f"output: {line}" for line in plan.describe() or [f"{cfg.output}: a new run"]]
    lines += _estimate_lines(cfg, config, world, sizes, replicate, sequence)
    return "\n".join(lines)
