"""Triton helpers shared by the kernels: exact scale arithmetic on float bits, FP4 expansion.

Scales are powers of two, so every conversion here is exact: a UE8M0 byte u is the fp32 whose
exponent field is u (2**(u - 127)); a power-of-two scale's reciprocal is its exponent mirrored.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice


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


@triton.jit
def fp8_to_bf16_scaled(
    v, s, ROWS: tl.constexpr, WIDTH: tl.constexpr, KG: tl.constexpr, F32_MATH: tl.constexpr
):
    """v [ROWS, WIDTH] e4m3 with power-of-two scales s (fp32; [ROWS, KG], one per 32 columns, or
    broadcastable when KG == 1) -> bf16 v * s, exact (an e4m3 value times a power of two fits
    bf16). KG > 1 scales in bf16, which halves the registers of the expansion."""
    if KG == 1:
        return (v.to(tl.float32) * s).to(tl.bfloat16)
    v3 = scale_bf16(tl.reshape(v.to(tl.bfloat16), (ROWS, KG, 32)), s[:, :, None], F32_MATH)
    return tl.reshape(v3, (ROWS, WIDTH))


@triton.jit
def rsqrt(v, ACCURATE: tl.constexpr):
    """1/sqrt(v): ACCURATE uses libdevice's rsqrtf (what torch's CUDA rsqrt calls); the Triton
    interpreter has no libdevice."""
    if ACCURATE:
        return libdevice.rsqrt(v)
    else:
        return tl.math.rsqrt(v)


# 8 e2m1 nibbles (one int32 word, value k in bits 4k..4k+3) -> 8 bf16 bit patterns, each the
# nibble's exponent/mantissa placed into the bf16's low exponent bits (the e2m1 value times
# 2**-126) and its sign into the sign bit.
# Per pair of values (one byte): PRMT gathers the two nibbles into the low bits of two 16-bit
# lanes (the other bits zero), one multiply by 2**6 + 2**12 copies each nibble to both bit places
# it feeds (ranges 6-9, 12-15, 22-25, 28-31: no carries) and one AND keeps bits 6-8, 15, 22-24, 31.
# About 2.4 instructions per value, against ~7 for the per-value shifts and conversions.
_FP4X8_TO_BF16_ASM = tl.constexpr(
    """
{
.reg .b32 e02, o02, e13, o13, u, w;
and.b32 e02, $8, 0x000F000F;
shr.u32 o02, $8, 4;
and.b32 o02, o02, 0x000F000F;
shr.u32 e13, $8, 8;
and.b32 e13, e13, 0x000F000F;
shr.u32 o13, $8, 12;
and.b32 o13, o13, 0x000F000F;
prmt.b32 u, e02, o02, 0x5410;
mul.lo.u32 w, u, 0x1040;
and.b32 w, w, 0x81C081C0;
mov.b32 {$0, $1}, w;
prmt.b32 u, e13, o13, 0x5410;
mul.lo.u32 w, u, 0x1040;
and.b32 w, w, 0x81C081C0;
mov.b32 {$2, $3}, w;
prmt.b32 u, e02, o02, 0x7632;
mul.lo.u32 w, u, 0x1040;
and.b32 w, w, 0x81C081C0;
mov.b32 {$4, $5}, w;
prmt.b32 u, e13, o13, 0x7632;
mul.lo.u32 w, u, 0x1040;
and.b32 w, w, 0x81C081C0;
mov.b32 {$6, $7}, w;
}
"""
)


@triton.jit
def _fp4x8_values(words):
    """The 8 values of every int32 word (value k: nibble k), placed as bf16 e2m1 x 2**-126 by
    `_FP4X8_TO_BF16_ASM`: a tuple of 8 tensors shaped like words."""
    return tl.inline_asm_elementwise(
        _FP4X8_TO_BF16_ASM,
        "=h,=h,=h,=h,=h,=h,=h,=h,r",
        [words],
        dtype=(tl.bfloat16,) * 8,
        is_pure=True,
        pack=1,
    )


@triton.jit
def fp4_words_to_bf16_scaled(words, scale_u8, ROWS: tl.constexpr, KW: tl.constexpr):
    """words [ROWS, KW] int32 (8 e2m1 values each, the packed bytes read 4 at a time) with UE8M0
    scales [ROWS, KW // 4] (one per 32 values) -> [ROWS, 8*KW] bf16 ``e2m1 * 2**(u - 127)``:
    with packed integer ops (inline PTX, so the GPU only). It relies on the bf16 multiply
    keeping subnormal inputs (the e2m1 value 0.5 placed as a bf16 subnormal; the GPU tests check
    it) and on u <= 128 (scales <= 2, as real checkpoints have)."""
    o = _fp4x8_values(words)
    # value k = 4i + 2j + l of a word sits in output 4i + 2j + l: join so that the last joined
    # axis is the lowest bit of k
    lo = tl.join(tl.join(o[0], o[4]), tl.join(o[2], o[6]))
    hi = tl.join(tl.join(o[1], o[5]), tl.join(o[3], o[7]))
    v = tl.reshape(tl.join(lo, hi), (ROWS, 8 * KW))
    return scale_groups(v, scale_u8, ROWS, 8 * KW)


@triton.jit
def fp4_fragment_words_to_bf16_scaled(words, scale_u8, ROWS: tl.constexpr, KW: tl.constexpr):
    """`fp4_words_to_bf16_scaled` for words in `quant.fp4_fragment_order`: words [ROWS, KW]
    ordered (lane t, group c) (KW = 4 x the groups, at most 4: one 64-byte step or its half),
    where byte m of word (t, c) holds values 32c + 8m + 2t and +1 -> [ROWS, 8*KW] in natural K
    order (GPU only)."""
    CG: tl.constexpr = KW // 4
    o = _fp4x8_values(words)
    # output 2m + b of every word, [ROWS, 4 (t), CG] -> per m [ROWS, CG, 8 (t, b)]
    m0 = _lane_pairs(o[0], o[1], ROWS, CG)
    m1 = _lane_pairs(o[2], o[3], ROWS, CG)
    m2 = _lane_pairs(o[4], o[5], ROWS, CG)
    m3 = _lane_pairs(o[6], o[7], ROWS, CG)
    j = tl.join(tl.join(m0, m2), tl.join(m1, m3))  # [ROWS, CG, 8 (t, b), m >> 1, m & 1]
    v = tl.reshape(tl.permute(j, (0, 1, 3, 4, 2)), (ROWS, 8 * KW))  # K = 32c + 8m + 2t + b
    return scale_groups(v, scale_u8, ROWS, 8 * KW)


@triton.jit
def _lane_pairs(even, odd, ROWS: tl.constexpr, CG: tl.constexpr):
    """Values 2m and 2m + 1 of the words (t, c) [ROWS, 4 * CG] -> [ROWS, CG, 8], ordered (t, b)."""
    e = tl.permute(tl.reshape(even, (ROWS, 4, CG)), (0, 2, 1))
    o = tl.permute(tl.reshape(odd, (ROWS, 4, CG)), (0, 2, 1))
    return tl.reshape(tl.join(e, o), (ROWS, CG, 8))


@triton.jit
def scale_groups(v, scale_u8, ROWS: tl.constexpr, K: tl.constexpr):
    """v [ROWS, K] bf16 e2m1 values x 2**-126 (as the expansions place them) times 2**(u - 1)
    per 32 values (UE8M0 bytes u [ROWS, K / 32], u <= 128) -> e2m1 x 2**(u - 127)."""
    s = ((scale_u8.to(tl.int32) + 126) << 23).to(tl.float32, bitcast=True).to(tl.bfloat16)
    v3 = tl.reshape(v, (ROWS, K // 32, 32)) * s[:, :, None]
    return tl.reshape(v3, (ROWS, K))
