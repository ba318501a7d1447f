"""The unbiased pass@k estimator against brute force, and the per-dataset / summary metrics."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import pytest

from miles.eval.metrics import dataset_metrics, pass_at_k, report_ks, summary
from miles.sample import Sample, Status


def brute_force(n: int, c: int, k: int) -> Fraction:
    """The fraction of all k-subsets of n samples (the first c correct) holding a correct one."""
    subsets = list(itertools.combinations(range(n), k))
    return Fraction(sum(any(i < c for i in s) for s in subsets), len(subsets))


@pytest.mark.parametrize("n", range(1, 11))
def test_estimator_equals_enumeration_of_every_k_subset(n: int) -> None:
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(float(brute_force(n, c, k)), abs=1e-12), (n, c, k)


def test_pass_at_1_is_the_fraction_correct_and_edges_are_exact() -> None:
    assert pass_at_k(16, 5, 1) == pytest.approx(5 / 16)
    assert pass_at_k(8, 0, 8) == 0.0 and pass_at_k(8, 1, 8) == 1.0 and pass_at_k(8, 5, 4) == 1.0


def test_large_n_stays_finite_and_matches_exact_binomials() -> None:
    # C(1024, 512) overflows a float; the product form does not need it
    n, c, k = 1024, 3, 512
    exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
    assert pass_at_k(n, c, k) == pytest.approx(float(exact), rel=1e-12)


@pytest.mark.parametrize("bad", [(4, 1, 0), (4, 1, 5), (4, 5, 2), (4, -1, 2)])
def test_bad_arguments_are_refused(bad) -> None:
    with pytest.raises(ValueError, match="pass@k"):
        pass_at_k(*bad)


def test_reported_ks() -> None:
    assert report_ks(1) == [1]
    assert report_ks(8) == [1, 2, 4, 8]
    assert report_ks(12) == [1, 2, 4, 8, 12]
    assert report_ks(16) == [1, 2, 4, 8, 16]


def s(reward: float, n_tokens: int = 3, status: Status = Status.COMPLETED, versions=(2,)) -> Sample:
    return Sample(
        0,
        0,
        [1],
        response_ids=[7] * n_tokens,
        reward=reward,
        status=status,
        weight_versions=list(versions) * n_tokens,
    )


def test_dataset_metrics_from_samples() -> None:
    groups = [
        [s(1), s(0), s(0), s(1, status=Status.TRUNCATED)],  # c = 2 of 4
        [s(0), s(0), s(0), s(0, n_tokens=5, versions=(3,))],  # c = 0
        [s(1), s(0), s(0), s(0, status=Status.FAILED)],  # 3 answered, c = 1: out of pass@4
    ]
    m = dataset_metrics(groups, samples_per_prompt=4)
    assert m["mean@4"] == pytest.approx((2 / 4 + 0 + 1 / 3) / 3)
    assert m["pass@1"] == pytest.approx(m["mean@4"])
    assert m["pass@2"] == pytest.approx((pass_at_k(4, 2, 2) + 0 + pass_at_k(3, 1, 2)) / 3)
    assert m["pass@4"] == pytest.approx((1 + 0) / 2)
    assert m["failed_requests"] == 1 and m["prompts"] == 3
    assert m["truncated_frac"] == pytest.approx(1 / 11)
    assert m["response_len_mean"] == pytest.approx((10 * 3 + 5) / 11)
    assert (m["weight_version_min"], m["weight_version_max"]) == (2, 3)
    assert m["mixed_version_frac"] == 0.0


def test_summary_prefixes_each_dataset_and_averages_over_them() -> None:
    a = dataset_metrics([[s(1), s(1)], [s(0), s(0)]], 2)
    b = dataset_metrics([[s(1, versions=(4,))] * 4], 4)
    out = summary({"a": a, "b": b})
    assert out["eval/a/mean@2"] == 0.5 and out["eval/b/mean@4"] == 1.0 and out["eval/b/pass@4"] == 1.0
    assert out["eval/pass@1"] == pytest.approx(0.75)
    assert out["eval/pass@k"] == pytest.approx((0.5 + 1.0) / 2)  # each dataset at its own largest k
    assert (out["eval/weight_version_min"], out["eval/weight_version_max"]) == (2, 4)
    assert out["eval/failed_requests"] == 0
