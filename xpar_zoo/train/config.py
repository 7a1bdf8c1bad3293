"""The training configuration: one YAML file (``--config``) and flags that override it.

Keys are the flag names (``seq_len`` or ``seq-len``); ``mesh`` is a mapping (``{ep: 8}``) or the flag's string
(``"ep=8,emb=2,replicate=2"``). Precedence: defaults < the file < flags. Unknown keys and bad values raise
:class:`~xpar_zoo.errors.TrainConfigError` naming the key (and the file) before any model is loaded.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import PlanError, TrainConfigError
from ..hub.writer import DTYPES
from ..parallel.options import CP_ATTENTION, CPU_COLLECTIVES, ParallelOptions
from . import sft_config

SCHEDULES = ("cosine", "linear", "constant")
INT64_MAX = 2**63 - 1
MAX_CONFIG_BYTES = 1 << 20  # a settings file is a few hundred bytes; anything this large is not one
MAX_CONFIG_NODES = 10_000  # YAML nodes composed before a file is refused (aliases are refused outright)
DEFAULT_MAX_LINE_BYTES = 1 << 20
# (low, high) of numeric settings beyond "finite"; None: no bound on that side. Checked on flags and YAML alike.
RANGES: dict[str, tuple[float | None, float | None]] = {
    "steps": (1, 10**12), "seq_len": (2, 2**24), "micro_batch": (1, 2**20), "grad_accum": (1, 2**20),
    "warmup": (0, None), "save_every": (0, None), "keep_last": (1, None), "stop_after": (1, None),
    "seed": (0, INT64_MAX), "log_every": (1, None), "max_line_bytes": (1, 1 << 30),
    "lr": (0, 1), "min_lr_ratio": (0, 1), "weight_decay": (0, None), "max_grad_norm": (0, None),
    "expert_bias_update_rate": (0, None), "router_aux_loss_coef": (0, None),
    "epochs": (1, 10**6), "lora_rank": (1, 2**16),  # lora_alpha, lora_dropout, eval_*: sft_config says it
    "timeout_minutes": (1e-3, 525_600),  # a year: torch's timeout (a timedelta, then milliseconds) overflows past that
}
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
    resume: bool | str = False  # True, or "strict": refuse to skip a damaged or incomplete newer checkpoint
    stop_after: int | None = None
    seed: int = 0
    dtype: str | None = None
    mixed_precision: bool = False
    recompute: bool = False
    attn_implementation: str | None = None
    # xpar_zoo.ParallelOptions (None: the XPAR_ZOO_* variable's value, else the option's default)
    attention_block_mib: float | None = None
    cp_attention: str | None = None
    mixer_recompute: bool | None = None
    cpu_collectives: str | None = None
    export_hf: str | None = None
    expert_bias_update_rate: float = 0.0
    router_aux_loss_coef: float | None = None
    tensorboard: bool = True
    progress: bool = True
    timeout_minutes: float = 30.0
    force: bool = False
    log_every: int = 10
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES
    # fine-tuning (xpar_zoo.train.sft_config): conversations, epochs, LoRA, evaluation, reporting
    epochs: int | None = None
    loss_on: str | None = None
    truncate: str | None = None
    lora_rank: int | None = None
    lora_alpha: float | None = None
    lora_dropout: float = 0.0
    lora_targets: str = "q_proj,k_proj,v_proj,o_proj"
    lora_experts: bool = True
    lora_vision: bool = False
    adapter: str | None = None
    export_adapter: str | None = None
    eval_data: str | None = None
    eval_every: int = 0
    eval_batches: int | None = None
    save_best: bool = False
    report_to: str | None = None
    # image–text data (xpar_zoo.train.multimodal)
    max_pixels: int | None = None
    min_pixels: int | None = None
    allow_absolute_paths: bool = False
    freeze_vision: bool = False

    def to_json(self) -> dict[str, Any]:
        """The settings as JSON data (saved in checkpoints and printed at start)."""
        out = dataclasses.asdict(self)
        out["adam_betas"] = list(self.adam_betas)
        return out


FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}


def parse_mesh(value: Any, where: str = "--mesh") -> dict[str, int]:
    """``"ep=2,emb=2,replicate=2"`` (or a mapping) as ``{"ep": 2, "emb": 2, "replicate": 2}``."""
    if value is None or value == "" or value == {} or value == "none":
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
        if isinstance(size, str) and size.strip().isdigit():
            size = int(size)
        if isinstance(size, bool) or not isinstance(size, int):  # YAML's 2.7 is not 2
            raise TrainConfigError(f"{where}: size of {name!r} must be a whole number, got {size!r}")
        if not isinstance(name, str) or not name:
            raise TrainConfigError(f"{where}: plan names are words (ep, emb, head, replicate), got {name!r}")
        if size > 2**20:
            raise TrainConfigError(f"{where}: size of {name!r} is {size}, more ranks than any run has")
        if size < 1:
            raise TrainConfigError(f"{where}: size of {name!r} must be positive, got {size}")
        if name in out:
            raise TrainConfigError(f"{where}: {name!r} given twice")
        out[str(name)] = size
    return out


def _short(value: Any, limit: int = 60) -> str:
    """``repr(value)``, cut to ``limit`` characters (a hostile value must not flood the one-line error)."""
    text = repr(value) if not isinstance(value, (dict, list, tuple)) else f"a {type(value).__name__}"
    return text if len(text) <= limit else text[:limit] + "…"


def _in_range(name: str, value: int | float, where: str) -> int | float:
    low, high = RANGES.get(name, (None, None))
    if isinstance(value, int) and not -INT64_MAX <= value <= INT64_MAX:
        raise TrainConfigError(f"{where}: {name} {_short(value)} does not fit a 64-bit integer")
    if low is not None and value < low:
        raise TrainConfigError(f"{where}: {name} must be at least {low:g}, got {value:g}")
    if high is not None and value > high:
        raise TrainConfigError(f"{where}: {name} must be at most {high:g}, got {value:g}")
    return value


def _coerce(name: str, value: Any, where: str) -> Any:
    """``value`` of key ``name`` checked and converted to the field's type."""
    if name == "mesh":
        return parse_mesh(value, where)
    if name == "lora_targets" and isinstance(value, (list, tuple)):  # YAML: a list of module names
        value = ",".join(map(str, value))
    if name == "resume":
        if isinstance(value, bool) or value == "strict":
            return value
        raise TrainConfigError(f"{where}: resume is true, false or strict, got {_short(value)}")
    if name == "adam_betas":
        parts = value.split(",") if isinstance(value, str) else value
        try:
            betas = tuple(float(b) for b in parts)
        except (TypeError, ValueError):
            betas = ()
        if isinstance(parts, bool) or any(isinstance(b, bool) for b in (parts if isinstance(parts, (list, tuple))
                                                                           else ())):
            betas = ()
        if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
            raise TrainConfigError(f"{where}: adam_betas must be two numbers in [0, 1), got {_short(value)}")
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
        if isinstance(value, str) and value.strip().lstrip("-").isdigit() and len(value) < 30:
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):  # 2.7 is refused, not truncated
            raise TrainConfigError(f"{where}: {name} must be a whole number, got {_short(value)}")
        return _in_range(name, value, where)
    if "float" in kind:
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise TrainConfigError(f"{where}: {name} must be a number, got {_short(value)}")
        try:
            number = float(value)
        except (TypeError, ValueError, OverflowError):
            raise TrainConfigError(f"{where}: {name} must be a number, got {_short(value)}") from None
        if not math.isfinite(number):
            raise TrainConfigError(f"{where}: {name} must be a finite number, got {_short(value)}")
        return _in_range(name, number, where)
    if not isinstance(value, str):
        raise TrainConfigError(f"{where}: {name} must be a string, got {_short(value)}")
    if "\x00" in value:
        raise TrainConfigError(f"{where}: {name} holds a NUL character")
    return value


