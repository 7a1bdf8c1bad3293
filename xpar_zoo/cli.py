"""The ``xpar-zoo`` command line (also ``python -m xpar_zoo``)."""

from __future__ import annotations

import argparse
import sys


def _cmd_list(args: argparse.Namespace) -> int:
    from .registry import get_plan, supported_architectures

    rows = []
    for model_type in supported_architectures():
        plan = get_plan(model_type)
        plans = ", ".join(f"{n} ({e.style})" for n, e in plan.extra.items())
        rows.append((model_type, plans, ", ".join(plan.hub_ids)))
    if args.markdown:
        print("| model_type | plans | example hub ids |\n|---|---|---|")
        for r in rows:
            print(f"| {' | '.join(r)} |")
    else:
        width = max(len(r[0]) for r in rows) if rows else 0
        for model_type, plans, hub in rows:
            print(f"{model_type:<{width}}  {plans}  [{hub}]")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return 0 if run_demo(world=args.world, ep=args.ep, steps=args.steps) else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="xpar-zoo", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("list", help="architectures with a plan")
    p.add_argument("--markdown", action="store_true", help="print a Markdown table")
    p.set_defaults(func=_cmd_list)
    p = sub.add_parser("demo", help="train a tiny qwen3_moe on CPU ranks and compare with transformers")
    p.add_argument("--world", type=int, default=4, help="number of CPU ranks (default 4)")
    p.add_argument("--ep", type=int, default=2, help="expert-parallel size (default 2)")
    p.add_argument("--steps", type=int, default=5, help="training steps (default 5)")
    p.set_defaults(func=_cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
