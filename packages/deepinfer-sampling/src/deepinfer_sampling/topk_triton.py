"""Triton kernels of the top-k path: two-stage top-k over the vocabulary, then the whole draw.

Imported only on first CUDA use (sampler.py imports it lazily), never by
`import deepinfer_sampling`; without triton the Sampler keeps its torch path.

Stage 1, grid (rows, chunks): each program reads CHUNK logits of one row and keeps their K
largest. Values and token ids travel together as one int64 sort key,

    key = (order-preserving int32 of the float32 logit) << 32 | (2**32 - 1 - token id)

so that sorting keys descending sorts logits descending and, among equal logits, ids
ascending. Keys are unique per row, hence the K largest keys of the row are exactly the K largest
keys among the per-chunk K largest: the result does not depend on CHUNK.

Stage 2, grid (rows,): each program takes its row's chunk candidates, keeps the K largest
(sorted), and runs `sampler._draw_sorted` on them with the same float64 arithmetic as the torch
path (libdevice exp/log, IEEE division, no multiply-add pairs that could fuse): top-k, min-p,
top-p masks and the Gumbel-max draw with counter uniforms of (keys, token id). One kernel instead
of ~12 small torch kernels, which is what bounds a call at small batch sizes.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from .rng import _COLUMN_STEP, _MASK32, _MUL_A, _MUL_B, _TWO_POW_MINUS_52

__all__ = ["MAX_K", "topk_draw"]

# Largest max_top_k this path serves (larger ones use torch.topk): stage 2 holds
# chunks * K int64 keys per program.
MAX_K = 256
# Most keys stage 2 holds per row (chunks * padded k).
MAX_STAGE2_KEYS = 4096

_STEP: tl.constexpr = tl.constexpr(_COLUMN_STEP)
_M32: tl.constexpr = tl.constexpr(_MASK32)
_MA: tl.constexpr = tl.constexpr(_MUL_A)
_MB: tl.constexpr = tl.constexpr(_MUL_B)
_U_SCALE: tl.constexpr = tl.constexpr(_TWO_POW_MINUS_52)


@triton.jit
def _chunk_topk_kernel(x_ptr, cand_ptr, vocab, CHUNK: tl.constexpr, K: tl.constexpr):
    """x float32 [R, vocab] contiguous -> cand int64 [R, NCH * K]: each chunk's K largest keys."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    num_chunks = tl.num_programs(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    inside = cols < vocab
    x = tl.load(x_ptr + row * vocab + cols, mask=inside, other=0.0)
    bits = x.to(tl.int32, bitcast=True)
    # Flip the magnitude bits of negative floats: signed int order == float order.
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    # Padding sorts below every real key, -inf included (int32 min is a NaN pattern).
    key = tl.where(inside, key, -2147483648)
    low = tl.where(inside, 4294967295 - cols.to(tl.int64), 0)
    packed = (key.to(tl.int64) << 32) | low
    top = tl.topk(packed, K)
    tl.store(cand_ptr + (row * num_chunks + chunk) * K + tl.arange(0, K), top)


if os.environ.get("TRITON_INTERPRET") == "1":  # CPU tests: the interpreter has no libdevice

    @triton.jit
    def _log64(x):
        return tl.log(x)

    @triton.jit
    def _exp64(x):
        return tl.exp(x)

else:  # __nv_log / __nv_exp, the functions torch's CUDA kernels call for float64

    @triton.jit
    def _log64(x):
        return libdevice.log(x)

    @triton.jit
    def _exp64(x):
        return libdevice.exp(x)


@triton.jit
def _mix32(x):
    x ^= x >> 16
    x = (x * _MA) & _M32
    x ^= x >> 15
    x = (x * _MB) & _M32
    x ^= x >> 15
    return x


