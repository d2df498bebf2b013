"""`posttrain <command>`: the command line. Each command parses its arguments and hands off to one module."""

from __future__ import annotations

import argparse
import sys


def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", "-c", help="a YAML file, or the name of a shipped recipe (e.g. grpo)")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. algorithm.adv_estimator=grpo")


def _load(args):
    from .config import config_warnings, load_config

    cfg = load_config(args.config, args.overrides)
    for note in config_warnings(cfg):
        print(f"note: {note}", file=sys.stderr)
    return cfg


def cmd_train(args) -> int:
    cfg = _load(args)
    if args.print_config:
        from .config import to_yaml

        print(to_yaml(cfg), end="")
        return 0
    from .trainer.rl import run_rl

    run_rl(cfg)
    return 0


def cmd_prepare(args) -> int:
    from .data.preprocess import prepare

    summary = prepare(args.dataset, args.input, args.output_dir, fmt=args.format)
    for split, (path, rows) in summary.items():
        print(f"{split}: {rows} rows -> {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="posttrain", description="Reinforcement-learning post-training for LMs.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="RL training (PPO, GRPO, ...) from config keys")
    _config_args(p)
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("prepare", help="turn GSM8K / MATH original files into the RL data layout")
    p.add_argument("dataset", choices=["gsm8k", "math"])
    p.add_argument("--input", default=None, help="original file or folder (default: the shared data folder)")
    p.add_argument("--output-dir", default=None, help="where to write train/test files (default: data/<dataset>)")
    p.add_argument("--format", default="parquet", choices=["parquet", "jsonl"])
    p.set_defaults(func=cmd_prepare)
    return parser


def main(argv: list[str] | None = None) -> int:
    from .config import ConfigError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
