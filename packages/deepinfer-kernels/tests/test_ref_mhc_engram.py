"""mHC Sinkhorn / mixing and the Engram gate against float64 loops."""

import math

import torch
from deepinfer_kernels import ops


def _sig(v):
    return 1.0 / (1.0 + math.exp(-v))


def test_hc_split_sinkhorn_matches_f64_and_is_doubly_stochastic():
    g = torch.Generator().manual_seed(0)
    hc, iters, eps = 4, 20, 1e-6
    mixes = torch.randn(3, 24, generator=g)
    scale, base = torch.rand(3, generator=g) + 0.5, torch.randn(24, generator=g)
    pre, post, comb = ops.hc_split_sinkhorn(mixes, scale, base, hc, iters, eps)
    for t in range(3):
        m, s, b = mixes[t].double().tolist(), scale.double().tolist(), base.double().tolist()
        for k in range(hc):
            assert abs(float(pre[t, k]) - (_sig(m[k] * s[0] + b[k]) + eps)) < 1e-6
            assert abs(float(post[t, k]) - 2 * _sig(m[hc + k] * s[1] + b[hc + k])) < 1e-6
        c = [
            [m[2 * hc + i * hc + j] * s[2] + b[2 * hc + i * hc + j] for j in range(hc)]
            for i in range(hc)
        ]
        c = [
            [math.exp(v - max(r)) / sum(math.exp(u - max(r)) for u in r) + eps for v in r]
            for r in c
        ]
        for it in range(iters):
            if it > 0:
                c = [[v / (sum(r) + eps) for v in r] for r in c]
            cs = [sum(c[i][j] for i in range(hc)) + eps for j in range(hc)]
            c = [[c[i][j] / cs[j] for j in range(hc)] for i in range(hc)]
        torch.testing.assert_close(
            comb[t].double(), torch.tensor(c, dtype=torch.float64), rtol=1e-5, atol=1e-6
        )
        torch.testing.assert_close(
            comb[t].sum(0).double(), torch.ones(hc, dtype=torch.float64), atol=1e-4, rtol=0
        )
        torch.testing.assert_close(
            comb[t].sum(1).double(), torch.ones(hc, dtype=torch.float64), atol=1e-2, rtol=0
        )  # ends on a column step


def test_hc_mixes_pre_post_match_loops():
    g = torch.Generator().manual_seed(1)
    h = torch.randn(2, 4, 8, generator=g)
    fn = torch.randn(24, 32, generator=g)
    got = ops.hc_mixes(h, fn, 1e-20)
    for t in range(2):
        flat = h[t].flatten().double().tolist()
        r = 1 / math.sqrt(sum(v * v for v in flat) / 32 + 1e-20)
        for i in range(24):
            assert (
                abs(
                    float(got[t, i])
                    - r * sum(a * float(b) for a, b in zip(flat, fn[i], strict=False))
                )
                < 1e-4
            )
    pre = torch.rand(2, 4, generator=g)
    y = ops.hc_pre(h, pre)
    torch.testing.assert_close(y, sum(pre[:, k : k + 1] * h[:, k] for k in range(4)))
    post, comb = torch.rand(2, 4, generator=g), torch.rand(2, 4, 4, generator=g)
    out = ops.hc_post(y, h, post, comb)
    for t in range(2):
        for k in range(4):
            want = post[t, k] * y[t] + sum(comb[t, j, k] * h[t, j] for j in range(4))
            torch.testing.assert_close(out[t, k], want, rtol=1e-5, atol=1e-5)


def test_engram_gate_matches_f64():
    g = torch.Generator().manual_seed(2)
    t, hc, d = 3, 4, 8
    h, key = torch.randn(t, hc, d, generator=g), torch.randn(t, hc, d, generator=g)
    value, weight = torch.randn(t, d, generator=g), torch.randn(hc, d, generator=g)
    got = ops.engram_gate(h, key, value, weight, 1e-20)
    for i in range(t):
        for k in range(hc):
            hh, kk, ww = (
                h[i, k].double().tolist(),
                key[i, k].double().tolist(),
                weight[k].double().tolist(),
            )
            rs = (
                1
                / math.sqrt(sum(v * v for v in hh) / d + 1e-20)
                / math.sqrt(sum(v * v for v in kk) / d + 1e-20)
            )
            dot = sum(a * b * c for a, b, c in zip(hh, ww, kk, strict=False)) * rs / math.sqrt(d)
            gate = _sig(math.copysign(math.sqrt(max(abs(dot), 1e-6)), dot))
            want = [a + gate * float(v) for a, v in zip(hh, value[i], strict=False)]
            torch.testing.assert_close(
                got[i, k].double(), torch.tensor(want, dtype=torch.float64), rtol=1e-5, atol=1e-5
            )
