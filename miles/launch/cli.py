"""`miles submit|sweep|status|logs|cancel|profiles`: parse, then call miles.launch (imported lazily)."""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path


def _submit(args: argparse.Namespace) -> int:
    from miles.launch.submit import submit

    sub = submit(args.recipe, args.profile, args.set, dry_run=args.dry_run)
    if args.dry_run:
        written = Path(sub.script_path).parent
        print(f"wrote {sub.script_path} and {written / 'plan.yaml'}")
        print(shlex.join(sub.command))
    else:
        print(f"submitted job {sub.job_ids[0]} for {sub.run_dirs[0]}")
    return 0


def _sweep(args: argparse.Namespace) -> int:
    from miles.launch.submit import sweep

    sub = sweep(args.recipe, args.profile, args.set, args.grid, tag=args.tag, dry_run=args.dry_run)
    for i, run_dir in enumerate(sub.run_dirs):
        job = sub.job_ids[i] if sub.job_ids else "(dry-run)"
        print(f"{job}  {run_dir}")
    if args.dry_run:
        for command in [sub.command, *sub.more_commands]:
            print(shlex.join(command))
    return 0


def _status(args: argparse.Namespace) -> int:
    from miles.launch.status import format_table, run_status, sweep_status

    if args.sweep:
        rows = sweep_status(args.runs_root, args.sweep)
    elif args.run_dir:
        rows = [run_status(args.run_dir)]
    else:
        raise SystemExit("miles status: give RUN_DIR or --sweep TAG")
    print(json.dumps(rows, indent=1) if args.json else format_table(rows))
    return 0


def _logs(args: argparse.Namespace) -> int:
    from miles.launch.status import run_logs

    print(run_logs(args.run_dir, args.role))
    return 0


def _cancel(args: argparse.Namespace) -> int:
    from miles.launch.status import cancel

    print(f"cancelled job {cancel(args.run_dir)}")
    return 0


def _profiles(args: argparse.Namespace) -> int:
    from miles.config.profile import known_profiles, load_profile

    if args.profiles_cmd == "list":
        for name in known_profiles():
            p = load_profile(name)
            print(f"{name:8s} {p.vendor:6s} {p.gpus_per_node} x {p.gpu_mem_gb:g} GB  {p.description}")
    elif args.profiles_cmd == "show":
        import yaml

        print(yaml.safe_dump(load_profile(args.name).model_dump(mode="json"), sort_keys=False), end="")
    else:
        from miles.cluster.hardware import detect_profile

        name, reason = detect_profile()
        print(f"{name or 'none'}: {reason}")
        return 0 if name else 1
    return 0


def add_launch_commands(sub: argparse._SubParsersAction) -> None:
    """Add the Slurm-facing commands to the `miles` parser."""
    p = sub.add_parser("submit", help="render (and submit) one Slurm job for a recipe on a hardware profile")
    p.add_argument("recipe")
    p.add_argument("--profile", help="hardware profile (profiles/NAME.yaml or a path); default: the recipe's")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a recipe key")
    p.add_argument(
        "--dry-run", action="store_true", help="write submission.sh + plan.yaml, print the command"
    )
    p.set_defaults(func=_submit)

    p = sub.add_parser("sweep", help="a grid over recipe keys: a job array, or tagged het jobs")
    p.add_argument("recipe")
    p.add_argument("--profile")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--grid", action="append", required=True, metavar="KEY=V1,V2", help="one axis of the grid")
    p.add_argument("--tag", help="sweep tag (default: a timestamp)")
    p.add_argument("--dry-run", action="store_true")
    p.set_defaults(func=_sweep)

    p = sub.add_parser("status", help="state and last metrics of a run or of every point of a sweep")
    p.add_argument("run_dir", nargs="?")
    p.add_argument("--sweep", metavar="TAG")
    p.add_argument("--runs-root", default="runs")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_status)

    p = sub.add_parser("logs", help="the batch log of a run, or one role's step logs")
    p.add_argument("run_dir")
    p.add_argument("--role", choices=["rollout", "actor"])
    p.set_defaults(func=_logs)

    p = sub.add_parser("cancel", help="cancel a run's Slurm job")
    p.add_argument("run_dir")
    p.set_defaults(func=_cancel)

    p = sub.add_parser("profiles", help="hardware profiles: list, show NAME, detect")
    psub = p.add_subparsers(dest="profiles_cmd", required=True)
    psub.add_parser("list")
    psub.add_parser("show").add_argument("name")
    psub.add_parser("detect")
    p.set_defaults(func=_profiles)
