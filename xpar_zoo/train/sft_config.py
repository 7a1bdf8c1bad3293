"""The fine-tuning settings of ``xpar-zoo train``: conversation data, LoRA, evaluation, reporting, ``--dry-run``.
Their fields live in :class:`~xpar_zoo.train.config.TrainConfig`; this module adds their flags and checks them
(one :class:`~xpar_zoo.errors.TrainConfigError` line, before any model or data is read)."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

from ..errors import TrainConfigError

LOSS_ON = ("assistant", "completion", "all")  # which tokens are targets (xpar_zoo.train.chat)
TRUNCATE = ("left", "right", "drop")  # what a conversation longer than --seq-len becomes

DEFAULT_LORA_TARGETS = "q_proj,k_proj,v_proj,o_proj"
REPORTERS = ("tensorboard", "wandb", "none")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of the fine-tuning settings (defaults "not given", as every ``train`` flag)."""
    S = argparse.SUPPRESS
    a = parser.add_argument
    a("--epochs", type=int, default=S, help="train this many passes over the data (instead of --steps)")
    a("--loss-on", choices=LOSS_ON, default=S,
      help="targets of conversation data: assistant turns (default for 'messages'), the completion (default for "
           "'prompt'/'completion'; for 'messages' the last assistant turn) or all tokens")
    a("--truncate", choices=TRUNCATE, default=S,
      help="a conversation longer than --seq-len: keep its end (left), its start (right), or drop it "
           "(default: refuse the data)")
    a("--lora-rank", type=int, default=S, help="train a LoRA adapter of this rank instead of every parameter")
    a("--lora-alpha", type=float, default=S, help="LoRA alpha (default: 2 x rank)")
    a("--lora-dropout", type=float, default=S, help="LoRA dropout (default 0)")
    a("--lora-targets", default=S, help=f"modules LoRA adapts, comma-separated (default {DEFAULT_LORA_TARGETS})")
    a("--lora-experts", action=argparse.BooleanOptionalAction, default=S,
      help="LoRA on the fused expert tensors too (default on, for MoE models)")
    a("--lora-vision", action=argparse.BooleanOptionalAction, default=S,
      help="multimodal models: LoRA on the vision tower's and its projector's linear layers too (default off)")
    a("--adapter", default=S, help="continue training a saved PEFT LoRA adapter (a directory)")
    a("--export-adapter", default=S, help="write the LoRA adapter in PEFT's format here at the end")
    a("--eval-data", default=S, help="held-out data (the formats of --data): eval_loss over all of it")
    a("--eval-every", type=int, default=S, help="evaluate every N steps (default 0: after the last step only)")
    a("--eval-batches", type=int, default=S, help="evaluate on the first K batches of --eval-data only")
    a("--save-best", action=argparse.BooleanOptionalAction, default=S,
      help="keep the checkpoint with the lowest eval_loss in OUTPUT/best")
    a("--report-to", default=S, help="tensorboard, wandb or none, comma-separated (default: tensorboard when "
                                     "installed)")
    a("--max-pixels", type=int, default=S, help="image–text data: the processor's largest image in pixels (its "
                                                  "max_pixels; default: the processor's own)")
    a("--min-pixels", type=int, default=S, help="image–text data: the processor's smallest image in pixels")
    a("--allow-absolute-paths", action=argparse.BooleanOptionalAction, default=S,
      help="image–text data: read images outside the data file's folder (absolute paths, '..')")
    a("--freeze-vision", action=argparse.BooleanOptionalAction, default=S,
      help="multimodal models: keep the vision tower and its projector frozen (train the language model only)")
    a("--dry-run", action="store_true", default=False,
      help="print the resolved settings, the mesh, the data's token and target counts and the memory estimate, "
           "then exit without loading weights")


def reporters(cfg) -> tuple[str, ...]:
    """The sinks ``--report-to`` names (``()`` for none); ``None`` unset: TensorBoard when installed."""
    if cfg.report_to is None:
        return ("tensorboard",) if cfg.tensorboard and importlib.util.find_spec("tensorboard") else ()
    names = tuple(dict.fromkeys(n.strip() for n in cfg.report_to.split(",") if n.strip()))
    return tuple(n for n in names if n != "none")


def validate(cfg) -> None:
    """Raise :class:`TrainConfigError` on fine-tuning settings that cannot work."""
    if cfg.epochs is not None:
        if cfg.epochs < 1:
            raise TrainConfigError(f"epochs must be at least 1, got {cfg.epochs}")
        if cfg.steps is not None:
            raise TrainConfigError(f"give --steps ({cfg.steps}) or --epochs ({cfg.epochs}), not both")
    if cfg.loss_on is not None and cfg.loss_on not in LOSS_ON:
        raise TrainConfigError(f"loss_on must be one of {', '.join(LOSS_ON)}, got {cfg.loss_on!r}")
    if cfg.truncate is not None and cfg.truncate not in TRUNCATE:
        raise TrainConfigError(f"truncate must be one of {', '.join(TRUNCATE)}, got {cfg.truncate!r}")
    for name in ("max_pixels", "min_pixels"):
        value = getattr(cfg, name)
        if value is not None and value < 1:
            raise TrainConfigError(f"{name} must be at least 1, got {value}")
    if cfg.max_pixels is not None and cfg.min_pixels is not None and cfg.min_pixels > cfg.max_pixels:
        raise TrainConfigError(f"min_pixels ({cfg.min_pixels}) is above max_pixels ({cfg.max_pixels})")
    _validate_lora(cfg)
    _validate_eval(cfg)
    _validate_report(cfg)


