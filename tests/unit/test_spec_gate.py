"""The speculation gate (miles/engine/spec_gate.py): per batch-size bucket it probes speculation, then
plain decoding, keeps the mode of fewer seconds per generated token, and probes the other again after
`reprobe` steps; the first step of a probe is not counted. Measurements are given, not timed."""

from __future__ import annotations

import pytest

from miles.engine.spec_gate import Gate


def drive(gate: Gate, n: int, steps: int, cost: dict[str, float], tokens: dict[str, int]) -> list[bool]:
    """`steps` decode steps of `n` requests, each mode taking cost[mode] seconds for tokens[mode]."""
    chosen = []
    for _ in range(steps):
        spec = gate.speculate(n)
        mode = "spec" if spec else "plain"
        gate.record(n, spec, cost[mode], tokens[mode])
        chosen.append(spec)
    return chosen


def test_a_losing_draft_is_switched_off_after_both_probes_and_probed_again():
    gate = Gate(window=3, reprobe=5)
    # speculation: 4 tokens in 10 s (2.5 s a token); plain: 1 token in 1 s
    chosen = drive(gate, 1, 4 + 4 + 12 + 4 + 2, {"spec": 10.0, "plain": 1.0}, {"spec": 4, "plain": 1})
    assert chosen[:4] == [True] * 4  # the speculation probe (its first step not counted)
    assert chosen[4:8] == [False] * 4  # the plain probe
    # plain kept for reprobe x 2.5 steps (speculation measured 2.5 times slower): its probes cost at
    # most about window / reprobe of the time
    assert chosen[8:20] == [False] * 12
    assert chosen[20:24] == [True] * 4  # speculation probed again, still slower
    assert chosen[24:] == [False] * 2
    assert gate.buckets[1].cost == pytest.approx({"spec": 2.5, "plain": 1.0})


def test_steps_kept_plain_may_run_ahead_until_a_probe_is_due():
    """`plain_ahead`: nothing to time or choose while a bucket keeps plain decoding and no probe is due;
    the steps decoded ahead count toward the probe (the engine calls `speculate` as they land), and the
    interval is stretched at most MAX_SPACING times however badly speculation lost."""
    from miles.engine.spec_gate import MAX_SPACING

    gate = Gate(window=2, reprobe=4)
    assert not gate.plain_ahead(8)  # an unseen bucket probes first
    drive(gate, 8, 6, {"spec": 1000.0, "plain": 1.0}, {"spec": 8, "plain": 8})
    assert gate.plain_ahead(8) and gate.plain_ahead(5) and not gate.plain_ahead(9)
    ahead = 0
    while gate.plain_ahead(8):
        assert not gate.speculate(8)
        ahead += 1
    assert ahead == 4 * MAX_SPACING
    assert gate.speculate(8)  # the probe of speculation is due


def test_a_winning_draft_is_kept_and_buckets_decide_apart():
    gate = Gate(window=2, reprobe=100)
    fast = drive(gate, 3, 12, {"spec": 1.0, "plain": 1.0}, {"spec": 3 * 3, "plain": 3})
    assert fast[6:] == [True] * 6  # probes done: speculation kept (3 tokens a request per round)
    slow = drive(gate, 200, 12, {"spec": 1.0, "plain": 1.0}, {"spec": 100, "plain": 200})
    assert slow[6:] == [False] * 6  # another bucket (256): plain kept there
    assert gate.speculate(4) and not gate.speculate(129)  # 3 and 4 share the bucket of 4


def test_the_first_step_of_a_probe_is_not_counted():
    gate = Gate(window=2, reprobe=100)
    # the first speculative step pays 1000 s (a cache catching up, a graph captured): left out
    gate.record(1, gate.speculate(1), 1000.0, 1)
    for _ in range(2):
        gate.record(1, gate.speculate(1), 1.0, 2)
    for cost in (1000.0, 1.0, 1.0):
        gate.record(1, gate.speculate(1), cost, 1)
    assert gate.buckets[1].cost == {"spec": 0.5, "plain": 1.0}
    assert gate.speculate(1)


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="window"):
        Gate(window=0)


def test_a_step_that_captured_a_graph_does_not_decide_a_probe():
    """One counted step of the plain probe 100 times slower (a CUDA graph captured for a longer
    context) leaves the median, and plain decoding, which is faster in every other step, is kept."""
    gate = Gate(window=5, reprobe=100)
    drive(gate, 4, 6, {"spec": 3.0, "plain": 1.0}, {"spec": 4, "plain": 4})  # speculation: 0.75 s a token
    for step in range(6):
        assert not gate.speculate(4)
        gate.record(4, False, 100.0 if step == 3 else 1.0, 4)  # plain: 0.25 s a token, one outlier
    assert gate.buckets[4].kept == "plain" and gate.buckets[4].cost["plain"] == pytest.approx(0.25)
