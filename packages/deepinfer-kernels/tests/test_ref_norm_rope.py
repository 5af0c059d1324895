"""rms_norm and rope (ref tier through the registry) against plain float64 loops."""

import math

import torch
from deepinfer_kernels import ops
from hypothesis import given, settings
from hypothesis import strategies as st


def _rms_f64(x, w, eps):
    out = []
    for row in x.tolist():
        ms = sum(v * v for v in row) / len(row)
        out.append([wi * v / math.sqrt(ms + eps) for wi, v in zip(w.tolist(), row, strict=False)])
    return torch.tensor(out, dtype=torch.float64)


@settings(max_examples=20, deadline=None)
@given(rows=st.integers(1, 5), d=st.sampled_from([4, 32, 64]), eps=st.sampled_from([1e-20, 1e-6]))
def test_rms_norm_matches_f64(rows, d, eps):
    g = torch.Generator().manual_seed(rows * 100 + d)
    x = torch.randn(rows, d, generator=g)
    w = torch.randn(d, generator=g)
    got = ops.rms_norm(x, w, eps)
    assert got.dtype == x.dtype
    torch.testing.assert_close(
        got.double(), _rms_f64(x.double(), w.double(), eps), rtol=1e-5, atol=1e-5
    )


def test_rms_norm_zero_row_stays_zero_with_tiny_eps():
    assert torch.equal(ops.rms_norm(torch.zeros(1, 8), torch.ones(8), 1e-20), torch.zeros(1, 8))


def test_rope_rotates_adjacent_pairs_and_inverse_undoes():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 8, generator=g)
    pos = torch.tensor([0, 1, 7, 100, 12345])
    inv = torch.tensor([1.0, 0.1, 0.01, 0.001])
    got = ops.rope(x, pos, inv)
    want = torch.empty(5, 3, 8, dtype=torch.float64)
    for t in range(5):
        for h in range(3):
            for i in range(4):
                ang = float(torch.tensor(float(pos[t]), dtype=torch.float32) * inv[i])
                a, b = float(x[t, h, 2 * i]), float(x[t, h, 2 * i + 1])
                want[t, h, 2 * i] = a * math.cos(ang) - b * math.sin(ang)
                want[t, h, 2 * i + 1] = a * math.sin(ang) + b * math.cos(ang)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ops.rope(got, pos, inv, inverse=True), x, rtol=1e-5, atol=1e-5)
    # position 0 is the identity
    torch.testing.assert_close(got[0], x[0])
