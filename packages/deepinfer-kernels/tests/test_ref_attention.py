"""sparse_sink_attention against a float64 loop with the sink in the denominator only."""

import math

import torch
from deepinfer_kernels import ops
from hypothesis import given, settings
from hypothesis import strategies as st


def _attn_f64(q, kv, idx, sink, scale):
    t, h, d = q.shape
    out = torch.zeros(t, h, d, dtype=torch.float64)
    for i in range(t):
        valid = [int(j) for j in idx[i].tolist() if j >= 0]
        for hh in range(h):
            logits = [
                scale * sum(float(q[i, hh, c]) * float(kv[j, c]) for c in range(d)) for j in valid
            ]
            den = sum(math.exp(v) for v in logits) + math.exp(float(sink[hh]))
            for c in range(d):
                out[i, hh, c] = (
                    sum(math.exp(v) * float(kv[j, c]) for v, j in zip(logits, valid, strict=False))
                    / den
                )
    return out


@settings(max_examples=15, deadline=None)
@given(t=st.integers(1, 4), n=st.integers(1, 9), k=st.integers(1, 6), seed=st.integers(0, 99))
def test_sparse_sink_attention_matches_f64(t, n, k, seed):
    g = torch.Generator().manual_seed(seed)
    h, d = 2, 8
    q = torch.randn(t, h, d, generator=g)
    kv = torch.randn(n, d, generator=g)
    idx = torch.randint(-1, n, (t, k), generator=g)
    sink = torch.randn(h, generator=g)
    got = ops.sparse_sink_attention(q, kv, idx, sink, d**-0.5)
    torch.testing.assert_close(
        got.double(), _attn_f64(q, kv, idx, sink, d**-0.5), rtol=1e-5, atol=1e-6
    )


def test_all_invalid_row_is_zero_and_order_does_not_matter():
    g = torch.Generator().manual_seed(3)
    q, kv, sink = torch.randn(2, 2, 4, generator=g), torch.randn(5, 4, generator=g), torch.zeros(2)
    idx = torch.tensor([[-1, -1, -1], [4, 0, 2]])
    out = ops.sparse_sink_attention(q, kv, idx, sink, 0.5)
    assert torch.equal(out[0], torch.zeros(2, 4))
    perm = ops.sparse_sink_attention(
        q,
        kv,
        torch.tensor([[-1, -1, -1], [2, -1, 4]]).index_fill(1, torch.tensor([1]), 0),
        sink,
        0.5,
    )
    torch.testing.assert_close(out[1], perm[1])
