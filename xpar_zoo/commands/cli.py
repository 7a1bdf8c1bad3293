"""The ``xpar-zoo`` command line (also ``python -m xpar_zoo``)."""

from __future__ import annotations

import argparse
import difflib
import math
import os
import re
import sys
from pathlib import Path

from ..environment import launcher_rank, says_for_every_rank
from ..errors import XparError, counted
from ..parallel.options import ParallelOptions


class _Parser(argparse.ArgumentParser):
    """argparse with usage errors as one line, like every other CLI error: ``xpar-zoo: error: …`` (exit 2)."""

    def error(self, message: str):
        self.exit(2, f"xpar-zoo: error: {message} (see `{self.prog} --help`)\n")


def _cmd_list(args: argparse.Namespace) -> int:
    from .model_cards import render, render_list

    sys.stdout.write(render() if args.markdown else render_list())
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return 0 if run_demo(world=args.world, ep=args.ep, steps=args.steps) else 1


def load_model_config(name: str):
    """A model_type (transformers' default config of that architecture), or a local dir / hub id with config.json."""
    from transformers import AutoConfig

    from ..hub.resolve import resolve_config
    from ..zoo.registry import supported_architectures

    if name in supported_architectures():
        return AutoConfig.for_model(name)
    if "/" not in name and re.fullmatch(r"[\w.-]+", name) and not Path(name).exists():
        from ..errors import UnknownArchitectureError

        close = difflib.get_close_matches(name, supported_architectures(), n=3)
        raise UnknownArchitectureError(
            f"unknown model type {name!r}" + (f" (did you mean {' or '.join(close)}?)" if close else "")
            + "; see `xpar-zoo list`, or give a local directory or a hub id (org/name) with config.json")
    from ..zoo.configs import load_config

    return load_config(resolve_config(name).parent)


def _describe_model(config, name: str) -> str:
    """``NAME: model_type, L layers, P parameters (E experts, top-k)`` of the model the sizer sizes."""
    from .. import sizing

    params = sum(p.numel() for p in sizing.meta_model(config).parameters())
    experts = next((getattr(config, k) for k in ("num_experts", "num_local_experts", "n_routed_experts")
                    if getattr(config, k, None)), None)
    moe = f", {experts} experts, top-{config.num_experts_per_tok}" if experts else ""
    source = f"transformers' default {name} config" if name == config.model_type else config.model_type
    return f"model: {name} ({source}): {config.num_hidden_layers} layers, {sizing.format_count(params)} parameters{moe}"


