"""`miles export RUN_DIR [--step N] OUT`: a run's checkpoint as a Hugging Face model directory."""

from __future__ import annotations

import argparse


def _cmd_export(args: argparse.Namespace) -> int:
    out = export_run(args.run_dir, args.out, step=args.step)
    print(f"wrote {out}")
    return 0


def add_export_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export",
        help="write a checkpoint as a Hugging Face model directory (safetensors, config, tokenizer)",
    )
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("out", metavar="OUT", help="directory to write (created; must be empty if it exists)")
    p.add_argument("--step", type=int, help="checkpoint step (default: the newest complete one that verifies)")
    p.set_defaults(func=_cmd_export)


def export_run(run_dir: str, out: str, step: int | None = None) -> str:
    raise NotImplementedError
