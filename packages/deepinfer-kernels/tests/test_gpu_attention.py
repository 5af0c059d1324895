"""The triton tiers of `sparse_sink_attention` and the KV fake-quantisers at V4.1-Flash shapes on
CUDA, through the registry: H 64, d 512, K 640 (window 128 + top-512) and 2176 (window 128 +
top-2048), T 1..300, bf16. Attention against float64 math (on the device) and the ref tier;
rows with no valid index exactly 0; batch invariance bit for bit; every output element written
(outputs land on NaN-poisoned memory); no host<->device sync. Fake quant bit for bit against
`quant.py` on the same device. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
from deepinfer_kernels import REGISTRY, ops, quant
from deepinfer_kernels.ref import attention as ref_attention
from gpu_checks import poison, rel

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (the triton tier runs on CUDA only)"
)

DEV = "cuda"
HEADS, HEAD_DIM, WINDOW = 64, 512, 128
SCALE = HEAD_DIM**-0.5


def _gen(seed: int) -> torch.Generator:
    return torch.Generator(device=DEV).manual_seed(seed)


def _inputs(t: int, k: int, seed: int):
    """A decode/prefill-like call: each token sees a window of 128 ring/new rows (the newest few
    missing for early positions) and up to k - 128 compressed entries (-1 tail), some repeated;
    token 15 of every 16 has no valid index at all."""
    g = _gen(seed)
    n = WINDOW * t + 4096
    q = torch.randn(t, HEADS, HEAD_DIM, generator=g, device=DEV).to(torch.bfloat16)
    kv = torch.randn(n, HEAD_DIM, generator=g, device=DEV).to(torch.bfloat16)
    rows = torch.arange(t, device=DEV)[:, None]
    window = rows * WINDOW + torch.arange(WINDOW, device=DEV)[None, :]
    window = torch.where(torch.arange(WINDOW, device=DEV)[None, :] > rows + 5, -1, window)
    top = WINDOW * t + torch.randint(0, 4096, (t, k - WINDOW), generator=g, device=DEV)
    keep = torch.randint(0, k - WINDOW + 1, (t, 1), generator=g, device=DEV)
    top = torch.where(torch.arange(k - WINDOW, device=DEV)[None, :] < keep, top, -1)
    top[:, 1::7] = top[:, :1]  # repeated entries
    idx = torch.cat([window, top], dim=1)
    idx[15::16] = -1
    sink = torch.randn(HEADS, generator=g, device=DEV) * 2
    return q, kv, idx, sink


def f64_attention(q, kv, idx, sink, scale) -> torch.Tensor:
    """The definition in float64 on the device, one token at a time (independent of both tiers)."""
    out = torch.zeros(q.shape, dtype=torch.float64, device=DEV)
    kvd, sd = kv.double(), sink.double()
    for t in range(q.shape[0]):
        sel = idx[t][idx[t] >= 0]
        if sel.numel() == 0:
            continue
        keys = kvd[sel]
        logits = (q[t].double() @ keys.T) * scale
        m = torch.maximum(logits.amax(dim=1), sd)
        e = torch.exp(logits - m[:, None])
        out[t] = (e @ keys) / (e.sum(dim=1) + torch.exp(sd - m))[:, None]
    return out


@pytest.mark.parametrize("k", [640, 2176])
@pytest.mark.parametrize("t", [1, 7, 64, 300])
def test_attention_matches_float64_and_ref(t, k):
    q, kv, idx, sink = _inputs(t, k, seed=t * 7 + k)
    assert REGISTRY.resolve("sparse_sink_attention", q, kv, idx, sink, SCALE).tier == "triton"
    poison()
    got = ops.sparse_sink_attention(q, kv, idx, sink, SCALE)
    assert got.dtype == torch.bfloat16 and got.shape == q.shape
    want = f64_attention(q, kv, idx, sink, SCALE)
    # elementwise: one bf16 rounding of the output plus fp32 accumulation noise
    tol = 2.0**-8 * want.abs() + 1e-5 * kv.abs().float().max().item()
    err = (got.double() - want).abs()
    assert not torch.isnan(got).any()
    assert (err <= tol).all(), f"{int((err > tol).sum())} elements off, worst {err.max().item()}"
    ref = ref_attention.sparse_sink_attention(q, kv, idx, sink, SCALE)
    # both round the same fp32-accurate values to bf16: only rare one-step flips differ
    err = rel(got, ref)
    assert err < 2e-3, f"relative difference to the ref tier {err:.3g}"
    assert torch.equal(got[15::16], torch.zeros_like(got[15::16]))


def test_attention_int32_indices_and_fp32_falls_back_to_ref():
    q, kv, idx, sink = _inputs(5, 640, seed=1)
    a = ops.sparse_sink_attention(q, kv, idx, sink, SCALE)
    b = ops.sparse_sink_attention(q, kv, idx.int(), sink, SCALE)
    assert torch.equal(a, b)
    qf, kvf = q.float(), kv.float()
    assert REGISTRY.resolve("sparse_sink_attention", qf, kvf, idx, sink, SCALE).tier == "ref"
    got = ops.sparse_sink_attention(qf, kvf, idx, sink, SCALE)
    want = f64_attention(qf, kvf, idx, sink, SCALE)
    assert rel(got, want) < 1e-5


def test_attention_batch_invariant_bitwise():
    q, kv, idx, sink = _inputs(300, 2176, seed=5)
    full = ops.sparse_sink_attention(q, kv, idx, sink, SCALE)
    part = ops.sparse_sink_attention(q[:64], kv, idx[:64], sink, SCALE)
    assert torch.equal(part, full[:64])
    for t in (0, 1, 63, 299):
        alone = ops.sparse_sink_attention(q[t : t + 1], kv, idx[t : t + 1], sink, SCALE)
        assert torch.equal(alone[0], full[t])
    pad = torch.full((300, 100), -1, dtype=idx.dtype, device=DEV)
    padded = ops.sparse_sink_attention(q, kv, torch.cat([idx, pad], dim=1), sink, SCALE)
    assert torch.equal(padded, full)


FAKE_QUANT = [  # (op, shape, block) as the model calls them
    ("fake_quant_fp8_ue8m0", (300, 512), 32),  # window KV
    ("fake_quant_fp4_e4m3_scale", (300, 512), 16),  # compressed KV
    ("fake_quant_fp4_ue8m0", (300, 128), 32),  # index keys
    ("fake_quant_fp4_ue8m0", (300, 64, 128), 32),  # index queries
]


@pytest.mark.parametrize("op,shape,block", FAKE_QUANT)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fake_quant_bitwise_vs_quant(op, shape, block, dtype):
    g = _gen(sum(shape) + block)
    x = torch.randn(shape, generator=g, device=DEV)
    # per-row magnitudes over many binades, kept under 6 * 448 so the e4m3 scale never saturates
    # (where torch versions differ)
    mag = torch.exp(3 * torch.randn((*shape[:-1], 1), generator=g, device=DEV)).clamp(max=100.0)
    x = x * mag
    x = x.to(dtype)
    x[0] = 0.0
    x[1, ..., ::3] = -0.0
    assert REGISTRY.resolve(op, x, block).tier == "triton"
    poison()
    got = getattr(ops, op)(x, block)
    want = getattr(quant, op)(x, block)
    iv = torch.int16 if dtype == torch.bfloat16 else torch.int32
    assert torch.equal(got.view(iv), want.view(iv))


def test_no_host_device_sync():
    q, kv, idx, sink = _inputs(64, 640, seed=2)
    x = torch.randn(64, 512, device=DEV).to(torch.bfloat16)
    ops.sparse_sink_attention(q, kv, idx, sink, SCALE)  # compile outside the checked region
    for op, _, block in FAKE_QUANT:
        getattr(ops, op)(x, block)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ops.sparse_sink_attention(q, kv, idx, sink, SCALE)
        for op, _, block in FAKE_QUANT:
            getattr(ops, op)(x, block)
    finally:
        torch.cuda.set_sync_debug_mode("default")
