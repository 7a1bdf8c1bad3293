"""The training configuration: one YAML file (``--config``) and flags that override it.

Keys are the flag names (``seq_len`` or ``seq-len``); ``mesh`` is a mapping (``{ep: 8}``) or the flag's string
(``"ep=8,emb=2,replicate=2"``). Precedence: defaults < the file < flags. Unknown keys and bad values raise
:class:`~xpar_zoo.errors.TrainConfigError` naming the key (and the file) before any model is loaded.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import TrainConfigError
from . import sft_config

SCHEDULES = ("cosine", "linear", "constant")
DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp32": "float32", "float32": "float32",
          "fp16": "float16", "float16": "float16"}
REQUIRED = ("model", "data", "output")  # and steps or epochs


@dataclass
class TrainConfig:
    """Every setting of ``xpar-zoo train`` (see ``xpar-zoo train --help`` and the README's "Training")."""

    model: str | None = None
    data: str | None = None
    output: str | None = None
    steps: int | None = None
    tokenizer: str | None = None
    text_field: str = "text"
    mesh: dict[str, int] = field(default_factory=dict)
    seq_len: int = 2048
    micro_batch: int = 1
    grad_accum: int = 1
    lr: float = 1e-5
    warmup: int = 0
    schedule: str = "cosine"
    min_lr_ratio: float = 0.0
    weight_decay: float = 0.0
    adam_betas: tuple[float, float] = (0.9, 0.95)
    max_grad_norm: float = 1.0
    save_every: int = 0
    keep_last: int | None = None
    resume: bool = False
    stop_after: int | None = None
    seed: int = 0
    dtype: str | None = None
    mixed_precision: bool = False
    recompute: bool = False
    attn_implementation: str | None = None
    export_hf: str | None = None
    expert_bias_update_rate: float = 0.0
    router_aux_loss_coef: float | None = None
    tensorboard: bool = True
    progress: bool = True
    timeout_minutes: float = 30.0
    # fine-tuning (xpar_zoo.train.sft_config): conversations, epochs, LoRA, evaluation, reporting
    epochs: int | None = None
    loss_on: str | None = None
    truncate: str | None = None
    lora_rank: int | None = None
    lora_alpha: float | None = None
    lora_dropout: float = 0.0
    lora_targets: str = "q_proj,k_proj,v_proj,o_proj"
    lora_experts: bool = True
    adapter: str | None = None
    export_adapter: str | None = None
    eval_data: str | None = None
    eval_every: int = 0
    eval_batches: int | None = None
    save_best: bool = False
    report_to: str | None = None

    def to_json(self) -> dict[str, Any]:
        """The settings as JSON data (saved in checkpoints and printed at start)."""
        out = dataclasses.asdict(self)
        out["adam_betas"] = list(self.adam_betas)
        return out


FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}


def parse_mesh(value: Any, where: str = "--mesh") -> dict[str, int]:
    """``"ep=2,emb=2,replicate=2"`` (or a mapping) as ``{"ep": 2, "emb": 2, "replicate": 2}``."""
    if value is None or value == "" or value == {}:
        return {}
    if isinstance(value, dict):
        items = list(value.items())
    elif isinstance(value, str):
        items = []
        for part in value.split(","):
            name, sep, size = part.strip().partition("=")
            if not sep or not name.strip():
                raise TrainConfigError(f"{where}: {part.strip()!r} is not NAME=SIZE (e.g. ep=2,emb=2,replicate=2)")
            items.append((name.strip(), size.strip()))
    else:
        raise TrainConfigError(f"{where}: expected NAME=SIZE pairs or a mapping, got {value!r}")
    out = {}
    for name, size in items:
        try:
            size = int(size)
        except (TypeError, ValueError):
            raise TrainConfigError(f"{where}: size of {name!r} must be an integer, got {size!r}") from None
        if size < 1:
            raise TrainConfigError(f"{where}: size of {name!r} must be positive, got {size}")
        if name in out:
            raise TrainConfigError(f"{where}: {name!r} given twice")
        out[str(name)] = size
    return out