@triton.jit
def _draw_kernel(
    cand_ptr,
    keys_ptr,
    key_stride,
    temperature_ptr,
    top_k_ptr,
    top_p_ptr,
    log_min_p_ptr,
    out_ptr,
    NC: tl.constexpr,
    K: tl.constexpr,
    USE_MIN_P: tl.constexpr,
    USE_TOP_P: tl.constexpr,
):
    """cand int64 [R, NC] -> out int64 [R]: the draw of sampler._draw_sorted on the top K."""
    row = tl.program_id(0).to(tl.int64)
    packed = tl.load(cand_ptr + row * NC + tl.arange(0, NC))
    top = tl.topk(packed, K)  # [K], descending
    key = (top >> 32).to(tl.int32)
    value = (key ^ ((key >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)
    ids = 4294967295 - (top & 4294967295)
    pos = tl.arange(0, K)
    neg_inf = float("-inf")
    # Positions past the row's top-k (and past the group's, which the torch path never holds)
    # are -inf: zero weight, -inf score, exactly like the torch path's masked candidates.
    value = tl.where(pos < tl.load(top_k_ptr + row), value, neg_inf)

    temperature = tl.load(temperature_ptr + row)
    v = value.to(tl.float64) / temperature
    # Counter uniform of (row keys, token id): rng._bits52_torch in int64 (never overflows).
    k0 = tl.load(keys_ptr + row)
    k1 = tl.load(keys_ptr + key_stride + row)
    k2 = tl.load(keys_ptr + 2 * key_stride + row)
    k3 = tl.load(keys_ptr + 3 * key_stride + row)
    spread = (ids * _STEP) & _M32
    hi = _mix32(spread ^ k0) ^ k1
    lo = _mix32(spread ^ k2) ^ k3
    bits52 = (_mix32(hi) << 20) | (_mix32(lo) >> 12)
    u = (bits52.to(tl.float64) + 0.5) * _U_SCALE
    score = v - _log64(-_log64(u))

    if USE_MIN_P or USE_TOP_P:
        v_max = tl.max(v, axis=0)  # == v[0], the largest candidate
        log_min_p = tl.load(log_min_p_ptr + row)
        weight = tl.where(v >= v_max + log_min_p, _exp64(v - v_max), 0.0)
        if USE_TOP_P:
            cumulative = tl.cumsum(weight, axis=0)
            mass = tl.sum(tl.where(pos == K - 1, cumulative, 0.0), axis=0)  # cumulative[-1]
            threshold = tl.load(top_p_ptr + row) * mass
            keep = (weight > 0.0) & (cumulative - weight < threshold)
        else:
            keep = weight > 0.0
        score = tl.where(keep, score, neg_inf)
    choice = tl.argmax(score, axis=0, tie_break_left=True)
    token = tl.sum(tl.where(pos == choice, ids, 0), axis=0)
    tl.store(out_ptr + row, token)


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def topk_draw(
    x: torch.Tensor,
    keys: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    log_min_p: torch.Tensor,
    *,
    max_top_k: int,
    use_min_p: bool,
    use_top_p: bool,
    chunk: int | None = None,
) -> torch.Tensor:
    """Sample among each row's top-k candidates, as sampler._sample_topk does with torch ops.

    x: float32 [r, V] processed logits (CUDA, or CPU under TRITON_INTERPRET=1).
    keys: int64 [4, r] counter-RNG keys. temperature, top_p, log_min_p: float64 [r, 1];
    top_k: int64 [r, 1] (each <= max_top_k <= MAX_K). chunk: stage-1 width (power of 2 >= the
    padded k; default max(4096, 32 * k), widened until stage 2 holds <= MAX_STAGE2_KEYS keys;
    tests lower it to exercise several chunks). Any CUDA device (launched on x's device).
    Returns int64 [r] token ids.
    """
    if not 1 <= max_top_k <= MAX_K:
        raise ValueError(f"max_top_k must be in [1, {MAX_K}], got {max_top_k}")
    if x.is_cuda and x.device.index != torch.cuda.current_device():
        # triton launches on the current device, not the tensors' one.
        with torch.cuda.device(x.device):
            return topk_draw(
                x,
                keys,
                temperature,
                top_k,
                top_p,
                log_min_p,
                max_top_k=max_top_k,
                use_min_p=use_min_p,
                use_top_p=use_top_p,
                chunk=chunk,
            )
    rows, vocab = x.shape
    x = x.contiguous()
    k = max(16, _next_pow2(max_top_k))
    chunk = chunk or max(4096, 32 * k)
    if chunk < k or chunk & (chunk - 1):
        raise ValueError(f"chunk must be a power of 2 >= {k}, got {chunk}")
    chunks = _next_pow2(triton.cdiv(vocab, chunk))
    # Stage 2 sorts chunks * k keys in one program; beyond MAX_STAGE2_KEYS its bitonic network
    # takes minutes to compile (32768 keys did not compile in a minute), so widen the chunks.
    while chunks * k > MAX_STAGE2_KEYS:
        chunk *= 2
        chunks = _next_pow2(triton.cdiv(vocab, chunk))
    cand = torch.empty(rows, chunks * k, dtype=torch.int64, device=x.device)
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    keys = keys.contiguous()
    _chunk_topk_kernel[(rows, chunks)](x, cand, vocab, CHUNK=chunk, K=k, num_warps=8)
    _draw_kernel[(rows,)](
        cand,
        keys,
        keys.stride(0),
        temperature.contiguous(),
        top_k.contiguous(),
        top_p.contiguous(),
        log_min_p.contiguous(),
        out,
        NC=chunks * k,
        K=k,
        USE_MIN_P=use_min_p,
        USE_TOP_P=use_top_p,
        num_warps=4,
    )
    return out
