"""Bucketing of named tensors and the (bucket, is_last) look-ahead used to version the last bucket."""

from __future__ import annotations

import pytest
import torch

from miles.weights.bucket import iter_buckets, tensor_bytes
from miles.weights.transport import check_pause_mode, with_last


def _named(sizes: list[int]) -> list[tuple[str, torch.Tensor]]:
    return [(f"w{i}", torch.zeros(n, dtype=torch.float32)) for i, n in enumerate(sizes)]


def test_buckets_respect_limit_and_keep_order():
    named = _named([10, 20, 5, 40, 1, 1, 30])
    buckets = list(iter_buckets(named, bucket_bytes=30 * 4))
    assert [n for b in buckets for n, _ in b] == [n for n, _ in named]
    assert all(sum(tensor_bytes(t) for _, t in b) <= 30 * 4 for b in buckets if len(b) > 1)
    assert ["w3"] in [[n for n, _ in b] for b in buckets]  # larger than the limit: alone


def test_bad_bucket_size_names_key():
    with pytest.raises(ValueError, match="bucket_mb"):
        list(iter_buckets(_named([1]), 0))


def test_with_last_marks_only_the_final_bucket():
    assert [last for _, last in with_last([[1], [2], [3]])] == [False, False, True]
    assert list(with_last([])) == []


def test_pause_mode_checked():
    check_pause_mode(None)
    with pytest.raises(ValueError, match="in_place"):
        check_pause_mode("later")


def test_a_rank_that_keeps_nothing_sees_the_same_bucket_boundaries() -> None:
    named = _named([10, 25, 5, 40, 1])
    kept = list(iter_buckets(named, bucket_bytes=30 * 4))
    empty = list(iter_buckets(named, bucket_bytes=30 * 4, keep=False))
    assert len(empty) == len(kept) > 1 and all(b == [] for b in empty)
