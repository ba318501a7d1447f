"""The `miles` command: train, submit and sweep RL post-training jobs, and watch, evaluate and export them.

Thin: it parses arguments and calls the package that does the work, each imported only when its
command runs, so that `miles submit` on a login node never imports torch.
"""

from __future__ import annotations

import argparse
import logging
import sys

from miles.config import ConfigError
from miles.launch.cli import add_launch_commands
from miles.models.families import FAMILIES


def _cmd_model_init_tiny(args: argparse.Namespace) -> int:
    from miles.models.tiny import init_tiny

    sizes = dict(kv.split("=", 1) for kv in args.size)
    path = init_tiny(
        args.dir, arch=args.arch, seed=args.seed, mtp=args.mtp, **{k: int(v) for k, v in sizes.items()}
    )
    print(f"wrote tiny {args.arch} model to {path}")
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    from miles.launch.local import train_main

    return train_main(args.recipe, args.set, resume=args.resume, overwrite=args.overwrite)


def _cmd_eval(args: argparse.Namespace) -> int:
    """Evaluate one step here (miles.eval.runner), or submit its evaluation as a Slurm job
    (miles.launch.eval_job) once the step is known to have a snapshot or a checkpoint."""
    if not args.submit:
        from miles.eval.runner import snapshot_main

        return snapshot_main(args)
    from miles.eval.snapshot import find_snapshot
    from miles.launch.eval_job import submit_eval
    from miles.train.checkpoint import complete_steps

    try:
        if args.step not in complete_steps(args.run_dir):
            find_snapshot(args.run_dir, args.step)
        sub = submit_eval(
            args.run_dir, args.step, profile=args.profile, mode=args.mode, fn=args.fn, dry_run=args.dry_run
        )
    except FileNotFoundError as e:
        raise ConfigError(str(e)) from None
    if sub.job_id is None:
        print(f"wrote {sub.script_path}")
        print(" ".join(sub.command))
    else:
        print(f"submitted job {sub.job_id}: evaluation of step {args.step}, in {sub.job_dir}")
    return 0


def _add_eval(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="evaluate one step of a run (here, or --submit to Slurm)")
    p.add_argument("run_dir", help="the run directory")
    p.add_argument(
        "--step", type=int, required=True, help="the step to evaluate (a snapshot or a checkpoint)"
    )
    p.add_argument("--mode", choices=["dedicated", "external"], help="default: the run's eval.mode")
    p.add_argument("--fn", help="an external eval function (module:function); implies --mode external")
    p.add_argument("--out", help="result JSON (default RUN_DIR/eval/step_N/manual.json)")
    p.add_argument("--submit", action="store_true", help="run it as a Slurm job of its own")
    p.add_argument("--profile", help="hardware profile of the job (default: the run's launch.profile)")
    p.add_argument("--dry-run", action="store_true", help="with --submit: write the script, do not submit")
    p.set_defaults(func=_cmd_eval)


def _cmd_plot(args: argparse.Namespace) -> int:
    from miles.metrics import plot_run, run_summary

    for path in plot_run(args.run_dir):
        print(path)
    print(run_summary(args.run_dir))
    return 0


def _add_model(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("model", help="model utilities")
    msub = p.add_subparsers(dest="model_cmd", required=True)
    q = msub.add_parser("init-tiny", help="write a tiny random model + tokenizer for tests and CPU runs")
    q.add_argument("dir")
    q.add_argument("--arch", default="qwen2", choices=sorted(f.model_type for f in FAMILIES.values()))
    q.add_argument("--seed", type=int, default=0)
    q.add_argument(
        "--size",
        action="append",
        default=[],
        metavar="KEY=N",
        help="override a config size, e.g. --size hidden_size=128",
    )
    q.add_argument(
        "--mtp",
        action="store_true",
        help="add a random multi-token-prediction layer (config num_nextn_predict_layers: 1), the draft "
        "of the engine's --speculative-algorithm NEXTN",
    )
    q.set_defaults(func=_cmd_model_init_tiny)


def _cmd_align(args: argparse.Namespace) -> int:
    from miles.align import main

    try:
        return main(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"miles align: error: {e}", file=sys.stderr)
        return 2


def _add_align(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "align",
        help="score one generation with the engine and the trainer; |delta log p| and the first module that differs",
    )
    p.add_argument("model", help="a local Hugging Face model directory")
    p.add_argument("--backend", choices=["fsdp", "megatron"], default="fsdp")
    p.add_argument("--prompts", help="a file of prompts: one per line, text or JSON with a 'prompt' key")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument(
        "--tolerance", type=float, help="module rel difference counted as divergent (default 1e-3; bf16 5e-2)"
    )
    p.add_argument("--no-replay", action="store_true", help="MoE: the trainer routes on its own (no R3)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="also write the summary figures to this file")
    p.set_defaults(func=_cmd_align)


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
    _add_align(sub)
    add_launch_commands(sub)
    _add_eval(sub)
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