class Quoted(str):
    """A YAML string written in quotes (``seq_len: "1024"``): text, never a number."""


def _quoted_number(name: str, value: Any) -> tuple[str, Any] | None:
    """``(key, value)`` where setting ``name`` (from YAML) holds a quoted string in place of a number, else None."""
    if name == "mesh":  # the flag's string ("ep=2") or a mapping of sizes
        return next(((f"{name}: {k}", v) for k, v in value.items() if isinstance(v, Quoted)),
                    None) if isinstance(value, dict) else None
    kind = FIELDS[name].type
    if isinstance(value, Quoted) and ("int" in kind or "float" in kind) and name != "adam_betas":
        return name, value
    return None


def _strict_loader():
    """PyYAML's safe loader, stricter: an alias (``*name``) is refused (expanding them is how a small file grows
    past any memory), a key given twice in one mapping is refused (YAML would keep the last), a file of more
    than ``MAX_CONFIG_NODES`` nodes is refused while it is composed, and quoted strings come as :class:`Quoted`."""
    import yaml

    class StrictLoader(yaml.SafeLoader):
        nodes = 0

        def construct_yaml_str(self, node):
            value = super().construct_yaml_str(node)
            return Quoted(value) if node.style in ("'", '"') else value

        def compose_node(self, parent, index):
            if self.check_event(yaml.AliasEvent):
                event = self.peek_event()
                raise TrainConfigError(f"line {event.start_mark.line + 1}: YAML aliases (*{event.anchor}) are not "
                                       "accepted in a config: write the value out")
            StrictLoader.nodes += 1
            if StrictLoader.nodes > MAX_CONFIG_NODES:
                raise TrainConfigError(f"more than {MAX_CONFIG_NODES} YAML nodes: not a settings file")
            return super().compose_node(parent, index)

        def construct_mapping(self, node, deep=False):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                key = key_node.value if isinstance(key_node, yaml.ScalarNode) else id(key_node)
                if key in seen:
                    raise TrainConfigError(f"line {key_node.start_mark.line + 1}: key {_short(key)} is given twice "
                                           f"(first on line {seen[key]})")
                seen[key] = key_node.start_mark.line + 1
            return super().construct_mapping(node, deep)

    StrictLoader.add_constructor("tag:yaml.org,2002:str", StrictLoader.construct_yaml_str)
    return StrictLoader


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The settings in a YAML file, keys normalised to field names; :class:`TrainConfigError` naming the file and key
    on anything unknown, unreadable, given twice (``seq_len`` and ``seq-len`` too) or of the wrong type."""
    import yaml

    path = Path(path)
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as e:
        raise TrainConfigError(f"{path}: cannot read the config ({e.strerror or e})") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise TrainConfigError(f"{path}: larger than {MAX_CONFIG_BYTES} bytes: not a settings file")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise TrainConfigError(f"{path}: not UTF-8 text (byte offset {e.start})") from None
    loader = _strict_loader()
    try:
        data = yaml.load(text, Loader=loader)  # noqa: S506 - a SafeLoader subclass
    except TrainConfigError as e:
        raise TrainConfigError(f"{path}: {e}") from None
    except (yaml.YAMLError, RecursionError, ValueError, TypeError) as e:
        first = (str(e).splitlines() or [type(e).__name__])[0][:200]
        raise TrainConfigError(f"{path}: not valid YAML ({first})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise TrainConfigError(f"{path}: the config must be a mapping of settings, got {type(data).__name__}")
    out: dict[str, Any] = {}
    given: dict[str, str] = {}
    for key, value in data.items():
        if not isinstance(key, str):
            raise TrainConfigError(f"{path}: setting names are words, got {_short(key)}")
        name = key.replace("-", "_")
        if name not in FIELDS:
            raise TrainConfigError(f"{path}: unknown setting {_short(key)} (settings: {', '.join(FIELDS)})")
        if name in given:
            raise TrainConfigError(f"{path}: {given[name]!r} and {key!r} are the same setting; give it once")
        given[name] = key
        if quoted := _quoted_number(name, value):
            raise TrainConfigError(f"{path}: {quoted[0].replace(name, key, 1)}: {_short(str(quoted[1]))} is quoted: "
                                   "a number is written without quotes (YAML types are exact)")
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
    a("--mesh", default=S, help="extra plans, long context and HSDP replicas, e.g. ep=2,emb=2,replicate=2 or "
                                 "sp=4,cp=2,ep=8 (default: FSDP only)")
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
    a("--resume", nargs="?", const=True, default=S, metavar="strict",
      help="continue from the newest complete checkpoint in --output (a damaged or incomplete newer one is named and "
           "skipped; --resume=strict refuses instead)")
    a("--stop-after", type=int, default=S, help="end this run cleanly after step N (the schedule follows --steps)")
    a("--seed", type=int, default=S, help="data order seed (default 0)")
    a("--dtype", choices=sorted(DTYPES), default=S, help="parameter dtype (default: the checkpoint's)")
    a("--mixed-precision", action=argparse.BooleanOptionalAction, default=S,
      help="bf16 compute with fp32 gradient reduction (FSDP2 mixed precision)")
    a("--recompute", action=argparse.BooleanOptionalAction, default=S,
      help="activation checkpointing of every decoder layer")
    a("--attn-implementation", default=S, help="transformers attention implementation (default: the model's)")
    add_option_arguments(parser)
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
    a("--force", action="store_true", default=S,
      help="replace the run in --output (its checkpoints, exports, events; metrics moved aside) or train into a "
           "non-empty one, and replace existing exports (only once the new export is complete)")
    a("--log-every", type=int, default=S,
      help="a console line every N steps, at evaluations and at the last (default 10)")
    a("--max-line-bytes", type=int, default=S,
      help=f"longest data line (JSONL record, .txt document) read, in bytes (default {DEFAULT_MAX_LINE_BYTES})")
    sft_config.add_arguments(parser)
    add_launcher_arguments(parser)


# The settings that are fields of xpar_zoo.ParallelOptions (the flags of add_option_arguments).
OPTION_FIELDS = tuple(f.name for f in dataclasses.fields(ParallelOptions))


def add_option_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of :class:`~xpar_zoo.ParallelOptions` (default: the ``XPAR_ZOO_*`` variable, else the option's)."""
    S = argparse.SUPPRESS
    a = parser.add_argument
    a("--attention-block-mib", type=float, default=S,
      help="sp/cp masked attention: MiB one block of queries may hold (default 256 on a GPU, 16 on the CPU)")
    a("--cp-attention", choices=CP_ATTENTION, default=S,
      help="cp's plain causal rows on sdpa: lower_right (no dense mask) or dense (default: lower_right on CUDA "
           "and the CPU)")
    a("--mixer-recompute", action=argparse.BooleanOptionalAction, default=S,
      help="sp/cp hybrid mixers: recompute their whole rows in backward (default on)")
    a("--cpu-collectives", choices=CPU_COLLECTIVES, default=S,
      help="CPU meshes: in_place (default) or gloo (FSDP2's own collectives)")