def _cmd_size(args: argparse.Namespace) -> int:
    import json

    from .. import sizing
    from ..train.config import given_options

    config = load_model_config(args.model)
    common = {"micro_batch": args.micro_batch, "seq": args.seq, "param_dtype": args.dtype, "optimizer": args.optimizer,
                  "recompute": args.recompute, "attention": args.attention,
              "options": ParallelOptions.from_env(**given_options(args))}  # the flags, else XPAR_ZOO_*
    if args.lora_rank is not None:
        parameters = args.lora_parameters
        modules = args.lora_modules.split(",") if args.lora_modules else None
        common.update(lora_rank=args.lora_rank, lora_modules=modules,
                      lora_parameters=None if parameters is None else [p for p in parameters.split(",") if p != "none"])
    if args.simulate:  # the estimate of what the simulation runs: a GPU's choices where the device decides
        from ..sizing.simulate import gpu_path_options

        common["options"] = gpu_path_options(common["options"])
    if args.simulate and args.suggest:
        from ..errors import PlanError

        raise PlanError("--simulate runs one mesh: give it (--ep, --emb, --head, --sp, --cp, --replicate) instead "
                        "of --suggest")
    if (args.ep is not None or args.emb or args.head or args.sp or args.cp or args.replicate != 1
            or not args.suggest):
        sizes = {k: v for k, v in (("ep", args.ep), ("emb", args.emb), ("head", args.head)) if v and v > 1}
        estimates = [sizing.estimate(config, args.world, sizes, args.replicate, sp=args.sp or 1, cp=args.cp or 1,
                                     **common)]
    else:
        budget = args.memory_gib * 2**30 if args.memory_gib else None
        estimates = sizing.suggest(config, args.world, memory_budget=budget, **common)
    if args.simulate:
        return _print_simulation(args, config, estimates[0], sizes, common)
    if args.json:
        print(json.dumps([_estimate_dict(e) for e in estimates], indent=2))
    else:
        print(_describe_model(config, args.model))
        print(f"{config.model_type}: {counted(args.world, 'rank')}, micro-batch {args.micro_batch} x {args.seq} tokens, "
              f"{args.dtype} compute, {args.attention} attention, {args.optimizer}"
              + (", activation checkpointing" if args.recompute else "")
              + (f", LoRA rank {args.lora_rank} (frozen base)" if args.lora_rank else ""))
        if args.suggest and len(estimates) > 1:
            budget = args.memory_gib * 2**30 if args.memory_gib else None
            print("meshes " + sizing.suggest_order(budget, fits=budget is None or any(e.peak_bytes <= budget
                                                                                       for e in estimates)))
        for e in estimates:
            print(sizing.format_estimate(e))
            group = e.mesh.get("sp", 1) * e.mesh.get("cp", 1)
            if group > 1:
                print(f"  sequence: the {group} ranks of an sp x cp group share each micro-batch; "
                      f"{e.tokens_per_rank} tokens per rank outside attention")
            if args.memory_gib and e.peak_bytes > args.memory_gib * 2**30:
                print(f"  (over the {args.memory_gib:g} GiB budget: no mesh of {counted(args.world, 'rank')} fits)")
    return 0


def _estimate_dict(e) -> dict:
    return {"mesh": e.mesh, "placement": e.placement, "tokens_per_rank": e.tokens_per_rank, "memory": e.memory,
            "peak_bytes": e.peak_bytes, "comm": e.comm}


def _print_simulation(args: argparse.Namespace, config, estimate, sizes: dict, common: dict) -> int:
    """``size --simulate``: the estimate, then one rank of the fake world running the real step
    (:mod:`xpar_zoo.sizing.simulate`), side by side."""
    import json

    from .. import sizing
    from ..sizing.simulate import check_simulation, simulate

    check_simulation(config, args.dtype, args.route_imbalance)
    if not args.json:
        print(_describe_model(config, args.model))
        print(sizing.format_estimate(estimate), flush=True)
    sim = simulate(config, args.world, sizes, args.replicate, sp=args.sp or 1, cp=args.cp or 1,
                   route_imbalance=args.route_imbalance, **common)
    if args.json:
        print(json.dumps({"estimate": _estimate_dict(estimate),
                          "simulated": sim.as_dict()}, indent=2))
        return 0
    print(f"  simulated on rank 0 of a fake {args.world}-rank world (real parallelize, one training step, "
          f"{sim.seconds:.0f} s): {sim.routing}; {sim.device}")
    for kind, nbytes in sim.by_kind.items():
        print(f"    {kind:<40} {sizing.format_bytes(nbytes):>12}")
    print(f"    {'peak':<40} {sizing.format_bytes(sim.peak_bytes):>12}")
    print(f"  estimated / simulated peak: {estimate.peak_bytes / sim.peak_bytes:.2f}")
    return 0


def _cmd_to_hf(args: argparse.Namespace) -> int:
    from xpar_zoo.converters.export import export_to_hf

    out = export_to_hf(args.dcp_dir, args.out_dir, model=args.model, dtype=args.dtype,
                       max_shard_size=args.max_shard_size, force=args.force, merge_adapter=args.merge_adapter)
    print(f"wrote {out}")
    return 0


def _cmd_to_dcp(args: argparse.Namespace) -> int:
    from xpar_zoo.converters.to_dcp import convert_to_dcp
    from xpar_zoo.hub.writer import parse_size

    out = convert_to_dcp(args.name_or_dir, args.out_dir, revision=args.revision, force=args.force,
                         max_bytes=parse_size(args.batch_size, "--batch-size"))
    print(f"wrote {out}")
    return 0


