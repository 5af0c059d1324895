"""Triton helpers shared by the kernels: exact scale arithmetic on float bits, FP4 expansion.

Scales are powers of two, so every conversion here is exact: a UE8M0 byte u is the fp32 whose
exponent field is u (2**(u - 127)); a power-of-two scale's reciprocal is its exponent mirrored.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def e8m0_to_fp32(u):
    """UE8M0 bytes (uint8) -> fp32 2**(u - 127) (u = 0 gives 0, never used by real scales)."""
    return (u.to(tl.int32) << 23).to(tl.float32, bitcast=True)


@triton.jit
def pow2_ceil_scale(amax, qmax_inv):
    """2**ceil(log2(amax * qmax_inv)) for positive normal fp32, from the float's bits (as the
    reference's fast_round_scale), and its exact reciprocal. Returns (scale, 1/scale)."""
    r = amax * qmax_inv
    bits = r.to(tl.int32, bitcast=True)
    expo = (bits >> 23) & 0xFF
    expo = expo + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    scale = (expo << 23).to(tl.float32, bitcast=True)
    inv = ((254 - expo) << 23).to(tl.float32, bitcast=True)
    return scale, inv


@triton.jit
def quant_groups_fp8(y, BLOCK_ROWS: tl.constexpr, WIDTH: tl.constexpr, AMAX_FLOOR: tl.constexpr):
    """y [BLOCK_ROWS, WIDTH] fp32 -> (q [BLOCK_ROWS, WIDTH] float8e4nv, scale
    [BLOCK_ROWS, WIDTH // 32] fp32): one power-of-two scale per 32 consecutive columns."""
    g = tl.reshape(y, (BLOCK_ROWS, WIDTH // 32, 32))
    amax = tl.maximum(tl.max(tl.abs(g), axis=2), AMAX_FLOOR)
    scale, inv = pow2_ceil_scale(amax, 1.0 / 448.0)
    q = tl.clamp(g * inv[:, :, None], -448.0, 448.0)
    q = tl.reshape(q, (BLOCK_ROWS, WIDTH)).to(tl.float8e4nv)
    return q, scale


@triton.jit
def fp4_to_bf16_scaled(packed, scale_u8, ROWS: tl.constexpr, KP: tl.constexpr, KG: tl.constexpr):
    """packed [ROWS, KP] int8 (two e2m1 per byte, low nibble first) with UE8M0 scales
    scale_u8 [ROWS, KG] (one per 32 values) -> [ROWS, 2*KP] bf16 values ``e2m1 * 2**(u - 127)``.

    The nibble's exponent and mantissa bits go straight into an fp16's exponent and top mantissa
    bit: exponent e >= 1 gives 2**(e - 15) * (1 + m/2) and e = 0 the subnormal 2**-14 * m/2, i.e.
    the e2m1 value times 2**-14 either way (no branch). The scale carries the 2**14 back:
    2**(u - 113), exact in bf16 for every u a real scale has (u <= 240). All steps are exact.
    """
    p = packed.to(tl.uint8, bitcast=True).to(tl.int32)
    nib = tl.reshape(tl.join(p & 0xF, p >> 4), (ROWS, 2 * KP))
    bits = (((nib & 7) << 9) | ((nib & 8) << 12)).to(tl.int16)
    v = bits.to(tl.float16, bitcast=True).to(tl.bfloat16)
    s = ((scale_u8.to(tl.int32) + 14) << 23).to(tl.float32, bitcast=True).to(tl.bfloat16)
    if KG == 1:
        return v * s
    v3 = tl.reshape(v, (ROWS, KG, 32)) * s[:, :, None]
    return tl.reshape(v3, (ROWS, 2 * KP))


@triton.jit
def dot_exact(a, b, acc, F32_MATH: tl.constexpr):
    """acc + a @ b for bf16 a, b (products exact in fp32). F32_MATH runs the same values through an
    fp32 IEEE dot: what the CPU tests use, since the Triton interpreter's bf16 math is wrong."""
    if F32_MATH:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def scale_bf16(v, s, F32_MATH: tl.constexpr):
    """bf16 v times power-of-two s (fp32, broadcastable) -> bf16, exact. On the GPU one bf16
    multiply; F32_MATH (the Triton interpreter, whose bf16 arithmetic is wrong) goes through fp32,
    which gives the same bits."""
    if F32_MATH:
        return (v.to(tl.float32) * s.to(tl.float32)).to(tl.bfloat16)
    return v * s.to(tl.bfloat16)
