"""bench/spec_gpu.py --smoke: the speculation benchmark runs end to end on the CPU (tiny model, both
MTP brackets, plain, NEXTN and adaptive NEXTN engines, two batch sizes) and reports what each bracket stands for: the
oracle layer keeps every proposal, the random one next to none; every output row is complete."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def test_smoke_run_brackets_the_acceptance(tmp_path):
    out = tmp_path / "spec.json"
    cmd = [sys.executable, "-m", "bench.spec_gpu", "--smoke", "--workdir", str(tmp_path), "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert {(r["bracket"], r["arm"], r["batch"]) for r in rows} == {
        (b, a, n) for b in ("random", "oracle") for a in ("plain", "NEXTN", "NEXTN adaptive") for n in (1, 4)
    }
    nextn = {(r["bracket"], r["batch"]): r for r in rows if r["arm"] == "NEXTN"}
    for batch in (1, 4):
        oracle = nextn[("oracle", batch)]
        assert oracle["spec_draft_token_num"] > 0
        assert oracle["spec_accept_token_num"] == oracle["spec_draft_token_num"]
        random = nextn[("random", batch)]
        assert random["spec_accept_token_num"] < random["spec_draft_token_num"] / 2
    adaptive = [r for r in rows if r["arm"] == "NEXTN adaptive"]  # the gate decides: counters stay whole
    assert all(r["spec_accept_token_num"] <= r["spec_draft_token_num"] for r in adaptive)
    assert "| 0.5b | oracle | NEXTN | 1 |" in proc.stdout


def test_longtail_lengths_are_a_seeded_pareto_tail():
    """`--longtail`: every arm asks for the same lengths, from 8 to --new, most short and a few at the cap."""
    from argparse import Namespace

    from bench.spec_gpu import lengths

    args = Namespace(longtail=True, new=1024, alpha=0.8)
    got = lengths(256, args)
    assert got == lengths(256, args) and len(got) == 256
    assert min(got) >= 8 and max(got) == 1024
    assert sorted(got)[128] < 64, "half the requests are short"
    assert 0 < sum(n == 1024 for n in got) < 16, "a few run to the cap: the tail"
    assert lengths(4, Namespace(longtail=False, new=32, alpha=0.8)) == [32] * 4