def _coerce(name: str, value: Any, where: str) -> Any:
    """``value`` of key ``name`` checked and converted to the field's type."""
    if name == "mesh":
        return parse_mesh(value, where)
    if name == "lora_targets" and isinstance(value, (list, tuple)):  # YAML: a list of module names
        value = ",".join(map(str, value))
    if name == "adam_betas":
        parts = value.split(",") if isinstance(value, str) else value
        try:
            betas = tuple(float(b) for b in parts)
        except (TypeError, ValueError):
            betas = ()
        if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
            raise TrainConfigError(f"{where}: adam_betas must be two numbers in [0, 1), got {value!r}")
        return betas
    kind = FIELDS[name].type  # the annotation as text
    if value is None:
        if "None" in kind:
            return None
        raise TrainConfigError(f"{where}: {name} cannot be null")
    if "bool" in kind:
        if isinstance(value, bool):
            return value
        raise TrainConfigError(f"{where}: {name} must be true or false, got {value!r}")
    if "int" in kind and "float" not in kind:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, str) and value.strip().lstrip("-").isdigit():
                return int(value)
            raise TrainConfigError(f"{where}: {name} must be an integer, got {value!r}")
        return value
    if "float" in kind:
        if isinstance(value, bool):
            raise TrainConfigError(f"{where}: {name} must be a number, got {value!r}")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise TrainConfigError(f"{where}: {name} must be a number, got {value!r}") from None
    if not isinstance(value, str):
        raise TrainConfigError(f"{where}: {name} must be a string, got {value!r}")
    return value


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The settings in a YAML file, keys normalised to field names; :class:`TrainConfigError` naming the file and key
    on anything unknown or unreadable."""
    import yaml

    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise TrainConfigError(f"{path}: cannot read the config ({e.strerror or e})") from None
    except yaml.YAMLError as e:
        raise TrainConfigError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise TrainConfigError(f"{path}: the config must be a mapping of settings, got {type(data).__name__}")
    out = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name not in FIELDS:
            raise TrainConfigError(f"{path}: unknown setting {key!r} (settings: {', '.join(FIELDS)})")
        out[name] = _coerce(name, value, f"{path}: {key}")
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``train`` flags (every default is "not given", so that the config file's values stand)."""
    S = argparse.SUPPRESS
    a = parser.add_argument
    a("--config", help="YAML file of settings (keys: the flag names); flags override it")
    a("--model", default=S, help="hub id or local directory of the model to train (safetensors)")
    a("--data", default=S, help="JSONL ('text' field), .txt, or parquet/arrow/csv/datasets dir (xpar_zoo[data])")
    a("--tokenizer", default=S, help="tokenizer hub id or directory (default: the model's)")
    a("--text-field", default=S, help="the text field of JSONL / datasets records (default: text)")
    a("--mesh", default=S, help="extra plans and HSDP replicas, e.g. ep=2,emb=2,replicate=2 (default: FSDP only)")
    a("--seq-len", type=int, default=S, help="tokens per packed row (default 2048)")
    a("--micro-batch", type=int, default=S, help="rows per rank per forward (default 1)")
    a("--grad-accum", type=int, default=S, help="micro-batches per optimizer step (default 1)")
    a("--steps", type=int, default=S, help="optimizer steps of the whole run (the LR schedule's length)")
    a("--lr", type=float, default=S, help="peak learning rate (default 1e-5)")
    a("--warmup", type=int, default=S, help="linear warmup steps (default 0)")
    a("--schedule", choices=SCHEDULES, default=S, help="decay after warmup (default cosine)")
    a("--min-lr-ratio", type=float, default=S, help="cosine: final LR as a fraction of --lr (default 0)")
    a("--weight-decay", type=float, default=S, help="AdamW weight decay of matrices (default 0)")
    a("--adam-betas", default=S, help="AdamW betas, e.g. 0.9,0.95 (default)")
    a("--max-grad-norm", type=float, default=S, help="clip the global gradient norm (default 1.0; 0: no clipping)")
    a("--save-every", type=int, default=S, help="checkpoint every N steps (default 0: at the end and at --stop-after)")
    a("--keep-last", type=int, default=S, help="keep the N newest checkpoints (default: all)")
    a("--output", default=S, help="run directory: checkpoints/, metrics.jsonl, tensorboard/")
    a("--resume", action="store_true", default=S, help="continue from the newest complete checkpoint in --output")
    a("--stop-after", type=int, default=S, help="end this run cleanly after step N (the schedule follows --steps)")
    a("--seed", type=int, default=S, help="data order seed (default 0)")
    a("--dtype", choices=sorted(DTYPES), default=S, help="parameter dtype (default: the checkpoint's)")
    a("--mixed-precision", action=argparse.BooleanOptionalAction, default=S,
      help="bf16 compute with fp32 gradient reduction (FSDP2 mixed precision)")
    a("--recompute", action=argparse.BooleanOptionalAction, default=S,
      help="activation checkpointing of every decoder layer")
    a("--attn-implementation", default=S, help="transformers attention implementation (default: the model's)")
    a("--export-hf", default=S, help="write the trained model in the hub's format here at the end")
    a("--expert-bias-update-rate", type=float, default=S,
      help="aux-loss-free balancing: bias += rate*sign(mean load - load) per step, routers with "
           "e_score_correction_bias (DeepSeek-V3, GLM-4-MoE); default 0 (off)")
    a("--router-aux-loss-coef", type=float, default=S,
      help="router auxiliary loss over the global batch (default: the model config's, when it enables it)")
    a("--tensorboard", action=argparse.BooleanOptionalAction, default=S,
      help="TensorBoard events in OUTPUT/tensorboard when tensorboard is installed (default on)")
    a("--progress", action=argparse.BooleanOptionalAction, default=S, help="progress bar on rank 0 (default on)")
    a("--timeout-minutes", type=float, default=S, help="process-group timeout (default 30)")
    sft_config.add_arguments(parser)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """Defaults, then the ``--config`` file, then the flags given; validated."""
    values: dict[str, Any] = {}
    if getattr(args, "config", None):
        values.update(read_config_file(args.config))
    for name in FIELDS:
        if hasattr(args, name):
            values[name] = _coerce(name, getattr(args, name), f"--{name.replace('_', '-')}")
    cfg = TrainConfig(**values)
    validate(cfg)
    return cfg