def _cmd_inspect(args: argparse.Namespace) -> int:
    import json

    from xpar_zoo.converters.inspect_checkpoint import (
        damage,
        format_report,
        inspect_checkpoint,
    )

    from ..hub.resolve import HubResolutionError, resolve

    path = args.path
    if not Path(path).exists() and "/" in path and not path.startswith((".", "/", "~")):
        path = resolve(path, args.revision).directory  # a hub id: its snapshot (cached, or downloaded)
    elif args.revision:
        raise HubResolutionError(f"--revision {args.revision!r} was given but {path} is a local path")
    info = inspect_checkpoint(path, verify=args.verify)
    print(json.dumps(info, indent=2) if args.json else format_report(info))
    damaged = damage(info)
    if damaged:
        print(f"xpar-zoo: error: damaged checkpoint files: {'; '.join(damaged)}", file=sys.stderr)
        return 2
    return 0


def _cmd_publish(args: argparse.Namespace) -> int:
    from .publish import publish, upload_plan

    url = publish(args.dir, args.repo_id, private=args.private, revision=args.revision, token=args.token,
                  base_model=args.base_model, overwrite_card=args.overwrite_card, dry_run=args.dry_run,
                  strict=args.strict)
    skipped = upload_plan(args.dir)[1]
    if skipped and not args.dry_run:
        print(f"xpar-zoo: skipped (not part of a hub model): {', '.join(skipped)}", file=sys.stderr)
    print(url if args.dry_run else f"published {args.dir} to {args.repo_id}: {url}")
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    from ..parallel.teardown import exit_rank
    from ..train import config_from_args, run
    from ..train.launcher import launch, launched_by_us, under_torchrun
    from ..train.stop import StopAtOnce, Stopped

    rank = launcher_rank()
    with StopAtOnce(rank, "while starting"):
        cfg = config_from_args(args)  # every setting checked before any rank starts
    if args.dry_run:
        from ..train.dry_run import dry_run

        report = dry_run(cfg, world=args.nproc_per_node * args.nnodes if args.nproc_per_node else None)
        if launcher_rank() == 0:
            print(report)
        return 0
    if args.nproc_per_node is not None and not launched_by_us():
        return launch(args.argv, args.nproc_per_node, args.nnodes, args.node_rank, args.master_addr,
                      args.master_port)
    code = 0
    try:
        with StopAtOnce(rank, "while starting", cfg.output):
            run(cfg)
    except Stopped as e:  # SIGINT / SIGTERM: the step finished and a checkpoint was saved (said on rank 0)
        code = e.code
    if launched_by_us() or under_torchrun():  # this process is a rank and nothing else: end it safely
        if code:
            _before_torchruns_report()
        exit_rank(code)
    return code


def _add_train(sub) -> None:
    from ..train.config import add_arguments

    p = sub.add_parser("train", help="train a model (under torchrun for several ranks): data, packing, accumulation, "
                                     "checkpoints and exact resume, metrics, load balancing",
                       description="Train NAME_OR_DIR on --data with its xpar_zoo plan on --mesh; settings from "
                                   "--config (YAML) and flags (flags win). Launch with torchrun for several ranks.")
    add_arguments(p)
    p.set_defaults(func=_cmd_train)


def _positive_int(text: str) -> int:
    """An argparse type: a whole number of at least 1 (argparse names the option in its error)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _positive_number(text: str) -> float:
    """An argparse type: a finite number above 0 (argparse names the option in its error)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number above 0, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="xpar-zoo", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("list", help="architectures: proved (with their plans and meshes) and refused (with the reason)")
    p.add_argument("--markdown", action="store_true", help="print a Markdown table")
    p.set_defaults(func=_cmd_list)
    p = sub.add_parser("demo", help="train a tiny qwen3_moe on CPU ranks and compare with transformers")
    p.add_argument("--world", type=int, default=4, help="number of CPU ranks (default 4)")
    p.add_argument("--ep", type=int, default=2, help="expert-parallel size (default 2)")
    p.add_argument("--steps", type=int, default=5, help="training steps (default 5)")
    p.set_defaults(func=_cmd_demo)
    _add_convert(sub)
    _add_publish(sub)
    _add_size(sub)
    _add_train(sub)
    return parser


