"""quant.py against independent float64 math: exact round trips on representable values, and
quantisation of random values checked element by element against a search over the number grid."""

from __future__ import annotations

import math

import pytest
import torch
from deepinfer_kernels import quant
from f64_math import E2M1, E4M3, pow2_ceil, quant_group, round_to_grid
from hypothesis import given, settings
from hypothesis import strategies as st

SETTINGS = settings(max_examples=25, deadline=None)


def _e4m3_grid_tensor(shape, gen) -> torch.Tensor:
    """Random finite e4m3 values (as float64) drawn from the decoded grid, random signs."""
    vals = torch.tensor([v for v, _ in E4M3], dtype=torch.float64)
    idx = torch.randint(0, len(vals), shape, generator=gen)
    sign = torch.randint(0, 2, shape, generator=gen) * 2 - 1
    return vals[idx] * sign


@SETTINGS
@given(st.floats(min_value=2.0**-120, max_value=2.0**120, allow_nan=False))
def test_pow2_ceil_matches_log2(r):
    r32 = torch.tensor([r], dtype=torch.float32)
    want = pow2_ceil(float(r32.item()))
    assert quant.pow2_ceil(r32).item() == want


def test_pow2_ceil_rejects_non_fp32():
    with pytest.raises(ValueError, match="float32"):
        quant.pow2_ceil(torch.ones(2, dtype=torch.float64))


