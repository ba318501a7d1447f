"""PPO's value side: generalised advantage estimation and the clipped value loss.

Per sample, over its trained tokens t_1 < t_2 < ... < t_n (loss_mask 1; tokens an environment or a
tool wrote are skipped, so the state after a turn's last token is the next turn's first one), with
values V_k = V(t_k), rewards r_k (the sample's reward on its last trained token, 0 elsewhere) and
V_{n+1} = 0:

    delta_k = r_k + gamma V_{k+1} - V_k
    A_k     = delta_k + gamma lam A_{k+1}          (A_{n+1} = 0)      GAE (Schulman et al., 2016)
    R_k     = A_k + V_k                             the value target (return)

gamma = lam = 1 gives A_k = r_total - V_k. Untrained tokens get A = R = 0 and never enter a loss.
The clipped value loss (as in PPO's reference implementations), with V_old the critic's values
before the step's first update and c = value_clip:

    V_clip = V_old + clamp(V - V_old, -c, c)
    L_t    = 1/2 max((V - R)^2, (V_clip - R)^2)    (without a clip: 1/2 (V - R)^2)

and explained variance 1 - Var(R - V_old) / Var(R) over trained tokens: 1 for a perfect critic,
0 for one that predicts the mean, negative for worse.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

EPS = 1e-8


def gae(values: Tensor, rewards: Tensor, mask: Tensor, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """Advantages and returns [B, T] from values, rewards and mask [B, T] (rows are samples,
    right-padded with mask 0); computed in float64 and returned as float32."""
    values, rewards, mask = values.double(), rewards.double(), mask.bool()
    adv = torch.zeros_like(values)
    next_value = torch.zeros(values.shape[0], dtype=values.dtype)
    next_adv = torch.zeros_like(next_value)
    for t in range(values.shape[1] - 1, -1, -1):
        m = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        a = delta + gamma * lam * next_adv
        adv[:, t] = torch.where(m, a, 0.0)
        next_value = torch.where(m, values[:, t], next_value)
        next_adv = torch.where(m, a, next_adv)
    returns = torch.where(mask, adv + values, 0.0)
    return adv.float(), returns.float()


def sample_gae(
    values: list[Tensor], masks: list[Tensor], rewards: list[float], gamma: float, lam: float
) -> tuple[list[Tensor], list[Tensor]]:
    """GAE per sample: each sample's per-token values and mask (one entry per response token) and
    its scalar reward, placed on its last trained token; returns per-sample advantages and returns."""
    if not values:
        return [], []
    width = max(v.numel() for v in values)
    v = torch.zeros(len(values), width, dtype=torch.float64)
    m = torch.zeros(len(values), width, dtype=torch.bool)
    r = torch.zeros(len(values), width, dtype=torch.float64)
    for i, (vi, mi) in enumerate(zip(values, masks, strict=True)):
        n = vi.numel()
        v[i, :n], m[i, :n] = vi.double().cpu(), mi.bool().cpu()
        trained = m[i].nonzero()
        if trained.numel():
            r[i, int(trained[-1])] = float(rewards[i])
    adv, ret = gae(v, r, m, gamma, lam)
    lengths = [vi.numel() for vi in values]
    return [adv[i, :n] for i, n in enumerate(lengths)], [ret[i, :n] for i, n in enumerate(lengths)]


def value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, clip: float | None
) -> tuple[Tensor, Tensor]:
    """Per-token clipped value loss and a 0/1 tensor of where the clipped term was the larger."""
    unclipped = (values - returns).square()
    if clip is None:
        return 0.5 * unclipped, torch.zeros_like(unclipped)
    clipped_values = old_values + (values - old_values).clamp(-clip, clip)
    clipped = (clipped_values - returns).square()
    return 0.5 * torch.maximum(unclipped, clipped), (clipped > unclipped).to(values.dtype)


def variance_sums(returns: Tensor, values: Tensor, mask: Tensor) -> Tensor:
    """[count, sum R, sum R^2, sum (R - V), sum (R - V)^2] over trained tokens, float64: partial
    sums that add up over micro-batches and ranks (all-reduce), for `explained_variance`."""
    m = mask.double()
    r, d = returns.double(), (returns - values).double()
    return torch.stack([m.sum(), (m * r).sum(), (m * r * r).sum(), (m * d).sum(), (m * d * d).sum()])


def explained_variance(sums: Tensor) -> float:
    """1 - Var(R - V) / Var(R) from `variance_sums` (nan with fewer than 2 tokens or constant R)."""
    n, s_r, s_r2, s_d, s_d2 = (float(x) for x in sums)
    if n < 2:
        return float("nan")
    var_r = s_r2 / n - (s_r / n) ** 2
    if var_r <= 1e-12:
        return float("nan")
    return 1.0 - (s_d2 / n - (s_d / n) ** 2) / var_r


def ppo_targets(
    values: dict[int, Tensor],
    masks: dict[int, Tensor],
    rewards: dict[int, float],
    gamma: float,
    lam: float,
    normalize: bool,
    all_reduce: Callable[[Tensor], Tensor],
) -> tuple[dict[int, Tensor], dict[int, Tensor]]:
    """Per-token advantages and returns of the samples this rank holds (keys: sample indices).

    With `normalize` the advantages are whitened over the trained tokens of every rank: the sums
    (count, sum A, sum A^2) go through `all_reduce` (identity on one process)."""
    keys = sorted(values)
    adv_list, ret_list = sample_gae(
        [values[i] for i in keys], [masks[i] for i in keys], [rewards[i] for i in keys], gamma, lam
    )
    if normalize:
        m = (
            torch.cat([masks[i].double().cpu() for i in keys])
            if keys
            else torch.zeros(0, dtype=torch.float64)
        )
        a = torch.cat(adv_list).double() if keys else torch.zeros(0, dtype=torch.float64)
        n, s, s2 = (float(x) for x in all_reduce(torch.stack([m.sum(), (m * a).sum(), (m * a * a).sum()])))
        mean = s / max(n, 1.0)
        std = max(s2 / max(n, 1.0) - mean * mean, 0.0) ** 0.5
        adv_list = [
            ((ai.double() - mean) / (std + EPS) * masks[i].double().cpu()).float()
            for ai, i in zip(adv_list, keys, strict=True)
        ]
    return dict(zip(keys, adv_list, strict=True)), dict(zip(keys, ret_list, strict=True))


CRITIC_STATS = 9
"""Length of the critic's step statistics vector: value loss (weighted, summed over updates), clipped
tokens, `variance_sums` (5), sum of old values, sum of returns (all over trained tokens)."""


def add_target_stats(stats: Tensor, old: Tensor, returns: Tensor, mask: Tensor) -> None:
    """Add one sample's old values and returns to the step statistics (stats[2:9])."""
    mask = mask.double().cpu()
    stats[2:7] += variance_sums(returns.cpu(), old.cpu(), mask)
    stats[7] += float((mask * old.double().cpu()).sum())
    stats[8] += float((mask * returns.double().cpu()).sum())


def critic_metrics(
    stats: Tensor, updates: int, grad_norms: list[float], lr: float, warmup: bool
) -> dict[str, float]:
    """The critic/* metrics of a step from its all-reduced statistics (CRITIC_STATS)."""
    tokens = max(float(stats[2]), 1.0)
    return {
        "critic/value_loss": float(stats[0]) / max(updates, 1),
        "critic/clipfrac": float(stats[1]) / tokens,
        "critic/explained_variance": explained_variance(stats[2:7]),
        "critic/values_mean": float(stats[7]) / tokens,
        "critic/returns_mean": float(stats[8]) / tokens,
        "critic/grad_norm": sum(grad_norms) / max(len(grad_norms), 1),
        "critic/lr": lr,
        "critic/warmup": float(warmup),
    }