def _add_convert(sub) -> None:
    p = sub.add_parser("convert", help="convert checkpoints between the hub's format and xpar_zoo DCP")
    convert = p.add_subparsers(dest="convert_command", required=True)
    c = convert.add_parser("to-hf", help="an xpar_zoo DCP checkpoint -> hub-format safetensors + index + config")
    c.add_argument("dcp_dir", help="a step-N checkpoint directory, or a root (its newest complete checkpoint)")
    c.add_argument("out_dir")
    c.add_argument("--model", help="source hub id or directory: generation/tokenizer files (and config if missing)")
    c.add_argument("--dtype", help="cast floating tensors: bf16, fp16, fp32")
    c.add_argument("--max-shard-size", default="5GB", help="largest output shard (default 5GB)")
    c.add_argument("--force", action="store_true", help="replace an existing OUT_DIR")
    c.add_argument("--merge-adapter", action="store_true",
                   help="a checkpoint of a PEFT LoRA model: merge the adapter into the weights (W + s·BA)")
    c.set_defaults(func=_cmd_to_hf)
    c = convert.add_parser("to-dcp", help="a hub checkpoint (per-expert or fused) -> xpar_zoo DCP, global fused layout")
    c.add_argument("name_or_dir", help="hub id or local directory with config.json and safetensors")
    c.add_argument("out_dir", help="checkpoint root to create (holds step-00000000)")
    c.add_argument("--revision", help="hub revision (branch, tag or commit)")
    c.add_argument("--force", action="store_true", help="replace an existing OUT_DIR")
    c.add_argument("--batch-size", default="1GiB", help="tensors assembled and written at a time (default 1GiB)")
    c.set_defaults(func=_cmd_to_dcp)
    c = convert.add_parser("inspect", help="format, architecture, parameters, dtypes, shards of a checkpoint")
    c.add_argument("path", help="hub-format directory or hub id (org/name), xpar_zoo checkpoint (step dir or root) "
                                "or DCP directory")
    c.add_argument("--revision", help="hub revision of a hub id (branch, tag or commit)")
    c.add_argument("--json", action="store_true", help="machine-readable output")
    c.add_argument("--verify", action="store_true",
                   help="read every file of an xpar_zoo checkpoint and check it against the checksums recorded at "
                        "save (exit status 2 when one is damaged)")
    c.set_defaults(func=_cmd_inspect)


def _add_publish(sub) -> None:
    p = sub.add_parser("publish", help="validate a hub-format folder, write its model card, upload it to the hub")
    p.add_argument("dir", help="hub-format folder (e.g. from convert to-hf)")
    p.add_argument("repo_id", help="hub repository id (org/name)")
    p.add_argument("--private", action="store_true", help="create the repository private")
    p.add_argument("--revision", help="branch to upload to (created if missing)")
    p.add_argument("--token", help="hub token (default: the logged-in one)")
    p.add_argument("--base-model", help="hub id of the base model, for the card (default: from xpar_export.json)")
    p.add_argument("--overwrite-card", action="store_true", help="replace an existing README.md")
    p.add_argument("--dry-run", action="store_true",
                   help="validate and show the card and the files; write nothing, contact no hub")
    p.add_argument("--strict", action="store_true",
                   help="refuse a folder holding anything but the files of a hub model (default: skip them)")
    p.set_defaults(func=_cmd_publish)


