"""Test helpers: random verify batches and a plain-Python chi-square."""

from __future__ import annotations

import math

import torch


def random_probs(rows: int, vocab: int, g: torch.Generator, zero_frac: float = 0.3) -> torch.Tensor:
    """``[rows, vocab]`` float32 distributions, some entries exactly 0 (as after top-k/grammar)."""
    w = torch.rand(rows, vocab, generator=g, dtype=torch.float64) ** 3
    w = w * (torch.rand(rows, vocab, generator=g) >= zero_frac)
    w[torch.arange(rows), torch.randint(0, vocab, (rows,), generator=g)] += 0.05  # never all 0
    return (w / w.sum(-1, keepdim=True)).to(torch.float32)


def random_batch(num_drafts: list[int], vocab: int, seed: int, with_draft_probs: bool = True):
    """A flat verify batch; drafts drawn from their own draft distributions."""
    g = torch.Generator().manual_seed(seed)
    cu = torch.tensor([0, *torch.tensor(num_drafts).cumsum(0).tolist()], dtype=torch.int64)
    total, batch = int(cu[-1]), len(num_drafts)
    q = random_probs(total, vocab, g) if total else torch.zeros(0, vocab)
    x = (
        torch.multinomial(q.double(), 1, generator=g)[:, 0]
        if total
        else torch.zeros(0, dtype=torch.int64)
    )
    p = random_probs(total + batch, vocab, g)
    seeds = torch.randint(0, 2**62, (batch,), generator=g)
    start = torch.randint(0, 10_000, (batch,), generator=g)
    positions = torch.cat([start[b] + torch.arange(k + 1) for b, k in enumerate(num_drafts)]).to(
        torch.int64
    )
    return cu, x, (q if with_draft_probs else None), p, seeds, positions


def chi_square(counts: list[int], probs: list[float]) -> tuple[float, int]:
    """Pearson statistic over cells with expected count > 0, and its degrees of freedom.

    A cell with expected 0 but observed > 0 gives +inf (the sampler emitted an impossible token).
    """
    n = sum(counts)
    stat, cells = 0.0, 0
    for c, p in zip(counts, probs, strict=True):
        expected = n * p
        if expected == 0.0:
            if c:
                return float("inf"), 0
            continue
        stat += (c - expected) ** 2 / expected
        cells += 1
    return stat, cells - 1


def chi2_quantile(q: float, df: int) -> float:
    """Quantile of the chi-square distribution (bisection on the regularised lower gamma series)."""

    def cdf(x: float) -> float:
        a, t = df / 2, x / 2
        total, term, n = 0.0, 1 / a, 0
        while term > 1e-17 * total or n == 0:
            total += term
            n += 1
            term *= t / (a + n)
        return total * math.exp(-t + a * math.log(t) - math.lgamma(a))

    lo, hi = 1e-9, 10.0 * df + 100.0
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf(mid) < q else (lo, mid)
    return lo
