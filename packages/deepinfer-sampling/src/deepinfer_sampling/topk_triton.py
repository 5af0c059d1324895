"""Triton kernels of the top-k path: exact top-k by group maxima, then the whole draw.

Imported only on first CUDA use (sampler.py imports it lazily), never by
`import deepinfer_sampling`; without triton the Sampler keeps its torch path.

Values and token ids travel together as one int64 sort key,

    key = (order-preserving int32 of the float32 logit) << 32 | (2**32 - 1 - token id)

so that sorting keys descending sorts logits descending and, among equal logits, ids
ascending. Keys are unique per row (padding past the vocabulary is int64 min, below -inf).

The row's K largest keys are found without sorting the row. Cut the row into groups of GROUP
consecutive tokens; the group maximum is the largest key of a group. Every one of the row's K
largest keys lies in one of the K groups with the largest maxima: if its group were not among
them, K other groups would hold K distinct keys larger than it. Hence two stages:

Stage 1, grid (rows, chunks): each program reads CHUNK logits of one row (the only full read
of the logits) and writes the largest min(K, CHUNK / GROUP) of its CHUNK / GROUP group maxima
(any chunk could hold all K winning groups, none needs more).

Stage 2, grid (rows,): each program keeps the K largest maxima of its row (the K winning
groups), gathers those K * GROUP logits (<= 4096, a few KB), keeps their K largest keys
(sorted), and runs `sampler._draw_sorted` on them with the same float64 arithmetic as the torch
path (libdevice exp/log, IEEE division, no multiply-add pairs that could fuse): top-k, min-p,
top-p masks and the Gumbel-max draw with counter uniforms of (keys, token id).

The K keys are exactly those a full sort would give (ties: lower token id first), whatever
CHUNK and GROUP are. This replaced a bitonic top-k of every 4096-logit chunk (about 1 ms for
256 rows x 129280 on the H200): stage 1 is now one read and a max per group (with the default
knobs it keeps all of its chunk's maxima and sorts nothing for k <= 128), and the sorting left
is two sorts of <= 4096 keys per row in stage 2: 0.13 ms for 256 rows at top-k 50. (An 8-bit
radix select was the other candidate: by our count of its lowering, tl.histogram costs ~75
instructions per element and 8-bit digit: four passes are compute-bound at ~0.3 ms here.)
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from .rng import _COLUMN_STEP, _MASK32, _MUL_A, _MUL_B, _TWO_POW_MINUS_52

__all__ = ["MAX_K", "topk_draw", "topk_keys"]

# Largest max_top_k this path serves (larger ones use torch.topk).
MAX_K = 256
# Most keys one stage-2 sort holds (chunks * kept maxima; K * GROUP): bitonic networks beyond
# this take minutes to compile (32768 keys did not compile in a minute).
MAX_STAGE2_KEYS = 4096
# Widest group: small groups make more maxima, wide ones a larger stage-2 gather.
MAX_GROUP = 32

_STEP: tl.constexpr = tl.constexpr(_COLUMN_STEP)
_M32: tl.constexpr = tl.constexpr(_MASK32)
_MA: tl.constexpr = tl.constexpr(_MUL_A)
_MB: tl.constexpr = tl.constexpr(_MUL_B)
_U_SCALE: tl.constexpr = tl.constexpr(_TWO_POW_MINUS_52)


@triton.jit
def _packed_keys(x_ptr, row, cols, vocab):
    """int64 keys (shape of cols) of logits x[row, cols]; int64 min where cols >= vocab."""
    inside = cols < vocab
    x = tl.load(x_ptr + row * vocab + cols, mask=inside, other=0.0)
    bits = x.to(tl.int32, bitcast=True)
    # Flip the magnitude bits of negative floats: signed int order == float order.
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    # Padding sorts below every real key, -inf included (int32 min is a NaN pattern).
    key = tl.where(inside, key, -2147483648)
    low = tl.where(inside, 4294967295 - cols.to(tl.int64), 0)
    return (key.to(tl.int64) << 32) | low


@triton.jit
def _group_max_kernel(
    x_ptr,
    cand_ptr,
    vocab,
    CHUNK: tl.constexpr,
    GROUP: tl.constexpr,
    KEPT: tl.constexpr,
):
    """x float32 [R, vocab] -> cand int64 [R, chunks * KEPT]: each chunk's KEPT largest maxima.

    A chunk has CHUNK // GROUP groups; KEPT = min(K, CHUNK // GROUP).
    """
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    num_chunks = tl.num_programs(1)
    cols = chunk.to(tl.int64) * CHUNK + tl.arange(0, CHUNK)
    packed = _packed_keys(x_ptr, row, cols, vocab)
    maxima = tl.max(tl.reshape(packed, (CHUNK // GROUP, GROUP)), axis=1)
    if KEPT < CHUNK // GROUP:
        maxima = tl.topk(maxima, KEPT)
    tl.store(cand_ptr + (row * num_chunks + chunk) * KEPT + tl.arange(0, KEPT), maxima)


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
def _select_draw_kernel(
    x_ptr,
    vocab,
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
    GROUP: tl.constexpr,
    USE_MIN_P: tl.constexpr,
    USE_TOP_P: tl.constexpr,
    KEYS_ONLY: tl.constexpr,
):
    """cand int64 [R, NC] group maxima, x float32 [R, vocab] -> out int64 [R].

    The row's K largest keys (from the K groups with the largest maxima), then the draw of
    sampler._draw_sorted on them. KEYS_ONLY: store the K keys to out int64 [R, K] instead.
    """
    row = tl.program_id(0).to(tl.int64)
    maxima = tl.load(cand_ptr + row * NC + tl.arange(0, NC))
    if NC > K:
        maxima = tl.topk(maxima, K)  # the K winning groups
    # A maximum's token id names its group (groups start at multiples of GROUP). Padding
    # maxima name no group (id 2**32 - 1): their columns are past the vocabulary.
    group = (4294967295 - (maxima & 4294967295)) // GROUP
    cols = group[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    packed = _packed_keys(x_ptr, row, cols, vocab)
    top = tl.topk(tl.reshape(packed, (packed.shape[0] * GROUP,)), K)  # [K], descending
    if KEYS_ONLY:
        tl.store(out_ptr + row * K + tl.arange(0, K), top)
        return
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


def _stage_shapes(k: int, vocab: int, chunk: int | None, group: int | None):
    """(chunk, group, kept, chunks) of the two stages for padded k; see topk_draw's knobs."""
    group = group or min(MAX_GROUP, MAX_STAGE2_KEYS // k)
    # Default: k groups per chunk, so stage 1 keeps every maximum and sorts nothing (H200,
    # 256 rows x 129280, k 64: 0.13 ms per call at chunk 2048 against 0.19 ms at 4096, whose
    # chunks sort 128 maxima); at least 2048 wide, so small k do not make tiny programs.
    chunk = chunk or max(2048, k * group)
    if chunk < k or chunk & (chunk - 1):
        raise ValueError(f"chunk must be a power of 2 >= {k}, got {chunk}")
    if group < 1 or group & (group - 1) or group > chunk or k * group > MAX_STAGE2_KEYS:
        raise ValueError(
            f"group must be a power of 2 <= chunk={chunk} and <= {MAX_STAGE2_KEYS // k} "
            f"(k={k}), got {group}"
        )
    kept = min(k, chunk // group)
    chunks = _next_pow2(triton.cdiv(vocab, chunk))
    # Stage 2 sorts chunks * kept maxima in one program: widen the chunks until that is at most
    # MAX_STAGE2_KEYS (one chunk keeps <= k <= MAX_K maxima, so this ends).
    while chunks * kept > MAX_STAGE2_KEYS:
        chunk *= 2
        kept = min(k, chunk // group)
        chunks = _next_pow2(triton.cdiv(vocab, chunk))
    return chunk, group, kept, chunks


def _padded_k(max_top_k: int) -> int:
    if not 1 <= max_top_k <= MAX_K:
        raise ValueError(f"max_top_k must be in [1, {MAX_K}], got {max_top_k}")
    return max(16, _next_pow2(max_top_k))


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
    group: int | None = None,
) -> torch.Tensor:
    """Sample among each row's top-k candidates, as sampler._sample_topk does with torch ops.

    x: float32 [r, V] processed logits (CUDA, or CPU under TRITON_INTERPRET=1).
    keys: int64 [4, r] counter-RNG keys. temperature, top_p, log_min_p: float64 [r, 1];
    top_k: int64 [r, 1] (each <= max_top_k <= MAX_K). Tuning knobs (the tokens do not depend
    on them; tests lower them to exercise several chunks and groups): group, tokens per group
    (power of 2 <= chunk with padded k * group <= MAX_STAGE2_KEYS; default
    min(MAX_GROUP, MAX_STAGE2_KEYS // padded k)); chunk, the stage-1 width in tokens (power of
    2 >= the padded k; default max(2048, padded k * group)), widened until stage 2 sorts
    <= MAX_STAGE2_KEYS maxima.
    Any CUDA device (launched on x's device). Returns int64 [r] token ids.
    """
    k = _padded_k(max_top_k)
    out = torch.empty(x.shape[0], dtype=torch.int64, device=x.device)
    params = (temperature, top_k, top_p, log_min_p)
    _launch(x, out, keys, params, k, use_min_p, use_top_p, False, chunk, group)
    return out


def topk_keys(
    x: torch.Tensor, max_top_k: int, *, chunk: int | None = None, group: int | None = None
) -> torch.Tensor:
    """The K = max(16, next power of 2 >= max_top_k) largest sort keys of each row, descending.

    x: float32 [r, V]. Returns int64 [r, K], key = (order-preserving int32 of the logit) << 32 |
    (2**32 - 1 - token id); int64 min past the vocabulary. The candidates topk_draw draws from
    (for tests and tools; chunk and group as in topk_draw).
    """
    k = _padded_k(max_top_k)
    out = torch.empty(x.shape[0], k, dtype=torch.int64, device=x.device)
    _launch(x, out, None, None, k, False, False, True, chunk, group)
    return out


def _launch(x, out, keys, params, k, use_min_p, use_top_p, keys_only, chunk, group) -> None:
    """Both stages on x's device; params: (temperature, top_k, top_p, log_min_p) or None."""
    if x.is_cuda and x.device.index != torch.cuda.current_device():
        # triton launches on the current device, not the tensors' one.
        with torch.cuda.device(x.device):
            return _launch(x, out, keys, params, k, use_min_p, use_top_p, keys_only, chunk, group)
    if x.dim() != 2 or x.dtype != torch.float32:
        raise ValueError(f"x must be float32 [rows, vocab], got {x.dtype} {tuple(x.shape)}")
    rows, vocab = x.shape
    x = x.contiguous()
    chunk, group, kept, chunks = _stage_shapes(k, vocab, chunk, group)
    cand = torch.empty(rows, chunks * kept, dtype=torch.int64, device=x.device)
    _group_max_kernel[(rows, chunks)](
        x, cand, vocab, CHUNK=chunk, GROUP=group, KEPT=kept, num_warps=8
    )
    if keys_only:  # the draw's inputs are never read: pass any pointers
        keys, params = cand, (cand,) * 4
    keys = keys.contiguous()
    _select_draw_kernel[(rows,)](
        x,
        vocab,
        cand,
        keys,
        keys.stride(0),
        *(p.contiguous() for p in params),
        out,
        NC=chunks * kept,
        K=k,
        GROUP=group,
        USE_MIN_P=use_min_p,
        USE_TOP_P=use_top_p,
        KEYS_ONLY=keys_only,
        num_warps=4,
    )
