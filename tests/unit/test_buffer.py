"""The rollout buffer: bound, FIFO order, staleness, and each built-in policy's verdicts."""

from __future__ import annotations

import threading
import time

import pytest

from miles.config import ConfigError
from miles.rollout.buffer import POLICIES, RolloutBuffer, Verdict, group_staleness, load_policy
from miles.sample import Sample, Status


def group(gid: int, rewards=(0.0, 1.0), versions=(0, 0), status=Status.COMPLETED) -> list[Sample]:
    out = []
    for i, (r, v) in enumerate(zip(rewards, versions, strict=True)):
        s = Sample(gid, i, [1, 2], response_ids=[3, 4], reward=r, status=status, weight_versions=[v, v + 1])
        s.metadata["prompt"] = f"prompt-{gid}"
        out.append(s)
    return out


def test_staleness_uses_oldest_token_version() -> None:
    g = group(0, versions=(3, 5))  # tokens of versions 3,4 and 5,6
    assert group_staleness(g, 7) == 4


def test_fifo_and_metrics() -> None:
    buf = RolloutBuffer(capacity=4)
    for gid in range(3):
        assert buf.put(group(gid))
    got = buf.get(2, current_version=1)
    assert [g[0].group_id for g in got] == [0, 1]
    m = buf.metrics()
    assert m["buffer/size"] == 1 and m["buffer/taken"] == 2 and m["staleness/max"] == 1


def test_has_room_tracks_capacity() -> None:
    buf = RolloutBuffer(capacity=2)
    buf.put(group(0))
    assert buf.has_room()
    buf.put(group(1))
    assert not buf.has_room()


def test_drop_stale_rejects_old_groups() -> None:
    buf = RolloutBuffer(capacity=8, policy=POLICIES["drop_stale"], max_staleness=1)
    buf.put(group(0, versions=(0, 0)))
    buf.put(group(1, versions=(2, 2)))
    got = buf.get(1, current_version=3)
    assert [g[0].group_id for g in got] == [1]
    assert buf.metrics()["buffer/dropped_stale"] == 1


def test_retry_stale_requeues_prompt() -> None:
    buf = RolloutBuffer(capacity=8, policy=POLICIES["retry_stale"], max_staleness=0)
    buf.put(group(0, versions=(0, 0)))
    buf.put(group(1, versions=(5, 5)))
    assert [g[0].group_id for g in buf.get(1, current_version=5)] == [1]
    assert buf.take_retry() == "prompt-0"
    assert buf.take_retry() is None


def test_dynamic_sampling_drops_zero_variance() -> None:
    buf = RolloutBuffer(capacity=8, policy=POLICIES["dynamic_sampling"])
    assert not buf.put(group(0, rewards=(1.0, 1.0)))
    assert not buf.put(group(1, rewards=(0.0, 0.0)))
    assert buf.put(group(2, rewards=(0.0, 1.0)))
    assert len(buf) == 1 and buf.metrics()["buffer/dropped"] == 2


def test_aborted_groups_are_retried() -> None:
    buf = RolloutBuffer(capacity=8)
    assert not buf.put(group(0, status=Status.ABORTED))
    assert buf.take_retry() == "prompt-0"


def test_get_blocks_until_producer_puts() -> None:
    buf = RolloutBuffer(capacity=4)

    def later() -> None:
        time.sleep(0.2)
        buf.put(group(7))

    threading.Thread(target=later).start()
    start = time.monotonic()
    got = buf.get(1, current_version=0, timeout_s=5)
    assert got[0][0].group_id == 7 and time.monotonic() - start >= 0.15


def test_get_timeout_keeps_partial_batch() -> None:
    buf = RolloutBuffer(capacity=4)
    buf.put(group(0))
    with pytest.raises(TimeoutError):
        buf.get(2, current_version=0, timeout_s=0.1)
    assert len(buf) == 1


def custom_policy(group, staleness, max_staleness):
    return Verdict.DROP if group[0].group_id % 2 else Verdict.KEEP


def test_custom_policy_by_dotted_path() -> None:
    policy = load_policy(f"{__name__}:custom_policy")
    buf = RolloutBuffer(capacity=4, policy=policy)
    assert buf.put(group(0)) and not buf.put(group(1))


def test_unknown_policy_lists_known_names() -> None:
    with pytest.raises(ConfigError, match="drop_stale"):
        load_policy("nope")