def validate(cfg: TrainConfig) -> None:
    """Raise :class:`TrainConfigError` on any setting that cannot work."""
    missing = [f"--{n}" for n in REQUIRED if getattr(cfg, n) in (None, "")]
    if cfg.steps is None and cfg.epochs is None:
        missing.append("--steps (or --epochs)")
    if missing:
        raise TrainConfigError(f"missing setting(s): {', '.join(missing)} (flags or keys of --config)")
    sft_config.validate(cfg)
    for name in ("steps", "seq_len", "micro_batch", "grad_accum"):
        if getattr(cfg, name) is not None and getattr(cfg, name) < 1:
            raise TrainConfigError(f"{name} must be at least 1, got {getattr(cfg, name)}")
    if cfg.seq_len < 2:
        raise TrainConfigError(f"seq_len must be at least 2, got {cfg.seq_len}")
    for name in ("warmup", "save_every", "seed"):
        if getattr(cfg, name) < 0:
            raise TrainConfigError(f"{name} must not be negative, got {getattr(cfg, name)}")
    for name in ("lr", "weight_decay", "max_grad_norm", "expert_bias_update_rate", "min_lr_ratio"):
        if getattr(cfg, name) < 0:
            raise TrainConfigError(f"{name} must not be negative, got {getattr(cfg, name)}")
    if cfg.router_aux_loss_coef is not None and cfg.router_aux_loss_coef < 0:
        raise TrainConfigError(f"router_aux_loss_coef must not be negative, got {cfg.router_aux_loss_coef}")
    if cfg.min_lr_ratio > 1:
        raise TrainConfigError(f"min_lr_ratio must be at most 1, got {cfg.min_lr_ratio}")
    if cfg.schedule not in SCHEDULES:
        raise TrainConfigError(f"schedule must be one of {', '.join(SCHEDULES)}, got {cfg.schedule!r}")
    if cfg.steps is not None:  # --epochs: checked again once the data gives the steps
        if cfg.warmup > cfg.steps:
            raise TrainConfigError(f"warmup ({cfg.warmup}) is longer than the run (steps {cfg.steps})")
        if cfg.stop_after is not None and not 1 <= cfg.stop_after <= cfg.steps:
            raise TrainConfigError(f"stop_after must be a step in 1 … steps ({cfg.steps}), got {cfg.stop_after}")
    if cfg.keep_last is not None and cfg.keep_last < 1:
        raise TrainConfigError(f"keep_last must be at least 1, got {cfg.keep_last}")
    if cfg.dtype is not None and cfg.dtype not in DTYPES:
        raise TrainConfigError(f"dtype must be one of {', '.join(sorted(DTYPES))}, got {cfg.dtype!r}")
    if cfg.timeout_minutes <= 0:
        raise TrainConfigError(f"timeout_minutes must be positive, got {cfg.timeout_minutes}")