def lora_enabled(cfg) -> bool:
    return cfg.lora_rank is not None or cfg.adapter is not None


def _validate_lora(cfg) -> None:
    given = [flag for flag, on in (("--lora-alpha", cfg.lora_alpha is not None), ("--lora-dropout", cfg.lora_dropout),
                                   ("--lora-targets", cfg.lora_targets != DEFAULT_LORA_TARGETS),
                                   ("--no-lora-experts", not cfg.lora_experts), ("--lora-vision", cfg.lora_vision))
             if on]
    if cfg.adapter is not None and cfg.lora_rank is not None:
        raise TrainConfigError("give --lora-rank (a new adapter) or --adapter DIR (a saved one), not both")
    if given and cfg.lora_rank is None:
        raise TrainConfigError(f"{', '.join(given)} set(s) up a new LoRA adapter: give --lora-rank too"
                               + (" (a saved --adapter keeps its own config)" if cfg.adapter else ""))
    if cfg.export_adapter is not None and not lora_enabled(cfg):
        raise TrainConfigError("--export-adapter writes a LoRA adapter: train one (--lora-rank or --adapter)")
    if not lora_enabled(cfg):
        return
    if importlib.util.find_spec("peft") is None:
        raise TrainConfigError("LoRA needs PEFT: pip install 'xpar_zoo[peft]'")
    if cfg.lora_rank is not None and cfg.lora_rank < 1:
        raise TrainConfigError(f"lora_rank must be at least 1, got {cfg.lora_rank}")
    if cfg.lora_alpha is not None and cfg.lora_alpha <= 0:
        raise TrainConfigError(f"lora_alpha must be positive, got {cfg.lora_alpha}")
    if not 0 <= cfg.lora_dropout < 1:
        raise TrainConfigError(f"lora_dropout must be in [0, 1), got {cfg.lora_dropout}")
    if cfg.lora_vision and cfg.freeze_vision:
        raise TrainConfigError("--lora-vision adapts the vision tower, --freeze-vision keeps it frozen: give one")
    if cfg.lora_rank is not None and not lora_targets(cfg) and not cfg.lora_experts and not cfg.lora_vision:
        raise TrainConfigError("--lora-targets is empty and --no-lora-experts: LoRA would adapt nothing")
    if cfg.adapter is not None and not (Path(cfg.adapter) / "adapter_config.json").is_file():
        raise TrainConfigError(f"--adapter {cfg.adapter}: no adapter_config.json there (not a PEFT adapter directory)")


def lora_targets(cfg) -> list[str]:
    return [t.strip() for t in cfg.lora_targets.split(",") if t.strip()]


def _validate_eval(cfg) -> None:
    if cfg.eval_data is None:
        given = [f for f, on in (("--eval-every", cfg.eval_every), ("--eval-batches", cfg.eval_batches is not None),
                                 ("--save-best", cfg.save_best)) if on]
        if given:
            raise TrainConfigError(f"{', '.join(given)} evaluate(s) held-out data: give --eval-data FILE")
        return
    if not Path(cfg.eval_data).exists():
        raise TrainConfigError(f"--eval-data {cfg.eval_data}: no such file or directory")
    if cfg.eval_every < 0:
        raise TrainConfigError(f"eval_every must not be negative, got {cfg.eval_every}")
    if cfg.eval_batches is not None and cfg.eval_batches < 1:
        raise TrainConfigError(f"eval_batches must be at least 1, got {cfg.eval_batches}")


def _validate_report(cfg) -> None:
    if cfg.report_to is None:
        return
    names = [n.strip() for n in cfg.report_to.split(",") if n.strip()]
    unknown = [n for n in names if n not in REPORTERS]
    if unknown or not names:
        raise TrainConfigError(f"report_to: {', '.join(unknown) or 'nothing'} unknown; choose from "
                               f"{', '.join(REPORTERS)}")
    if "none" in names and len(names) > 1:
        raise TrainConfigError(f"report_to: 'none' with {', '.join(n for n in names if n != 'none')}")
    if "tensorboard" in names and not cfg.tensorboard:
        raise TrainConfigError("--report-to tensorboard and --no-tensorboard disagree")
    for name, extra in (("tensorboard", "tensorboard"), ("wandb", "wandb")):
        if name in names and importlib.util.find_spec(name) is None:
            raise TrainConfigError(f"--report-to {name}: {name} is not installed (pip install 'xpar_zoo[{extra}]')")
