"""Triton KV fake-quantisers (quantise then dequantise, returning the input dtype), one launch per
call: FP8 e4m3 with UE8M0 scales (window KV), FP4 e2m1 with UE8M0 scales (index keys and
queries), FP4 e2m1 with an e4m3 scale (compressed KV).

`deepinfer_kernels.quant` defines the numerics and these kernels reproduce them bit for bit:
dividing by a power-of-two scale is a multiply by its exact reciprocal (the same correctly rounded
value, subnormal results included); the e4m3 scale and the division by it use IEEE division
(`div_rn`: Triton's plain `/` is approximate on the GPU); every dequantised value is exact in
fp32 and in bf16, so the final conversion is exact too. Rounding to e4m3 is done on the float's
bits (`round_e4m3`) rather than by converting to float8: the Triton interpreter (the CPU tests)
rounds float8 conversions wrongly (ties away, and a mantissa carry into the exponent is lost), and
integer arithmetic gives the same bits on the GPU and in the interpreter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..quant import ACT_AMAX_FLOOR, FP4_MAX
from ._common import pow2_ceil_scale

_ELEMENTS = 1024  # values per program: GROUPS * block
_FP8_UE8M0, _FP4_UE8M0, _FP4_E4M3 = 0, 1, 2


@triton.jit
def with_sign_of(magnitude, x):
    """magnitude (fp32, >= 0 or +0) with the sign bit of x: e2m1 code 8 is -0, so a negative
    value that rounds to zero stays -0.0 as in the reference."""
    sign = x.to(tl.uint32, bitcast=True) & 0x80000000
    return (magnitude.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def round_e4m3(v):
    """fp32 v with |v| <= 448 -> the nearest float8 e4m3fn value (ties to even), as fp32.

    The 24-bit significand (implicit bit included) keeps its top 4 bits for a normal e4m3 value
    (exponent >= -6); below that the grid step stays 2**-9, so `shift` grows by one per exponent
    step (capped at 25, which leaves 0). The rounded integer times 2**(step exponent) is exact,
    and a carry out of the mantissa just makes the integer 16.
    """
    bits = v.to(tl.uint32, bitcast=True)
    ebits = ((bits >> 23) & 0xFF).to(tl.int32)
    mant = ((bits & 0x7FFFFF) | tl.where(ebits > 0, 0x800000, 0)).to(tl.int32)
    shift = 20 + tl.minimum(tl.maximum(121 - ebits, 0), 5)
    q = mant >> shift
    rem = mant - (q << shift)
    half = 1 << (shift - 1)
    q += ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(tl.int32)
    step = ((ebits - 23 + shift) << 23).to(tl.float32, bitcast=True)  # 2**(ebits - 150 + shift)
    mag = q.to(tl.float32) * step
    return with_sign_of(mag, v)


@triton.jit
def e2m1_magnitude(a):
    """|q| fp32 in [0, 6] -> the e2m1 magnitude it rounds to, as `quant.e2m1_code` rounds: ties to
    the even code (0.75, 1.75 and 3.5 go up; 0.25, 1.25, 2.5 and 5 go down). The thresholds rise,
    so each `where` overrides the ones before it exactly when the code count would step up."""
    m = tl.where(a > 0.25, 0.5, 0.0)
    m = tl.where(a >= 0.75, 1.0, m)
    m = tl.where(a > 1.25, 1.5, m)
    m = tl.where(a >= 1.75, 2.0, m)
    m = tl.where(a > 2.5, 3.0, m)
    m = tl.where(a >= 3.5, 4.0, m)
    m = tl.where(a > 5.0, 6.0, m)
    return m


@triton.jit(do_not_specialize=["n_groups"])  # one variant whatever the token count
def _fake_quant_kernel(
    x_ptr,
    y_ptr,
    n_groups,
    MODE: tl.constexpr,
    BLOCK: tl.constexpr,
    GROUPS: tl.constexpr,
    FP8_FLOOR: tl.constexpr,
    FP4_UE8M0_FLOOR: tl.constexpr,
    FP4_E4M3_FLOOR: tl.constexpr,
):
    """GROUPS groups of BLOCK consecutive values per program; x, y [n_groups * BLOCK]."""
    g = tl.program_id(0).to(tl.int64) * GROUPS + tl.arange(0, GROUPS)
    offs = g[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    mask = (g < n_groups)[:, None]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)  # [GROUPS]
    if MODE == 0:  # FP8 e4m3, scale 2**ceil(log2(max(amax, 1e-4) / 448))
        scale, inv = pow2_ceil_scale(tl.maximum(amax, FP8_FLOOR), 1.0 / 448.0)
        q = round_e4m3(tl.clamp(x * inv[:, None], -448.0, 448.0))
        y = q * scale[:, None]
    elif MODE == 1:  # FP4 e2m1, scale 2**ceil(log2(max(amax, 6 * 2**-126) / 6))
        scale, inv = pow2_ceil_scale(tl.maximum(amax, FP4_UE8M0_FLOOR), 1.0 / 6.0)
        q = tl.clamp(x * inv[:, None], -6.0, 6.0)
        y = with_sign_of(e2m1_magnitude(tl.abs(q)) * scale[:, None], x)
    else:  # FP4 e2m1, scale e4m3(max(amax, 6 * 2**-9) / 6), IEEE divisions as torch does them
        r = tl.math.div_rn(tl.maximum(amax, FP4_E4M3_FLOOR), tl.full(amax.shape, 6.0, tl.float32))
        # e4m3 saturates (as torch's conversion does): amax / 6 above 448 gives the scale 448
        scale = round_e4m3(tl.minimum(r, 448.0))[:, None]
        q = tl.clamp(tl.math.div_rn(x, tl.broadcast_to(scale, x.shape)), -6.0, 6.0)
        y = with_sign_of(e2m1_magnitude(tl.abs(q)) * scale, x)
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


def _fake_quant(x: torch.Tensor, block: int, mode: int) -> torch.Tensor:
    """x [..., K] (K % block == 0, block a power of two) -> same shape and dtype."""
    x = x.contiguous()
    y = torch.empty_like(x)
    n_groups = x.numel() // block
    if n_groups:
        groups = max(1, _ELEMENTS // block)
        _fake_quant_kernel[(triton.cdiv(n_groups, groups),)](
            x,
            y,
            n_groups,
            MODE=mode,
            BLOCK=block,
            GROUPS=groups,
            FP8_FLOOR=ACT_AMAX_FLOOR,
            FP4_UE8M0_FLOOR=FP4_MAX * 2.0**-126,
            FP4_E4M3_FLOOR=FP4_MAX * 2.0**-9,
            num_warps=4,
        )
    return y


def fake_quant_fp8_ue8m0(x: torch.Tensor, block: int = 32, **_: object) -> torch.Tensor:
    """FP8 e4m3 quantise-dequantise per `block` with power-of-two scales (as
    `quant.fake_quant_fp8_ue8m0`, bitwise). x [..., K] -> [..., K] x.dtype."""
    return _fake_quant(x, block, _FP8_UE8M0)


def fake_quant_fp4_ue8m0(x: torch.Tensor, block: int = 32, **_: object) -> torch.Tensor:
    """FP4 e2m1 quantise-dequantise per `block` with power-of-two scales (as
    `quant.fake_quant_fp4_ue8m0`, bitwise). x [..., K] -> [..., K] x.dtype."""
    return _fake_quant(x, block, _FP4_UE8M0)


def fake_quant_fp4_e4m3_scale(x: torch.Tensor, block: int = 16, **_: object) -> torch.Tensor:
    """FP4 e2m1 quantise-dequantise per `block` with an e4m3 scale (as
    `quant.fake_quant_fp4_e4m3_scale`, bitwise). x [..., K] -> [..., K] x.dtype."""
    return _fake_quant(x, block, _FP4_E4M3)
