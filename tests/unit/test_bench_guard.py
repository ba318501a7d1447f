"""bench/guard.py: a figure worse than its baseline by more than the tolerance fails the guard, named;
the CPU probes (attention, MoE) run and are judged against a baseline file."""

from __future__ import annotations

import json

from bench import guard

FAST = guard.Figure("tok_s", "run", lambda r: r["x"], True, "tok/s")
SLOW = guard.Figure("step_s", "run", lambda r: r["x"], False, "s")


def test_judge_by_direction_and_tolerance() -> None:
    base = {"value": 100.0, "tolerance": 0.10}
    assert guard.judge(FAST, 95.0, base)[0] == "ok"
    verdict, change = guard.judge(FAST, 89.0, base)
    assert verdict == "WORSE" and abs(change + 0.11) < 1e-12
    assert guard.judge(FAST, 120.0, base)[0] == "better"
    assert guard.judge(SLOW, 109.0, base)[0] == "ok"
    assert guard.judge(SLOW, 111.0, base)[0] == "WORSE"
    assert guard.judge(SLOW, 80.0, base)[0] == "better"
    assert guard.judge(SLOW, 80.0, None) == ("new", None)
    assert guard.judge(SLOW, None, base) == ("FAILED", None)


def test_cpu_probe_fails_against_an_unreachable_baseline_and_names_the_figure(tmp_path, capsys) -> None:
    base = tmp_path / "baseline.json"
    base.write_text(json.dumps({"cpu": {"packed_vs_padded_attention": {"value": 1e6}}}))
    rc = guard.main(
        ["--cpu", "--only", "attention", "--baseline", str(base), "--out", str(tmp_path / "g.json")]
    )
    out = json.loads((tmp_path / "g.json").read_text())
    assert rc == 1 and "guard FAILED: packed_vs_padded_attention" in capsys.readouterr().out
    (row,) = out["figures"]
    assert row["verdict"] == "WORSE" and row["value"] > 0
    again = tmp_path / "again.json"
    guard.main(
        ["--cpu", "--only", "attention", "--baseline", str(base), "--write-baseline", "--out", str(again)]
        + ["--commit", "abc1234"]
    )
    stored = json.loads(base.read_text())["cpu"]["packed_vs_padded_attention"]
    assert stored["value"] == json.loads(again.read_text())["figures"][0]["value"]
    assert stored["tolerance"] == 0.10 and stored["machine"]
    # a copy without the code's git history names the commit it was given
    assert stored["commit"] == json.loads(again.read_text())["commit"] == "abc1234"


def test_cpu_moe_probe_compares_the_engine_layer_with_transformers(tmp_path, capsys) -> None:
    """The MoE figure: the probe checks that both layers give one result before it times them."""
    base = tmp_path / "baseline.json"
    base.write_text(json.dumps({"cpu": {"moe_engine_vs_eager": {"value": 1e6}}}))
    rc = guard.main(
        ["--cpu", "--only", "moe_cpu", "--baseline", str(base), "--out", str(tmp_path / "g.json")]
    )
    assert rc == 1 and "guard FAILED: moe_engine_vs_eager" in capsys.readouterr().out
    (row,) = json.loads((tmp_path / "g.json").read_text())["figures"]
    raw = json.loads((tmp_path / "g.json").read_text())["outputs"]["moe_cpu"]
    assert row["verdict"] == "WORSE" and row["value"] == raw["eager_s"] / raw["engine_s"] > 0


def test_gpu_baselines_are_per_card_and_a_figure_of_another_card_is_not_judged() -> None:
    """An H100 run is judged against H100 figures only: the H200's (a faster card) neither fail nor
    pass it, in the per-card layout and in the earlier one (figures with their machine)."""
    assert guard.card("NVIDIA H100 80GB HBM3") == "H100" and guard.card("NVIDIA H200") == "H200"
    assert guard.card("AMD Instinct MI355X") == "MI355X" and guard.card("x86_64 CPU x2") == "x86_64 CPU x2"
    h200 = {"value": 36700.0, "machine": "NVIDIA H200, torch 2.11.0+cu130", "commit": "b92d2f3"}
    h100 = {"value": 29300.0, "machine": "NVIDIA H100 80GB HBM3, torch 2.11.0+cu130", "commit": "ab47e81"}
    per_card = {"gpu": {"H200": {"moe_decode_256_tok_s": h200}, "H100": {"moe_decode_256_tok_s": h100}}}
    assert guard.card_baseline(per_card, "gpu", "H100") == {"moe_decode_256_tok_s": h100}
    assert guard.card_baseline(per_card, "gpu", "B200") == {}
    earlier = {"gpu": {"moe_decode_256_tok_s": h200}}
    assert guard.card_baseline(earlier, "gpu", "H100") == {}
    assert guard.card_baseline(earlier, "gpu", "H200") == {"moe_decode_256_tok_s": h200}
    stored = json.loads(guard.BASELINE.read_text())
    assert all("value" not in v for v in stored["gpu"].values()), "the shipped baseline is keyed by card"
