"""V4.1's quantisation formats in pure torch: exact, CPU or CUDA, the oracle for every kernel.

Formats (what the checkpoint stores and what the reference computes):

- Dense weights: FP8 e4m3 with one UE8M0 (power-of-two) scale per 32x32 block,
  ``w ~= w_fp8 * scale[n // 32, k // 32]``; scales stored as ``torch.float8_e8m0fnu``.
- Expert weights: FP4 e2m1, two values per int8 byte (element ``2j`` in the low nibble, ``2j+1`` in
  the high nibble; bit 3 of a nibble is the sign), one UE8M0 scale per 32 along K.
- Activations: FP8 e4m3 with one power-of-two scale per 32 channels, held as fp32. The scale is
  ``2**ceil(log2(amax / 448))`` with ``amax`` floored at 1e-4, as the reference's ``act_quant``.
- KV fake-quant (quantise then dequantise, returning the input dtype): FP8 per 32 with UE8M0 (window
  KV), FP4 per 16 with an e4m3 scale (compressed KV), FP4 per 32 with UE8M0 (index keys/queries).

Rounding everywhere is round-to-nearest-even on the target grid after clamping to its largest
finite value; dividing by a power-of-two scale is exact, so a value on the grid round-trips exactly.
"""

from __future__ import annotations

import torch

FP8_BLOCK = 32
"""Block edge of the dense weight scales and the group size of activation scales."""
FP4_BLOCK = 32
"""Group size along K of the FP4 expert weight scales."""
FP8_MAX = 448.0
"""Largest finite float8_e4m3fn value."""
FP4_MAX = 6.0
"""Largest e2m1 value."""
ACT_AMAX_FLOOR = 1e-4
"""Floor on a group's amax before computing its FP8 activation scale (as the reference)."""
WEIGHT_AMAX_FLOOR = FP8_MAX * 2.0**-126
"""Floor on a weight block's amax: keeps the scale a normal fp32 power of two (2**-126)."""

FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""e2m1 magnitudes by code 0..7; code | 8 is the negative value."""
FP4_MAX_SCALE_BYTE = 128
"""Largest UE8M0 byte of an FP4 expert scale (2**(byte - 127): up to 2) that the GPU tiers expand
exactly: they put byte + 126 in a bf16 exponent, so 129 and up come out infinite there."""

# Python floats, not tensors: a tensor constant would be copied host->device on every CUDA call.
# A Python scalar times an fp32 tensor is computed in fp32 with the scalar rounded to fp32 first,
# the same product a 0-dim fp32 tensor of 1/max gives, bit for bit.
_FP8_MAX_INV = 1.0 / FP8_MAX
_FP4_MAX_INV = 1.0 / FP4_MAX


def _check_last_dim(x: torch.Tensor, block: int, name: str) -> None:
    if x.dim() == 0 or x.shape[-1] % block != 0:
        raise ValueError(
            f"{name}: last dimension must be a multiple of {block}, got shape {tuple(x.shape)}"
        )


def pow2_ceil(r: torch.Tensor) -> torch.Tensor:
    """``2**ceil(log2(r))`` for positive normal fp32 `r`, exactly (read off the float's bits).

    Same arithmetic as the reference's ``fast_round_scale``: the exponent field, plus one when the
    mantissa is not zero.
    """
    if r.dtype != torch.float32:
        raise ValueError(f"pow2_ceil: r must be float32, got {r.dtype}")
    bits = r.contiguous().view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    mantissa = bits & 0x7FFFFF
    exponent = exponent + (mantissa != 0).to(torch.int32)
    return (exponent << 23).view(torch.float32)


# ---------------------------------------------------------------------------------------------
# FP8 dense weights: 32x32 blocks
# ---------------------------------------------------------------------------------------------


def _block_view(w: torch.Tensor, block: int) -> tuple[torch.Tensor, int, int]:
    """Pad [N, K] to multiples of `block` (zeros) and view as [N/b, b, K/b, b]."""
    n, k = w.shape
    nb, kb = -(-n // block), -(-k // block)
    padded = torch.nn.functional.pad(w, (0, kb * block - k, 0, nb * block - n))
    return padded.view(nb, block, kb, block), nb, kb


def quantize_fp8_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise a dense weight to FP8 e4m3 with one UE8M0 scale per 32x32 block.

    w: [N, K] float. Returns (w_fp8 [N, K] float8_e4m3fn, scale [ceil(N/32), ceil(K/32)]
    float8_e8m0fnu) with ``w ~= dequantize_fp8_blocks(w_fp8, scale)``; ragged edge blocks are
    scaled by their own amax.
    """
    if w.dim() != 2:
        raise ValueError(f"quantize_fp8_blocks: w must be [N, K], got shape {tuple(w.shape)}")
    n, k = w.shape
    blocks, nb, kb = _block_view(w.float(), FP8_BLOCK)
    amax = blocks.abs().amax(dim=(1, 3)).clamp_min(WEIGHT_AMAX_FLOOR)  # [nb, kb]
    scale = pow2_ceil(amax * _FP8_MAX_INV)
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    w_fp8 = q.reshape(nb * FP8_BLOCK, kb * FP8_BLOCK)[:n, :k].to(torch.float8_e4m3fn)
    return w_fp8.contiguous(), scale.to(torch.float8_e8m0fnu)


def expand_block_scales(scale: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """[ceil(N/32), ceil(K/32)] block scales -> [N, K] fp32 (one value per weight element)."""
    s = scale.float()
    return s.repeat_interleave(FP8_BLOCK, 0)[:n].repeat_interleave(FP8_BLOCK, 1)[:, :k]


def dequantize_fp8_blocks(
    w_fp8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """FP8 e4m3 [N, K] with 32x32 UE8M0 block scales -> [N, K] `dtype` (exact in fp32)."""
    if w_fp8.dim() != 2:
        raise ValueError(f"dequantize_fp8_blocks: w_fp8 must be [N, K], got {tuple(w_fp8.shape)}")
    n, k = w_fp8.shape
    want = (-(-n // FP8_BLOCK), -(-k // FP8_BLOCK))
    if tuple(scale.shape) != want:
        raise ValueError(
            f"dequantize_fp8_blocks: scale must be {list(want)} for w [{n}, {k}], "
            f"got {list(scale.shape)}"
        )
    return (w_fp8.float() * expand_block_scales(scale, n, k)).to(dtype)


# ---------------------------------------------------------------------------------------------
# FP4 e2m1: codes, packing, expert weights
# ---------------------------------------------------------------------------------------------


def e2m1_code(q: torch.Tensor) -> torch.Tensor:
    """Round fp32 values in [-6, 6] to e2m1 codes (uint8 0..15), ties to the even code.

    Midpoints 0.75, 1.75 and 3.5 round up (to codes 2, 4, 6); 0.25, 1.25, 2.5 and 5 round down.
    Negative values (including -0) get the sign bit.
    """
    a = q.abs()
    code = (
        (a > 0.25).to(torch.uint8)
        + (a >= 0.75).to(torch.uint8)
        + (a > 1.25).to(torch.uint8)
        + (a >= 1.75).to(torch.uint8)
        + (a > 2.5).to(torch.uint8)
        + (a >= 3.5).to(torch.uint8)
        + (a > 5.0).to(torch.uint8)
    )
    return code | (torch.signbit(q).to(torch.uint8) << 3)


def e2m1_value(code: torch.Tensor) -> torch.Tensor:
    """e2m1 codes (any integer dtype, low 4 bits used) -> fp32 values (code 8 is -0.0).

    Built from the fp32 bit pattern on the codes' device (a lookup table would be uploaded on every
    CUDA call): magnitude code m = 2e + f is 2**(e - 1) * (1 + f/2) for e >= 1 (fp32 exponent field
    e + 126, top mantissa bit f) and f/2 for e = 0 (0 or 0.5, exponent field 126 when f = 1).
    """
    c = code.to(torch.int32) & 0xF
    e, f = (c >> 1) & 3, c & 1
    normal = ((e + 126) << 23) | (f << 22)
    bits = torch.where(e > 0, normal, f * (126 << 23)) | ((c >> 3) << 31)
    return bits.view(torch.float32)


def pack_fp4(code: torch.Tensor) -> torch.Tensor:
    """[..., K] codes -> [..., K/2] int8, element 2j in the low nibble and 2j+1 in the high one."""
    _check_last_dim(code, 2, "pack_fp4")
    c = code.to(torch.uint8)
    return (c[..., 0::2] | (c[..., 1::2] << 4)).view(torch.int8)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """[..., K/2] int8 -> [..., K] uint8 codes (inverse of `pack_fp4`)."""
    p = packed.view(torch.uint8)
    return torch.stack((p & 0xF, p >> 4), dim=-1).flatten(-2)


def _fp4_ue8m0_groups(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (x / scale clamped to +-6, fp32 [..., K/block, block]; scale
    ``2**ceil(log2(amax / 6))`` fp32 [..., K/block, 1]), amax floored so the scale stays normal."""
    groups = x.float().unflatten(-1, (-1, block))
    amax = groups.abs().amax(-1, keepdim=True).clamp_min(FP4_MAX * 2.0**-126)
    scale = pow2_ceil(amax * _FP4_MAX_INV)
    return (groups / scale).clamp(-FP4_MAX, FP4_MAX), scale


def quantize_fp4_experts(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise an expert weight to FP4 e2m1 with one UE8M0 scale per 32 along K.

    w: [..., N, K] float (K a multiple of 32). Returns (packed [..., N, K/2] int8,
    scale [..., N, K/32] float8_e8m0fnu). The scale is ``2**ceil(log2(amax / 6))``.
    """
    _check_last_dim(w, FP4_BLOCK, "quantize_fp4_experts")
    q, scale = _fp4_ue8m0_groups(w, FP4_BLOCK)
    return pack_fp4(e2m1_code(q).flatten(-2)), scale.squeeze(-1).to(torch.float8_e8m0fnu)


def dequantize_fp4(
    packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """[..., N, K/2] int8 e2m1 pairs with [..., N, K/32] UE8M0 scales -> [..., N, K] `dtype`."""
    k = packed.shape[-1] * 2
    want = [*packed.shape[:-1], k // FP4_BLOCK]
    if list(scale.shape) != want or k % FP4_BLOCK:
        raise ValueError(
            f"dequantize_fp4: scale must be {want} for "
            f"packed {list(packed.shape)} (K={k}, a multiple of {FP4_BLOCK}), "
            f"got {list(scale.shape)}"
        )
    values = e2m1_value(unpack_fp4(packed)).unflatten(-1, (-1, FP4_BLOCK))
    return (values * scale.float().unsqueeze(-1)).flatten(-2).to(dtype)


def fp4_fragment_order(packed: torch.Tensor) -> torch.Tensor:
    """FP4 weights [..., N, K/2] (K a multiple of 128) with the bytes of each 64-byte K step (4
    scale groups of 16 bytes) reordered so that 16-byte chunk t holds bytes t, 4+t, 8+t, 12+t of
    group 0, then of groups 1, 2, 3. Those are the A-fragment bytes of lane t of an MMA quad
    (rows g, g+8; K slots 2t, 2t+1, 2t+8, 2t+9 of each k16 step), so a kernel can feed each
    16-byte load to the tensor cores without exchanging bytes between lanes. The scales do not
    move. Read by the cuda tier's wgmma kernels and the Triton tier (`fragment_weights`)."""
    steps = _fp4_steps(packed, "fp4_fragment_order")  # [.., group, word, byte]
    return steps.transpose(-1, -3).transpose(-1, -2).reshape(packed.shape)


def fp4_checkpoint_order(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of `fp4_fragment_order`: [..., N, K/2] bytes back in the checkpoint's order."""
    steps = _fp4_steps(packed, "fp4_checkpoint_order")  # [.., lane, group, word]
    return steps.transpose(-1, -2).transpose(-1, -3).reshape(packed.shape)


def _fp4_steps(packed: torch.Tensor, caller: str) -> torch.Tensor:
    """packed [..., N, K/2] viewed as [..., N, K/128, 4, 4, 4]: each 64-byte K step's bytes."""
    kb = packed.shape[-1]
    if kb % 64:
        raise ValueError(f"{caller}: K/2 = {kb} bytes per row must be a multiple of 64")
    return packed.reshape(*packed.shape[:-1], kb // 64, 4, 4, 4)


# ---------------------------------------------------------------------------------------------
# Activations
# ---------------------------------------------------------------------------------------------


def act_quant_fp8(x: torch.Tensor, block: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-`block` FP8 e4m3 activation quantisation with power-of-two (UE8M0) scales.

    x: [..., K] (K a multiple of `block`). Returns (x_fp8 [..., K] float8_e4m3fn,
    scale [..., K/block] fp32 powers of two) with ``x ~= x_fp8 * scale``.
    """
    _check_last_dim(x, block, "act_quant_fp8")
    groups = x.float().unflatten(-1, (-1, block))
    amax = groups.abs().amax(-1).clamp_min(ACT_AMAX_FLOOR)
    scale = pow2_ceil(amax * _FP8_MAX_INV)
    q = (groups / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX)
    return q.flatten(-2).to(torch.float8_e4m3fn), scale


def act_dequant_fp8(
    x_fp8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Inverse of `act_quant_fp8`: [..., K] fp8 and [..., K/b] scales -> [..., K] `dtype`."""
    block = x_fp8.shape[-1] // scale.shape[-1]
    groups = x_fp8.float().unflatten(-1, (-1, block))
    return (groups * scale.float().unsqueeze(-1)).flatten(-2).to(dtype)


def fake_quant_fp8_ue8m0(x: torch.Tensor, block: int = FP8_BLOCK) -> torch.Tensor:
    """FP8 e4m3 quantise-dequantise per `block` with power-of-two scales (window KV). Same dtype."""
    q, s = act_quant_fp8(x, block)
    return act_dequant_fp8(q, s, x.dtype)


def fake_quant_fp4_ue8m0(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """FP4 e2m1 quantise-dequantise per `block`, power-of-two scales (index keys and queries)."""
    _check_last_dim(x, block, "fake_quant_fp4_ue8m0")
    q, scale = _fp4_ue8m0_groups(x, block)
    return (e2m1_value(e2m1_code(q)) * scale).flatten(-2).to(x.dtype)


def fake_quant_fp4_e4m3_scale(x: torch.Tensor, block: int = 16) -> torch.Tensor:
    """FP4 e2m1 quantise-dequantise per `block` with an e4m3 scale ``e4m3(amax / 6)`` (compressed
    KV). amax is floored at ``6 * 2**-9`` so the scale is at least e4m3's smallest subnormal."""
    _check_last_dim(x, block, "fake_quant_fp4_e4m3_scale")
    groups = x.float().unflatten(-1, (-1, block))
    amax = groups.abs().amax(-1, keepdim=True).clamp_min(FP4_MAX * 2.0**-9)
    scale = (amax / FP4_MAX).to(torch.float8_e4m3fn).float()
    q = (groups / scale).clamp(-FP4_MAX, FP4_MAX)
    return (e2m1_value(e2m1_code(q)) * scale).flatten(-2).to(x.dtype)
