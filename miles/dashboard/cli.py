"""`miles dashboard RUN_DIR ...`: argument parsing only; the app is miles/dashboard/app.py."""

from __future__ import annotations

import argparse


def _cmd_dashboard(args: argparse.Namespace) -> int:
    from miles.dashboard.app import serve
    from miles.serving import ApiKeys

    try:
        keys = ApiKeys.from_files(args.api_key_file, None)
        return serve(
            args.run_dirs,
            host=args.host,
            port=args.port,
            keys=keys,
            allow_unauthenticated=args.allow_unauthenticated,
        )
    except (ValueError, OSError) as e:
        print(f"miles dashboard: error: {e}")
        return 2


def add_dashboard_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "dashboard",
        help="a read-only web view of runs (curves, engines, trainer ranks, Slurm job, samples)",
        description="Serve a live, read-only web view of one or several runs side by side. Each "
        "argument is a run directory, a directory of run directories (e.g. a runs root), or a sweep "
        "record <runs_root>/sweeps/<tag>.json.",
    )
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=0, help="port to bind (default 0: one the OS picks, printed)")
    p.add_argument("--api-key-file", default=None, help="file with the key every page needs (mode 600)")
    p.add_argument(
        "--allow-unauthenticated",
        action="store_true",
        help="serve on a non-loopback --host without --api-key-file (anyone who can reach it sees the runs)",
    )
    p.set_defaults(func=_cmd_dashboard)
