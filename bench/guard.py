"""`python -m bench.guard`: the headline speed figures of this tree against bench/baseline.json.

    python -m bench.guard --out $OUT/guard.json            # GPU: every figure below (one H200: ~9 min)
    python -m bench.guard --only e2e_megatron --only engine  # some of the runs
    python -m bench.guard --cpu                              # CPU: tiny shapes, ratios (~2 min)
    python -m bench.guard --out guard.json --write-baseline  # take this run as the new baseline
    python -m bench.guard --commit abc1234 ...               # a copy whose git history is not the code's

Each figure comes from one existing benchmark run as a child process (its command is printed and kept
in the output), is compared with its baseline entry (value, commit, date, machine, tolerance) and
printed in one table. A figure worse than its baseline by more than its tolerance (10% unless the
entry says otherwise) fails the guard: the exit status is 1 and the figure is named. A figure with
no baseline entry for this mode is reported, not judged. A benchmark that fails is a failed figure.
GPU baselines are kept per card (`gpu.H200`, `gpu.H100`, ..., each figure with its commit and date):
a figure is judged only against the same card's entry, and `--write-baseline` replaces only this
card's (a card's model is read from the device name: H100, H200, MI355X, ...).

GPU figures: the end-to-end synchronous GRPO step (bench/e2e_gpu.py: colocated, Megatron and FSDP; the
Megatron run's training MFU as well), the engine's decode throughput in process and over HTTP
(bench/engine_gpu.py), MoE decode at 256 and 32 requests (bench/moe_gpu.py, one round) and FP8
(fp8_row) decode at 7B shapes (bench/fp8_gpu.py, one round).

CPU figures are ratios measured in one process, so that they travel between machines: packed-row
attention (miles/train/varlen_attention.py) against right-padded rows on a long-tailed length mix,
forward + backward (a T x T mask instead of sequence offsets shows here as a ratio far below 1), the
embedded engine against transformers' `generate` (bench/engine_decode.py, long-tailed workload), and
the engine's MoE layer (router + experts by its CPU path, miles/engine/moe.py) against transformers'
eager Qwen3-MoE block on the same weights and tokens (a per-token or dense expert path shows as a
ratio far below 1; the Triton kernels of the CUDA path have no CPU counterpart).
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

BASELINE = Path(__file__).with_name("baseline.json")
DEFAULT_TOLERANCE = 0.10


@dataclass(frozen=True)
class Figure:
    name: str
    run: str
    """Key of the run (RUNS) whose JSON output holds the figure."""
    read: Callable[[dict], float]
    higher_is_better: bool
    unit: str


def _moe(workload: str) -> Callable[[dict], float]:
    return lambda r: statistics.median(
        next(x for x in r["decode"] if x["model"] == "MoE" and x["workload"] == workload)["tok_s"]
    )


def _fp8_7b(r: dict) -> float:
    rows = r["rollout"]
    return statistics.median(
        next(
            x
            for x in rows
            if x["size"] == "7b" and x["workload"] == "decode" and x["arm"].startswith("fp8_row")
        )["tok_s"]
    )


E2E = ["bench.e2e_gpu", "--layout", "colocated", "--steps", "4", "--tag", "guard"]
RUNS: dict[str, dict[str, list[str]]] = {
    "gpu": {
        "e2e_megatron": [*E2E, "--backend", "megatron"],
        "e2e_fsdp": [*E2E, "--backend", "fsdp"],
        "engine": ["bench.engine_gpu", "--skip-eager", "--skip-hf"],
        "moe": ["bench.moe_gpu", "--part", "decode", "--rounds", "1"],
        "fp8": ["bench.fp8_gpu", "--part", "rollout", "--sizes", "7b", "--rounds", "1"],
    },
    "cpu": {
        "attention": ["bench.guard", "--attention-probe"],
        "engine_cpu": ["bench.engine_decode", "--workload", "long-tailed", "--requests", "96"],
        "moe_cpu": ["bench.guard", "--moe-probe"],
    },
}
FIGURES: dict[str, list[Figure]] = {
    "gpu": [
        Figure("e2e_sync_megatron_step_s", "e2e_megatron", lambda r: r["time/step_s"], False, "s"),
        Figure("e2e_sync_megatron_train_mfu", "e2e_megatron", lambda r: r["train_mfu"]["mfu"], True, ""),
        Figure("e2e_sync_fsdp_step_s", "e2e_fsdp", lambda r: r["time/step_s"], False, "s"),
        Figure(
            "engine_in_process_tok_s", "engine", lambda r: r["engine_graph"]["tokens_per_s"], True, "tok/s"
        ),
        Figure("engine_http_tok_s", "engine", lambda r: r["engine_http"]["tokens_per_s"], True, "tok/s"),
        Figure("moe_decode_256_tok_s", "moe", _moe("decode-heavy"), True, "tok/s"),
        Figure("moe_decode_32_tok_s", "moe", _moe("small batch"), True, "tok/s"),
        Figure("fp8_row_7b_decode_tok_s", "fp8", _fp8_7b, True, "tok/s"),
    ],
    "cpu": [
        Figure("packed_vs_padded_attention", "attention", lambda r: r["padded_s"] / r["packed_s"], True, "x"),
        Figure(
            "engine_vs_generate", "engine_cpu", lambda r: r["long-tailed"]["engine_vs_generate"], True, "x"
        ),
        Figure("moe_engine_vs_eager", "moe_cpu", lambda r: r["eager_s"] / r["engine_s"], True, "x"),
    ],
}


def _fastest(fn, rounds: int = 7) -> float:
    """Seconds of the fastest of `rounds` timed calls after one untimed (the least disturbed by load)."""
    fn()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def attention_probe(out: Path) -> None:
    """Packed rows (sequence offsets) vs right-padded rows, forward + backward on the CPU: 32 sequences
    of lengths uniform in 16..512, 4 heads of 32, fp32; the fastest of 7 timed rounds after one (the least disturbed by other load)."""
    import random

    import torch
    import torch.nn.functional as F

    from miles.train.varlen_attention import packed_causal_attention

    torch.manual_seed(0)
    lengths = [random.Random(i).randint(16, 512) for i in range(32)]
    total, longest = sum(lengths), max(lengths)
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    offsets[1:] = torch.tensor(lengths).cumsum(0)
    packed = [torch.randn(total, 4, 32, requires_grad=True) for _ in range(3)]
    padded = [torch.randn(len(lengths), 4, longest, 32, requires_grad=True) for _ in range(3)]

    def run_packed():
        packed_causal_attention(*packed, offsets, longest).sum().backward()

    def run_padded():
        F.scaled_dot_product_attention(*padded, is_causal=True).sum().backward()

    res = {"lengths": lengths, "packed_s": _fastest(run_packed), "padded_s": _fastest(run_padded)}
    out.write_text(json.dumps(res))
    print(json.dumps({k: v for k, v in res.items() if k != "lengths"}))


def moe_probe(out: Path) -> None:
    """The engine's sparse MLP (miles/engine/moe.py: route, then the CPU expert path) against
    transformers' Qwen3MoeSparseMoeBlock with its eager experts, the same weights and 256 tokens: hidden
    256, 32 experts of 128, top-4, fp32, forward only. The outputs must agree (else no figure)."""
    import torch
    import transformers
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    from miles.engine.moe import MoeSpec, sparse_mlp

    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(
        hidden_size=256, moe_intermediate_size=128, num_experts=32, num_experts_per_tok=4, norm_topk_prob=True
    )
    cfg._experts_implementation = "eager"
    block = Qwen3MoeSparseMoeBlock(cfg).eval()
    for param in block.parameters():
        torch.nn.init.normal_(param, std=0.05)
    spec = MoeSpec(num_experts=32, top_k=4, intermediate_size=128, norm_topk_prob=True, sparse_layers=(0,))
    x = torch.randn(256, 256)
    weights = (block.gate.weight, block.experts.gate_up_proj, block.experts.down_proj)

    with torch.no_grad():
        ours, theirs = sparse_mlp(x, *weights, spec)[0], block(x[None])[0]
        if not torch.allclose(ours, theirs, atol=1e-5, rtol=1e-4):
            raise SystemExit(f"engine and transformers differ by {(ours - theirs).abs().max().item():.3g}")
        res = {
            "engine_s": _fastest(lambda: sparse_mlp(x, *weights, spec)),
            "eager_s": _fastest(lambda: block(x[None])),
        }
    out.write_text(json.dumps(res))
    print(json.dumps(res))


def run_benchmark(argv: list[str], out: Path, log: Path) -> tuple[dict | None, float, str]:
    """One benchmark as `python -m ARGV --out OUT`; (its JSON or None, seconds, error)."""
    cmd = [sys.executable, "-m", *argv, "--out", str(out)]
    print("$", " ".join(cmd[1:]), flush=True)
    t0 = time.monotonic()
    with log.open("w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode
    took = time.monotonic() - t0
    if rc != 0 or not out.exists():
        tail = log.read_text()[-1500:]
        return None, took, f"exit status {rc}; end of its log:\n{tail}"
    return json.loads(out.read_text()), took, ""


def judge(fig: Figure, value: float | None, base: dict | None) -> tuple[str, float | None]:
    """('ok' | 'WORSE' | 'better' | 'new' | 'FAILED', change vs baseline as a signed fraction)."""
    if value is None:
        return "FAILED", None
    if not base:
        return "new", None
    change = value / base["value"] - 1
    worse = -change if fig.higher_is_better else change
    if worse > base.get("tolerance", DEFAULT_TOLERANCE):
        return "WORSE", change
    return ("better" if worse < -base.get("tolerance", DEFAULT_TOLERANCE) else "ok"), change


def git_commit() -> str:
    """HEAD's short hash, `+dirty` when tracked files differ from it; "unknown" outside a checkout."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        if out.returncode != 0:
            return "unknown"
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True
        )
        return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except OSError:
        return "unknown"