def _add_size(sub) -> None:
    from ..train.config import add_option_arguments

    p = sub.add_parser("size", aliases=["plan"],
                       help="per-rank memory and per-step communication of a mesh; suggest meshes")
    p.add_argument("model", help="model_type (its default config), local dir or hub id with config.json")
    p.add_argument("--world", type=_positive_int, required=True, help="number of ranks")
    p.add_argument("--ep", type=_positive_int, help="expert-parallel size (omit with --suggest to rank meshes)")
    p.add_argument("--emb", type=_positive_int, help="vocab-parallel embedding size")
    p.add_argument("--head", type=_positive_int, help="vocab-parallel lm_head size")
    p.add_argument("--sp", type=_positive_int, help="Ulysses sequence-parallel size (at most the query heads)")
    p.add_argument("--cp", type=_positive_int, help="context-parallel size (queries split, keys/values gathered)")
    p.add_argument("--replicate", type=_positive_int, default=1, help="HSDP replicas")
    p.add_argument("--micro-batch", type=_positive_int, default=1, help="sequences per rank per step")
    p.add_argument("--seq", type=_positive_int, default=4096,
                   help="sequence length (of each row; split over the sp x cp ranks; --suggest sizes sp/cp for it)")
    p.add_argument("--attention", default="sdpa",
                   choices=["sdpa", "eager", "flex_attention", "flash_attention_2", "flash_attention_3"],
                   help="the model's attention implementation (eager keeps the seq x seq scores; default sdpa)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32", "fp16"], help="compute dtype")
    p.add_argument("--optimizer", default="adamw", choices=["adamw", "sgd", "sgd_momentum"])
    p.add_argument("--recompute", action="store_true",
                   help="activation checkpointing of every decoder layer (model.activation_checkpointing_enable())")
    add_option_arguments(p)  # xpar-zoo train's
    p.add_argument("--lora-rank", type=_positive_int, help="PEFT LoRA of this rank: count the frozen base, the "
                   "adapters, their gradients and optimizer states")
    p.add_argument("--lora-modules", help="LoRA target_modules, comma-separated (default: every linear but the head)")
    p.add_argument("--lora-parameters", help="LoRA target_parameters, comma-separated, or none (default: the fused "
                   "experts tensors)")
    p.add_argument("--suggest", action="store_true", help="rank the meshes that fit --world")
    p.add_argument("--memory-gib", type=_positive_number, help="per-rank memory budget for --suggest")
    p.add_argument("--simulate", action="store_true", help="also run the real code on one rank of a fake --world "
                   "world (fake tensors, torch's fake process group and memory tracker): the simulated peak by kind")
    p.add_argument("--route-imbalance", type=_positive_number, default=1.0, metavar="F",
                   help="with --simulate: this rank receives F x the mean routed tokens (default 1: balanced)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_cmd_size)



def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    code = _run_command(args)
    if code and args.command == "train":
        _before_torchruns_report()
    return code


def _before_torchruns_report() -> None:
    """Under plain torchrun, on rank 0 of a run that ends non-zero: one line saying that torchrun's own report of
    the ranks' exits follows (it cannot be suppressed) and how to have the ranks started without it."""
    from ..train.launcher import under_torchrun

    if under_torchrun() and says_for_every_rank():
        print("xpar-zoo: torchrun's report of the ranks' exit statuses follows; `xpar-zoo train "
              "--nproc-per-node N` starts the ranks itself and ends with the line above", file=sys.stderr,
              flush=True)


def _run_command(args: argparse.Namespace) -> int:
    """The command's exit status; interrupts, a closed pipe and bad input as one line (rank 0 says it)."""
    try:
        return args.func(args)
    except KeyboardInterrupt:
        if says_for_every_rank():
            print("xpar-zoo: stopped by SIGINT (Ctrl-C)", file=sys.stderr, flush=True)
        return 130
    except BrokenPipeError:  # the reader went away (`| head`): stop quietly, as Unix tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python flushes
        return 141
    except XparError as e:  # bad input: the message names the problem; no traceback
        if says_for_every_rank():  # under torchrun every rank raises it: rank 0 says it once
            print(f"xpar-zoo: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