def given_options(settings: object) -> dict[str, Any]:
    """The :class:`~xpar_zoo.ParallelOptions` fields that ``settings`` sets: a :class:`TrainConfig`, or the flags of
    :func:`add_option_arguments` as parsed (``xpar-zoo size``)."""
    return {n: value for n in OPTION_FIELDS if (value := getattr(settings, n, None)) is not None}


def parallel_options(cfg: TrainConfig) -> ParallelOptions:
    """The run's :class:`~xpar_zoo.ParallelOptions`: the settings given, else the ``XPAR_ZOO_*`` variables' values
    (read here, once per run), else the defaults; :class:`TrainConfigError` on a bad variable."""
    try:
        return ParallelOptions.from_env(**given_options(cfg))
    except PlanError as e:
        raise TrainConfigError(str(e)) from None


LAUNCHER_FLAGS = ("nproc_per_node", "nnodes", "node_rank", "master_addr", "master_port")


def add_launcher_arguments(parser: argparse.ArgumentParser) -> None:
    """``--nproc-per-node`` & co.: ``xpar-zoo train`` starts the ranks itself (see :mod:`xpar_zoo.train.launcher`);
    not training settings (not in the config file, not saved)."""
    a = parser.add_argument
    a("--nproc-per-node", type=int, default=None,
      help="start this many ranks on this node (instead of torchrun); with --nnodes, on every node")
    a("--nnodes", type=int, default=1, help="with --nproc-per-node: number of nodes (default 1)")
    a("--node-rank", type=int, default=0, help="with --nproc-per-node: this node's index (default 0)")
    a("--master-addr", default=None, help="with --nproc-per-node: address of node 0 (default 127.0.0.1)")
    a("--master-port", type=int, default=None,
      help="with --nproc-per-node: a free port on node 0 (default: any free port on one node, 29500 on several)")


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


