"""A frozen speculative draft against one trained with the policy (`train.draft`), on the CPU.

    python -m bench.spec_draft [--steps 200] [--seed 0] [--draft-lr 3e-4] [--out F.json] [--plot F.png]
    python -m bench.spec_draft --draft mtp ...   # NEXTN: the policy's own MTP layer
    python -m bench.spec_draft --arms plain frozen online ...   # rollout seconds per step beside plain
    python -m bench.spec_draft --task longtail --new 512 --arms plain frozen online --steps 10   # a long tail

The policy: recipes/default.yaml's tiny model and digits task, with room for speculation (up to
`--new` new tokens a response, `--k` draft tokens per verify) and a synchronous schedule. The draft:
a copy of the policy's initial weights, so at step 1 it proposes exactly the policy's distribution
(acceptance ~1 under speculative sampling); as the policy learns, a frozen draft falls behind it,
while the online draft learns the policy's own samples every step. Per arm, per step:
rollout/spec_accept_rate (draft tokens kept / proposed) and rollout/spec_accept_length (tokens per
verify forward), plus the eval reward at every `--eval-every` steps. Writes the per-step curves to
--out and draws both acceptance curves to --plot.

`--arms` adds "plain" (no speculation) to "frozen" and "online": each arm's time/rollout_s per step
(median and the steps' sum) is reported beside the curves, so on a GPU (devices `auto`) the same command
gives the rollout time with and without speculation, plain first.

`--task longtail` swaps the digits task for `longtail` (rollout.task: response lengths Pareto(`--alpha`)
between 8 and `--new` tokens, enforced with ignore_eos; no eval): each synchronous step ends with its
few longest responses decoding at small batch, the case speculation is for, so `--arms plain frozen
online --task longtail --new 512` gives the rollout time of a long-tailed step with and without it. The
engine then chooses where to speculate as it does by default (engine.speculative max_batch 32, adaptive);
the digits arms speculate in every step (their figure is the acceptance).

`--draft mtp`: the tiny policy gets a random MTP layer (`model.tiny.mtp`) and the engine drafts with it
(engine.speculative.algorithm NEXTN); frozen, the random layer keeps what chance gives it, online
(train.draft) it learns the policy's next-next tokens from the policy's hidden states.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run_arm(name: str, online: bool | None, args, work: Path, model: Path) -> dict:
    """One arm: `online` True / False (the draft trained / frozen), None (no speculation)."""
    from miles.launch.local import train_main
    from miles.metrics import read_metrics

    sets = [f"run.name={name}", f"run.seed={args.seed}", f"run.runs_root={work / 'runs'}", "run.tensorboard=false",
            f"model.path={model}", "model.init_tiny_if_missing=false", f"rollout.max_new_tokens={args.new}",
            "rollout.schedule=sync", f"train.steps={args.steps}", "train.checkpoint.every_steps=0",
            f"eval.every_steps={args.eval_every}", f"engine.speculative.num_steps={args.k}",
            "engine.speculative.max_batch=1000000", "engine.speculative.adaptive=false"]  # every step speculates: acceptance over whole steps  # fmt: skip
    if args.task == "longtail":  # a few long responses per step, decoded at small batch at its end
        # the engine's own choice of when to speculate (engine.speculative.max_batch 32, adaptive)
        sets = [
            x
            for x in sets
            if x.split("=")[0] not in ("engine.speculative.max_batch", "engine.speculative.adaptive")
        ]
        sets += [f"rollout.task={{name: longtail, eval_size: 8, options: {{min_tokens: 8, max_tokens: {args.new}, "
                 f"alpha: {args.alpha}}}}}", "eval.every_steps=0"]  # fmt: skip
    if online is None:
        sets = [x for x in sets if not x.startswith("engine.speculative.")]
        sets.append("engine.speculative=null")
    elif args.draft == "mtp":
        sets.append("engine.speculative.algorithm=NEXTN")
    else:
        draft = work / "draft"  # the initial policy's weights, written once
        if not (draft / "config.json").exists():
            shutil.copytree(model, draft)
        sets.append(f"engine.speculative.draft_model_path={draft}")
    if online:
        sets.append(f"train.draft.lr={args.draft_lr}")
    rc = train_main(str(REPO / "recipes" / "default.yaml"), sets, progress=False, overwrite=True)
    rows = [r for r in read_metrics(work / "runs" / name) if r.get("step", 0) > 0]
    curve = [(r["step"], r["rollout/spec_accept_rate"], r["rollout/spec_accept_length"])
             for r in rows if "rollout/spec_accept_rate" in r]  # fmt: skip
    evals = [
        (r["step"], r["eval/reward_mean"])
        for r in read_metrics(work / "runs" / name)
        if "eval/reward_mean" in r
    ]
    kind = "MTP layer (NEXTN)" if args.draft == "mtp" else "draft model (STANDALONE)"
    rollout_s = [r["time/rollout_s"] for r in rows if "time/rollout_s" in r]
    return dict(name=name, online=online, rc=rc, curve=curve, evals=evals, kind=kind, rollout_s=rollout_s)


def _window(curve: list, lo: int, hi: int) -> float:
    vals = [rate for step, rate, _ in curve if lo <= step <= hi]
    return statistics.mean(vals) if vals else float("nan")


def plot(arms: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for arm in arms:
        if arm["online"] is None:
            continue
        steps = [s for s, _, _ in arm["curve"]]
        ax.plot(
            steps,
            [r for _, r, _ in arm["curve"]],
            label=("online " if arm["online"] else "frozen ") + arm.get("kind", "draft"),
        )
    ax.set_xlabel("training step")
    ax.set_ylabel("rollout/spec_accept_rate")
    ax.set_ylim(0, 1.02)
    ax.legend()
    ax.set_title("Draft acceptance as the policy learns (tiny model, digits task, CPU)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--new", type=int, default=8)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--draft-lr", type=float, default=3e-4)
    p.add_argument("--draft", choices=["model", "mtp"], default="model", help="STANDALONE or NEXTN")
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument(
        "--task",
        choices=["digits", "longtail"],
        default="digits",
        help="longtail: Pareto(--alpha) response lengths from 8 to --new tokens (ignore_eos), no eval",
    )
    p.add_argument("--alpha", type=float, default=0.8)
    p.add_argument("--arms", nargs="+", choices=["plain", "frozen", "online"], default=["frozen", "online"])
    p.add_argument("--workdir", default=tempfile.mkdtemp(prefix="bench-spec-draft-"))
    p.add_argument("--out")
    p.add_argument("--plot")
    args = p.parse_args(argv)
    from miles.models.tiny import init_tiny

    work = Path(args.workdir)
    model = work / "policy"
    if not (model / "config.json").exists():
        init_tiny(model, seed=args.seed, mtp=args.draft == "mtp")
    online = {"plain": None, "frozen": False, "online": True}
    arms = [run_arm(name, online[name], args, work, model) for name in args.arms]
    n = args.steps
    for arm in arms:
        first, last = _window(arm["curve"], 1, 20), _window(arm["curve"], n - 19, n)
        times = arm["rollout_s"]
        median = statistics.median(times) if times else float("nan")
        print(f"{arm['name']}: rc {arm['rc']}, accept rate steps 1-20 {first:.3f}, steps {n - 19}-{n} {last:.3f}, "
              f"rollout s/step median {median:.3f} (sum {sum(times):.1f}), eval {arm['evals']}")  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps(dict(args=vars(args), arms=arms), indent=1))
    if args.plot:
        plot(arms, args.plot)
    return 0 if all(a["rc"] == 0 for a in arms) else 1


if __name__ == "__main__":
    sys.exit(main())
