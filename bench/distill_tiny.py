"""On-policy distillation vs GRPO alone on the CPU, from the same start (recipes/default.yaml).

    python -m bench.distill_tiny [--steps 150] [--teacher-steps 400] [--seeds 0 1] [--workdir runs/bench_distill]
                                 [--mode logprob|topk_reverse_kl] [--coef 1.0] [--top-k 20]

1. The teacher: `make run`'s recipe trained for --teacher-steps, exported to an HF directory
   (skipped when WORKDIR/teacher-hf exists).
2. Per seed, two students from the same fresh tiny model as the teacher started from, --steps each, the
   default recipe otherwise (GRPO, fully async, held-out pass@1 every 25 steps on 32 prompts x 4
   samples): GRPO alone, and GRPO + `train.distill` (teacher_model = the teacher, --mode, --coef).
Printed: held-out pass@1 at every evaluation of every run, the teacher's final pass@1, and the first
step at which each student reached it (or "not reached").
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import yaml

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "default.yaml"


def _run(work: Path, name: str, changes: dict) -> list[dict]:
    from miles.launch.local import train_main
    from miles.metrics import read_metrics

    data = yaml.safe_load(RECIPE.read_text())
    for section, values in changes.items():
        data.setdefault(section, {}).update(values)
    data["run"].update(name=name, runs_root=str(work / "runs"), tensorboard=False)
    data["model"].update(path=str(work / "student-start"))
    path = work / f"recipe-{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    rc = train_main(str(path), progress=False, overwrite=True)
    if rc != 0:
        raise SystemExit(f"{name} failed ({rc}); logs in {work / 'runs' / name / 'logs'}")
    return [r for r in read_metrics(work / "runs" / name) if "eval/pass@1" in r]


def _teacher(work: Path, steps: int) -> tuple[Path, float]:
    from miles.export import export_run

    out = work / "teacher-hf"
    evals = _run(work, "teacher", {"train": {"steps": steps}}) if not out.exists() else None
    if evals is not None:
        export_run(work / "runs" / "teacher", out)
    from miles.metrics import read_metrics

    rows = [r for r in read_metrics(work / "runs" / "teacher") if "eval/pass@1" in r]
    return out, rows[-1]["eval/pass@1"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--teacher-steps", type=int, default=400)
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--workdir", default="runs/bench_distill")
    p.add_argument("--out", default=None)
    p.add_argument("--mode", choices=["logprob", "topk_reverse_kl"], default="logprob")
    p.add_argument("--coef", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=20)
    a = p.parse_args()
    work = Path(a.workdir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    teacher, target = _teacher(work, a.teacher_steps)
    results = {"teacher_pass@1": target, "mode": a.mode, "coef": a.coef, "runs": {}}
    distill = {"teacher_model": str(teacher), "coef": a.coef, "mode": a.mode, "top_k": a.top_k}
    for seed in a.seeds:
        for arm, extra in (("grpo", {}), ("opd", {"distill": distill})):
            evals = _run(
                work, f"{arm}-s{seed}", {"run": {"seed": seed}, "train": {"steps": a.steps, **extra}}
            )
            curve = [(r["step"], r["eval/pass@1"]) for r in evals]
            reached = next((step for step, v in curve if v >= target), None)
            results["runs"][f"{arm}-s{seed}"] = {"curve": curve, "reached_teacher_at": reached}
            print(f"{arm} seed {seed}: " + " ".join(f"{s}:{v:.3f}" for s, v in curve)
                  + f"  teacher {target:.3f} reached at step {reached if reached is not None else 'not reached'}",
                  flush=True)  # fmt: skip
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
