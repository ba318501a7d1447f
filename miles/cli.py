"""The `miles` command: train, submit and sweep RL post-training jobs, and watch, evaluate and export them.

Thin: it parses arguments and calls the package that does the work, each imported only when its
command runs, so that `miles submit` on a login node never imports torch.
"""

from __future__ import annotations

import argparse
import logging
import sys

from miles.config import ConfigError
from miles.eval.cli import add_eval_command
from miles.launch.cli import add_launch_commands


def _cmd_model_init_tiny(args: argparse.Namespace) -> int:
    from miles.models.tiny import init_tiny

    sizes = dict(kv.split("=", 1) for kv in args.size)
    path = init_tiny(args.dir, arch=args.arch, seed=args.seed, **{k: int(v) for k, v in sizes.items()})
    print(f"wrote tiny {args.arch} model to {path}")
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    from miles.launch.local import train_main

    return train_main(args.recipe, args.set, resume=args.resume, overwrite=args.overwrite)


def _cmd_plot(args: argparse.Namespace) -> int:
    from miles.metrics import plot_run

    for path in plot_run(args.run_dir):
        print(path)
    return 0


def _add_model(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("model", help="model utilities")
    msub = p.add_subparsers(dest="model_cmd", required=True)
    q = msub.add_parser("init-tiny", help="write a tiny random model + tokenizer for tests and CPU runs")
    q.add_argument("dir")
    q.add_argument("--arch", default="qwen2", choices=["qwen2", "qwen3", "llama", "qwen3_moe"])
    q.add_argument("--seed", type=int, default=0)
    q.add_argument(
        "--size",
        action="append",
        default=[],
        metavar="KEY=N",
        help="override a config size, e.g. --size hidden_size=128",
    )
    q.set_defaults(func=_cmd_model_init_tiny)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="miles", description=__doc__.splitlines()[0])
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="log derived values and progress details"
    )
    sub = parser.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("train", help="run a whole RL job on this host (engines, trainer ranks, loop)")
    p.add_argument("recipe", help="recipe YAML")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a recipe key")
    p.add_argument(
        "--resume", metavar="RUN_DIR", help="continue a stopped run from its last complete checkpoint"
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="start afresh in a run directory that holds an earlier run, deleting its outputs",
    )
    p.set_defaults(func=_cmd_train)

    p = sub.add_parser("plot", help="write PNG curves of a run's metrics into RUN_DIR/plots")
    p.add_argument("run_dir")
    p.set_defaults(func=_cmd_plot)

    _add_model(sub)
    add_launch_commands(sub)
    add_eval_command(sub)
    from miles.agentic.harbor.cli import add_tasks_command
    from miles.dashboard.cli import add_dashboard_command
    from miles.export import add_export_command

    add_dashboard_command(sub)
    add_export_command(sub)
    add_tasks_command(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    try:
        return int(args.func(args) or 0)
    except ConfigError as e:
        print(f"miles: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C outside a run's own handler (preparing a model, a download)
        print("miles: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