def machine() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            return f"{torch.cuda.get_device_name()}, torch {torch.__version__}"
    except ImportError:
        pass
    return f"{platform.machine()} CPU x{__import__('os').cpu_count()}, {platform.python_version()}"


def card(name: str) -> str:
    """The card's model in a device name ("NVIDIA H100 80GB HBM3" -> "H100", "AMD Instinct MI355X" ->
    "MI355X"); the whole name where none is recognised."""
    found = re.search(r"\b(?:GB|MI|[ABHLV])\d+\w*\b", name)
    return found.group(0) if found else name


def card_baseline(baseline: dict, mode: str, this_card: str) -> dict:
    """The figures a run is judged against: the CPU's, or the GPU figures of this card alone (a figure
    of another card is neither a regression nor a pass here). A baseline of the earlier layout (GPU
    figures not keyed by card) counts each figure for the card its `machine` names."""
    if mode == "cpu":
        return baseline.get("cpu", {})
    gpu = baseline.get("gpu", {})
    if isinstance(gpu.get(this_card), dict) and "value" not in gpu[this_card]:
        return gpu[this_card]
    return {k: v for k, v in gpu.items() if "value" in v and card(v.get("machine", "")) == this_card}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu", action="store_true", help="the CPU figures (tiny shapes, ratios)")
    p.add_argument("--only", action="append", help="run only this run key (repeatable)")
    p.add_argument("--baseline", default=str(BASELINE))
    p.add_argument("--out", default=None, help="JSON of every figure, its run and the verdicts")
    p.add_argument("--write-baseline", action="store_true", help="store this run's figures as the baseline")
    p.add_argument("--commit", default=None, help="the code's commit, where this copy has no git history")
    p.add_argument("--attention-probe", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--moe-probe", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.attention_probe or args.moe_probe:
        (attention_probe if args.attention_probe else moe_probe)(Path(args.out))
        return 0
    mode = "cpu" if args.cpu else "gpu"
    runs = {k: v for k, v in RUNS[mode].items() if not args.only or k in args.only}
    if args.only and (unknown := set(args.only) - set(RUNS[mode])):
        p.error(f"unknown --only {sorted(unknown)}; known in {mode} mode: {sorted(RUNS[mode])}")
    baseline = json.loads(Path(args.baseline).read_text()) if Path(args.baseline).exists() else {}
    this_card = card(machine())
    base = card_baseline(baseline, mode, this_card)
    if mode == "gpu" and not base:
        print(f"no baseline of this card ({this_card}) in {args.baseline}: its figures are new here")
    work = Path(tempfile.mkdtemp(prefix="guard-"))
    outputs, errors, seconds = {}, {}, {}
    for key, argv_ in runs.items():
        outputs[key], seconds[key], errors[key] = run_benchmark(
            argv_, work / f"{key}.json", work / f"{key}.log"
        )
    rows, failed = [], []
    for fig in (f for f in FIGURES[mode] if f.run in runs):
        try:
            value = fig.read(outputs[fig.run]) if outputs[fig.run] is not None else None
        except (KeyError, StopIteration, TypeError) as e:
            value, errors[fig.run] = None, f"figure not found in the output: {e!r}"
        verdict, change = judge(fig, value, base.get(fig.name))
        if verdict in ("WORSE", "FAILED"):
            failed.append(fig.name)
        rows.append(dict(name=fig.name, value=value, unit=fig.unit, verdict=verdict, change=change,
                         higher_is_better=fig.higher_is_better, baseline=base.get(fig.name), run=fig.run))  # fmt: skip
    print_table(rows)
    for key, err in errors.items():
        if err:
            print(f"\n{key} ({' '.join(runs[key])}) failed: {err}")
    stamp = dict(
        commit=args.commit or git_commit(),
        date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        machine=machine(),
    )
    result = dict(mode=mode, **stamp, figures=rows, commands={k: " ".join(v) for k, v in runs.items()},
                  run_seconds=seconds, outputs=outputs)  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
        print(f"guard results in {args.out}")
    if args.write_baseline:
        for r in rows:
            if r["value"] is not None:
                old = base.get(r["name"], {})
                base[r["name"]] = dict(
                    value=r["value"], **stamp, tolerance=old.get("tolerance", DEFAULT_TOLERANCE)
                )
        if mode == "cpu":
            baseline["cpu"] = base
        else:  # per card; figures of the earlier layout move under their own card
            gpu = baseline.get("gpu", {})
            for name, fig in [(k, v) for k, v in gpu.items() if "value" in v]:
                gpu.setdefault(card(fig.get("machine", "")), {})[name] = gpu.pop(name)
            gpu[this_card] = base
            baseline["gpu"] = gpu
        Path(args.baseline).write_text(json.dumps(baseline, indent=1) + "\n")
        print(f"baseline written to {args.baseline}")
    if failed:
        print(f"\nguard FAILED: {', '.join(failed)}")
        return 1
    print("\nguard passed")
    return 0


def print_table(rows: list[dict]) -> None:
    print(f"\n{'figure':<32}{'value':>12}{'baseline':>12}{'change':>9}  verdict")
    for r in rows:
        v = "-" if r["value"] is None else f"{r['value']:.4g}"
        b = "-" if not r["baseline"] else f"{r['baseline']['value']:.4g}"
        c = "-" if r["change"] is None else f"{100 * r['change']:+.1f}%"
        print(f"{r['name']:<32}{v:>12}{b:>12}{c:>9}  {r['verdict']}")


if __name__ == "__main__":
    sys.exit(main())