@SETTINGS
@given(n=st.integers(1, 80), k=st.integers(1, 80), seed=st.integers(0, 2**31))
def test_fp8_blocks_roundtrip_exact_on_grid(n, k, seed):
    """v * S with v on the e4m3 grid and one |v| in (224, 448] per block comes back exactly."""
    gen = torch.Generator().manual_seed(seed)
    v = _e4m3_grid_tensor((n, k), gen)
    nb, kb = -(-n // 32), -(-k // 32)
    for i in range(nb):
        for j in range(kb):
            v[i * 32, j * 32] = 448.0 if (i + j) % 2 else -256.0
    exps = torch.randint(-20, 20, (nb, kb), generator=gen).double()
    s = (2.0**exps).repeat_interleave(32, 0)[:n].repeat_interleave(32, 1)[:, :k]
    w = (v * s).float()
    w_fp8, scale = quant.quantize_fp8_blocks(w)
    assert w_fp8.dtype == torch.float8_e4m3fn and tuple(w_fp8.shape) == (n, k)
    assert scale.dtype == torch.float8_e8m0fnu and tuple(scale.shape) == (nb, kb)
    assert torch.equal(scale.float().double(), 2.0**exps)
    assert torch.equal(w_fp8.double(), v)
    assert torch.equal(quant.dequantize_fp8_blocks(w_fp8, scale).double(), w.double())


def test_fp8_blocks_random_against_float64():
    gen = torch.Generator().manual_seed(1)
    n, k = 40, 70  # ragged edge blocks on both axes
    w = (torch.randn(n, k, generator=gen) * torch.exp(torch.randn(n, 1, generator=gen))).float()
    w_fp8, scale = quant.quantize_fp8_blocks(w)
    got = quant.dequantize_fp8_blocks(w_fp8, scale, torch.float64)
    wl = w.double().tolist()
    for bi in range(0, n, 32):
        for bj in range(0, k, 32):
            rows, cols = range(bi, min(bi + 32, n)), range(bj, min(bj + 32, k))
            block = [wl[r][c] for r in rows for c in cols]
            want = quant_group(block, 448.0, E4M3, quant.WEIGHT_AMAX_FLOOR)
            have = [got[r, c].item() for r in rows for c in cols]
            assert have == want


def test_dequantize_fp8_blocks_shape_errors():
    w = torch.zeros(64, 64, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="scale must be"):
        quant.dequantize_fp8_blocks(w, torch.ones(1, 2, dtype=torch.float8_e8m0fnu))
    with pytest.raises(ValueError, match=r"\[N, K\]"):
        quant.quantize_fp8_blocks(torch.zeros(2, 3, 4))


def test_e2m1_rounding_against_grid_search():
    mids = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    xs = mids + [-m for m in mids] + [0.1, 0.3, 2.9, 4.4, 5.9, 6.0, -6.0, 0.0, 1.0, -0.5]
    xs += torch.empty(200).uniform_(-6, 6, generator=torch.Generator().manual_seed(3)).tolist()
    t = torch.tensor(xs, dtype=torch.float32)
    got = quant.e2m1_value(quant.e2m1_code(t)).tolist()
    assert got == [round_to_grid(float(x), E2M1) for x in t.tolist()]


def test_fp4_pack_nibble_order():
    codes = torch.tensor([[1, 2, 15, 8]], dtype=torch.uint8)
    packed = quant.pack_fp4(codes)
    assert packed.dtype == torch.int8
    assert packed.view(torch.uint8).tolist() == [[0x21, 0x8F]]
    assert torch.equal(quant.unpack_fp4(packed), codes)


@SETTINGS
@given(n=st.integers(1, 9), groups=st.integers(1, 4), seed=st.integers(0, 2**31))
def test_fp4_experts_roundtrip_exact_on_grid(n, groups, seed):
    gen = torch.Generator().manual_seed(seed)
    k = 32 * groups
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    codes[:, ::32] = 7  # each group's amax is 6 * scale
    exps = torch.randint(-30, 30, (n, groups), generator=gen).double()
    mag = torch.tensor([v for v, _ in E2M1], dtype=torch.float64)
    v = mag[(codes & 7).long()] * torch.where(codes >= 8, -1.0, 1.0).double()
    w = (v * (2.0**exps).repeat_interleave(32, 1)).float()
    packed, scale = quant.quantize_fp4_experts(w)
    assert packed.dtype == torch.int8 and tuple(packed.shape) == (n, k // 2)
    assert scale.dtype == torch.float8_e8m0fnu and tuple(scale.shape) == (n, groups)
    assert torch.equal(scale.double(), 2.0**exps)
    back = quant.dequantize_fp4(packed, scale, torch.float64)
    assert torch.equal(back, w.double())
    # negative zero codes (8) decode to zero; every other code must come back bit for bit
    nz = (codes != 8) & (codes != 0)
    assert torch.equal(quant.unpack_fp4(packed)[nz], codes[nz])


def test_fp4_experts_random_against_float64():
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(3, 2, 64, generator=gen) * 0.02
    packed, scale = quant.quantize_fp4_experts(w)
    assert tuple(packed.shape) == (3, 2, 32) and tuple(scale.shape) == (3, 2, 2)
    got = quant.dequantize_fp4(packed, scale, torch.float64).flatten(0, 1)
    for row_w, row_g in zip(w.flatten(0, 1).tolist(), got.tolist(), strict=True):
        for g in range(2):
            seg = row_w[g * 32 : (g + 1) * 32]
            assert row_g[g * 32 : (g + 1) * 32] == quant_group(seg, 6.0, E2M1, 6 * 2.0**-126)


def test_fp4_shape_errors():
    with pytest.raises(ValueError, match="multiple of 32"):
        quant.quantize_fp4_experts(torch.zeros(4, 48))
    with pytest.raises(ValueError, match="scale must be"):
        quant.dequantize_fp4(torch.zeros(4, 32, dtype=torch.int8), torch.ones(4, 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_act_quant_fp8_against_float64(dtype):
    gen = torch.Generator().manual_seed(7)
    x = (torch.randn(5, 96, generator=gen) * 3).to(dtype)
    x[1, 32:64] = 0.0  # a zero group takes the amax floor
    q, s = quant.act_quant_fp8(x)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and tuple(s.shape) == (5, 3)
    assert s[1, 1].item() == pow2_ceil(1e-4 / 448)
    deq = quant.act_dequant_fp8(q, s, torch.float64)
    for r, row in enumerate(x.double().tolist()):
        for g in range(3):
            seg = row[g * 32 : (g + 1) * 32]
            assert deq[r, g * 32 : (g + 1) * 32].tolist() == quant_group(seg, 448.0, E4M3, 1e-4)
            assert math.log2(s[r, g].item()).is_integer()


def test_act_quant_fp8_exact_on_grid():
    gen = torch.Generator().manual_seed(8)
    v = _e4m3_grid_tensor((4, 64), gen)
    v[:, ::32] = 384.0
    x = (v * 2.0**-5).float()
    q, s = quant.act_quant_fp8(x)
    assert torch.equal(s, torch.full((4, 2), 2.0**-5))
    assert torch.equal(q.double(), v)


def test_act_quant_rejects_ragged_k():
    with pytest.raises(ValueError, match="multiple of 32"):
        quant.act_quant_fp8(torch.zeros(2, 40))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fake_quant_fp8_ue8m0(dtype):
    x = (torch.randn(3, 64, generator=torch.Generator().manual_seed(9)) * 5).to(dtype)
    y = quant.fake_quant_fp8_ue8m0(x)
    assert y.dtype == dtype
    for r, row in enumerate(x.double().tolist()):
        want = quant_group(row[:32], 448.0, E4M3, 1e-4) + quant_group(row[32:], 448.0, E4M3, 1e-4)
        assert y[r].double().tolist() == [float(torch.tensor(w).to(dtype)) for w in want]


def test_fake_quant_fp4_ue8m0():
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(10)).bfloat16()
    y = quant.fake_quant_fp4_ue8m0(x)
    assert y.dtype == torch.bfloat16
    for r, row in enumerate(x.double().tolist()):
        want = []
        for g in range(2):
            want += quant_group(row[g * 32 : (g + 1) * 32], 6.0, E2M1, 6 * 2.0**-126)
        assert y[r].double().tolist() == want  # e2m1 times a power of two is exact in bf16


def test_fake_quant_fp4_e4m3_scale():
    x = torch.randn(4, 48, generator=torch.Generator().manual_seed(11)).float()
    x[0, :16] = 0.0
    y = quant.fake_quant_fp4_e4m3_scale(x, block=16)
    assert y.dtype == torch.float32
    assert torch.equal(y[0, :16], torch.zeros(16))
    for r, row in enumerate(x.double().tolist()):
        for g in range(3):
            seg = row[g * 16 : (g + 1) * 16]
            amax = max(max(abs(v) for v in seg), 6 * 2.0**-9)
            # the scale is e4m3(fp32(amax / 6)); the division is done in fp32 as the reference does
            s = round_to_grid(float(torch.tensor(amax / 6, dtype=torch.float32)), E4M3)
            want = [
                round_to_grid(float(torch.tensor(v / s, dtype=torch.float32)), E2M1) * s
                for v in seg
            ]
            assert y[r, g * 16 : (g + 1) * 16].double().tolist() == pytest.approx(
                want, rel=0, abs=0
            )


@settings(max_examples=20, deadline=None)
@given(steps=st.integers(1, 4), rows=st.integers(1, 5), seed=st.integers(0, 2**16))
def test_fp4_fragment_order_puts_each_lanes_fragment_bytes_in_its_chunk(steps, rows, seed):
    """Chunk t (16 bytes) of each 64-byte step holds bytes t, 4+t, 8+t, 12+t of group 0, then of
    groups 1..3; nothing leaves its step, and every byte is kept."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randint(-128, 128, (2, rows, 64 * steps), generator=g, dtype=torch.int8)
    f = quant.fp4_fragment_order(w)
    assert f.shape == w.shape and f.dtype == w.dtype
    for s in range(steps):
        for t in range(4):
            for c in range(4):
                for b in range(4):
                    got = f[..., 64 * s + 16 * t + 4 * c + b]
                    assert torch.equal(got, w[..., 64 * s + 16 * c + 4 * b + t])
    with pytest.raises(ValueError, match="multiple of 64"):
        quant.fp4_fragment_order(w[..., :32])


@settings(max_examples=20, deadline=None)
@given(steps=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_fp4_checkpoint_order_inverts_the_fragment_order(steps, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randint(-128, 128, (3, 2, 64 * steps), generator=g, dtype=torch.int8)
    assert torch.equal(quant.fp4_checkpoint_order(quant.fp4_fragment_order(w)), w)
    assert torch.equal(quant.fp4_fragment_order(quant.fp4_checkpoint_order(w)), w)
    with pytest.raises(ValueError, match="multiple of 64"):
        quant.fp4_checkpoint_order(w[..., :32])
