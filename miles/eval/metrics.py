"""The numbers users report for one evaluation dataset, from its scored samples.

For a prompt with n answered samples of which c are correct (score >= 1), the unbiased estimator of
pass@k (Chen et al. 2021, "Evaluating Large Language Models Trained on Code") is

    pass@k = 1 - C(n - c, k) / C(n, k)                      (1 <= k <= n)
           = 1 - prod_{i = n - c + 1}^{n} (1 - k / i)       (when n - c >= k; else exactly 1)

The product form never builds the huge binomials (n in the hundreds overflows floats otherwise) and
each factor lies in [0, 1), so it loses no precision. pass@1 reduces to c / n, and

    mean@n = mean over prompts of c / n      (pass@1 averaged over the n samples, as users report it)

A dataset's pass@k is the mean over its prompts. It is reported for k = 1, 2, 4, 8, ... up to n, and
for k = n itself. Left out on purpose: samples the engine never answered (status failed/aborted)
count in `failed_requests`, not in n; a prompt with fewer than k answered samples is left out of the
mean for that k (so failures neither pass nor fail a prompt).

Beside accuracy: the fraction of answered samples cut off by the length cap (`truncated_frac`), the
mean response length in tokens, and the oldest and newest weight version of any evaluated token (a
result comes from one step's weights exactly when both equal that step's version).
"""

from __future__ import annotations

from collections.abc import Sequence

from miles.sample import Sample, Status

ANSWERED = (Status.COMPLETED, Status.TRUNCATED)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt with c correct out of n samples (1 <= k <= n, 0 <= c <= n)."""
    if not (1 <= k <= n and 0 <= c <= n):
        raise ValueError(f"pass@k needs 1 <= k <= n and 0 <= c <= n (got n={n}, c={c}, k={k})")
    if n - c < k:
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def report_ks(n: int) -> list[int]:
    """The k reported for n samples per prompt: powers of two up to n, and n."""
    ks = [1 << j for j in range(n.bit_length()) if 1 << j <= n]
    return ks if not ks or ks[-1] == n else [*ks, n]


def is_correct(sample: Sample) -> bool:
    """A sample is correct when its score (the scorer's return value) is at least 1."""
    return sample.reward >= 1.0


def dataset_metrics(groups: Sequence[Sequence[Sample]], samples_per_prompt: int) -> dict[str, float]:
    """Metrics of one dataset (keys without the `eval/<name>/` prefix); `groups` holds each prompt's samples."""
    answered = [[s for s in g if s.status in ANSWERED] for g in groups]
    flat = [s for g in answered for s in g]
    n_all = sum(len(g) for g in groups)
    out: dict[str, float] = {
        "prompts": float(len(groups)),
        "samples_per_prompt": float(samples_per_prompt),
        "failed_requests": float(n_all - len(flat)),
    }
    if not flat:
        return out
    counts = [(len(g), sum(map(is_correct, g))) for g in answered if g]
    out[f"mean@{samples_per_prompt}"] = sum(c / n for n, c in counts) / len(counts)
    for k in report_ks(samples_per_prompt):
        eligible = [(n, c) for n, c in counts if n >= k]
        if eligible:
            out[f"pass@{k}"] = sum(pass_at_k(n, c, k) for n, c in eligible) / len(eligible)
    out["score_mean"] = sum(s.reward for s in flat) / len(flat)
    out["truncated_frac"] = sum(s.status is Status.TRUNCATED for s in flat) / len(flat)
    out["response_len_mean"] = sum(s.response_length for s in flat) / len(flat)
    out["response_len_max"] = float(max(s.response_length for s in flat))
    out["scorer_errors"] = float(sum("scorer_error" in s.metadata for s in flat))
    versions = [v for s in flat for v in s.weight_versions]
    if versions:
        out["weight_version_min"] = float(min(versions))
        out["weight_version_max"] = float(max(versions))
        out["mixed_version_frac"] = sum(len(set(s.weight_versions)) > 1 for s in flat) / len(flat)
    return out


def summary(per_dataset: dict[str, dict[str, float]]) -> dict[str, float]:
    """`eval/<name>/<metric>` for every dataset, plus `eval/<metric>` over the datasets that have it:
    the mean of pass@1 (and of `pass@k`, each dataset at its own largest k), truncation, length and
    score; the sum of failed requests; the min and max weight version."""
    out: dict[str, float] = {}
    for name, metrics in per_dataset.items():
        out.update({f"eval/{name}/{key}": value for key, value in metrics.items()})

    def values(key: str) -> list[float]:
        return [m[key] for m in per_dataset.values() if key in m]

    def largest_k(m: dict[str, float]) -> float | None:
        n = int(m.get("samples_per_prompt", 0))
        ks = [k for k in report_ks(n) if f"pass@{k}" in m] if n else []
        return m[f"pass@{ks[-1]}"] if ks else None

    for key in ("pass@1", "score_mean", "truncated_frac", "response_len_mean", "mixed_version_frac"):
        if vals := values(key):
            out[f"eval/{'reward_mean' if key == 'score_mean' else key}"] = sum(vals) / len(vals)
    if top := [v for m in per_dataset.values() if (v := largest_k(m)) is not None]:
        out["eval/pass@k"] = sum(top) / len(top)
    out["eval/failed_requests"] = sum(values("failed_requests"))
    if vals := values("weight_version_min"):
        out["eval/weight_version_min"] = min(vals)
    if vals := values("weight_version_max"):
        out["eval/weight_version_max"] = max(vals)
    return out
