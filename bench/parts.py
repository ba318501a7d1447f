"""The part runner and report shared by the one-command GPU benchmarks (bench/fp8_gpu.py, bench/moe_gpu.py):
parts selected by --part run in a fixed order, a failing part is reported and the next still runs, and
--out keeps the raw numbers as each part ends."""

from __future__ import annotations

import gc
import json
import traceback
from pathlib import Path

import torch


def free_memory() -> None:
    """Return what the finished part held: Python garbage, then the CUDA allocator's cache."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_parts(args, order: tuple[str, ...], runners: dict, results: dict) -> dict[str, str]:
    """Each part of `order` that --part selects, in that order: results[part] filled (and --out rewritten)
    as each ends; a part that raises is reported by the table and the next one still runs. Returns
    part -> error."""
    errors = {}
    for part in [p for p in order if p in (args.part or order)]:
        try:
            results[part] = runners[part]()
        except Exception as exc:
            traceback.print_exc()
            errors[part] = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:300]}"
            free_memory()
        if args.out:
            Path(args.out).write_text(json.dumps(results | {"errors": errors}, indent=1))
    return errors


def report(
    args, lines: list[str], sections: list[tuple[str, str, object]], results: dict, errors: dict
) -> int:
    """Print the header `lines` and one markdown section per (part, title, table function) that ran,
    keep everything in --out; the exit status: 1 when a part failed or one of its rows says "failed"."""
    for part, title, table in sections:
        if part in results or part in errors:
            body = table(results[part]) if part in results else [f"failed: {errors[part]}"]
            lines += [f"#### {title}", "", *body, ""]
    print("\n" + "\n".join(lines), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results | {"errors": errors, "table": lines}, indent=1))
        print(f"raw numbers in {args.out}")
    rows = [r for part in results.values() if isinstance(part, list) for r in part]
    return 1 if errors or any(isinstance(r, dict) and "failed" in r for r in rows) else 0
