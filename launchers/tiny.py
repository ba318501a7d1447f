"""The default recipe on the `local` profile: the tiny RL job as a het job on the one-host dev cluster.

make slurm-up && python launchers/tiny.py [--dry-run] [--set train.steps=2 ...]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "slurm-tiny.yaml"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--dry-run", action="store_true")
    args = p.parse_args(argv)
    from miles.launch.submit import submit

    sub = submit(str(RECIPE), "local", args.set, dry_run=args.dry_run)
    print(f"{'rendered' if args.dry_run else 'submitted ' + sub.job_ids[0]}: {sub.script_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