def attention_implementations() -> list[str]:
    """The attention implementations transformers registers (``eager`` and its ``AttentionInterface`` names)."""
    from transformers import AttentionInterface

    return sorted({"eager", *AttentionInterface().valid_keys()})


def validate(cfg: TrainConfig) -> None:
    """Raise :class:`TrainConfigError` on any setting that cannot work: every value of its type, finite and in its
    range (:data:`RANGES`), and the settings consistent with each other."""
    missing = [f"--{n}" for n in REQUIRED if getattr(cfg, n) in (None, "")]
    if cfg.steps is None and cfg.epochs is None:
        missing.append("--steps (or --epochs)")
    if missing:
        raise TrainConfigError(f"missing setting(s): {', '.join(missing)} (flags or keys of --config)")
    for name in FIELDS:  # types, finiteness and ranges first: the checks below compare numbers
        _coerce(name, getattr(cfg, name), f"--{name.replace('_', '-')}")
    sft_config.validate(cfg)
    if cfg.schedule not in SCHEDULES:
        raise TrainConfigError(f"schedule must be one of {', '.join(SCHEDULES)}, got {cfg.schedule!r}")
    if cfg.steps is not None:  # --epochs: checked again once the data gives the steps
        if cfg.warmup > cfg.steps:
            raise TrainConfigError(f"warmup ({cfg.warmup}) is longer than the run (steps {cfg.steps})")
        if cfg.stop_after is not None and not 1 <= cfg.stop_after <= cfg.steps:
            raise TrainConfigError(f"stop_after must be a step in 1 … steps ({cfg.steps}), got {cfg.stop_after}")
    if cfg.dtype is not None and cfg.dtype not in DTYPES:
        raise TrainConfigError(f"dtype must be one of {', '.join(sorted(DTYPES))}, got {cfg.dtype!r}")
    check_sequence_mesh(cfg)
    for name, value in given_options(cfg).items():  # ParallelOptions checks them, one by one to name the flag
        try:
            ParallelOptions(**{name: value})
        except PlanError as e:
            raise TrainConfigError(f"--{name.replace('_', '-')}: {e}") from None
    if cfg.attn_implementation is not None:
        known = attention_implementations()
        if cfg.attn_implementation not in known:
            raise TrainConfigError(f"--attn-implementation {_short(cfg.attn_implementation)} is not one transformers "
                                   f"knows: {', '.join(known)}")


def check_sequence_mesh(cfg: TrainConfig) -> None:
    """``--mesh sp=S,cp=C``: the packed rows of ``--seq-len`` tokens must split over the sequence group (the rule
    of :func:`xpar_zoo.sizing.sequence_parts`, checked at parse time, before any rank starts)."""
    from ..errors import BatchError
    from ..sizing import sequence_parts

    sp, cp = cfg.mesh.get("sp", 1), cfg.mesh.get("cp", 1)
    if sp * cp == 1:
        return
    try:
        sequence_parts(cfg.seq_len, sp, cp)
    except BatchError as e:
        what = ",".join(f"{d}={n}" for d, n in (("sp", sp), ("cp", cp)) if n > 1)
        raise TrainConfigError(f"--seq-len {cfg.seq_len} with --mesh {what}: {str(e).split(';')[0]}; choose a "
                               "--seq-len that does (the rows are packed to exactly --seq-len tokens)") from None
