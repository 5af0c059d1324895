"""Triton `index_topk` and `candidate_blocks`: one launch each, the ref tier's choices exactly.

The ref tier sorts every row (stable, descending) and keeps the first k; a decode step launches
a dozen small torch ops for that. Here one program per row finds the k-th largest value by a
binary search over order-preserving int32 keys of the fp32 scores (at most 32 counting passes
over the row), then takes every entry above that threshold plus the lowest ids among the
entries equal to it, exactly the stable sort's pick, and writes the kept ids in ascending order.

Keys: fp32 bits, negatives' magnitude bits flipped, so signed int32 order is float order;
-0.0 and 0.0 share a key (the sort compares them equal); every NaN gets the largest key (the
sort puts NaN first when descending). Entries that are not visible score -inf, as in the ref.
A picked entry is written only if its score is above -inf and not NaN (the ref's ``> -inf``).
Sizes are runtime ints (not specialised, so a growing context does not recompile); block shapes
are the only compile-time constants.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_INT32_MIN: tl.constexpr = tl.constexpr(-2147483648)
_INT32_MAX: tl.constexpr = tl.constexpr(2147483647)


@triton.jit
def _order_key(v):
    """fp32 [BLOCK] -> int32 keys whose signed order is the float order (NaN largest)."""
    bits = v.to(tl.int32, bitcast=True)
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    key = tl.where(v == 0.0, 0, key)
    return tl.where(v != v, 0x7FFFFFFF, key)


@triton.jit
def _load(ptr, offs, n, visible):
    """Scores at `offs` (entries >= n read as -inf and are out of the row; entries >= visible
    score -inf) and their keys."""
    v = tl.load(ptr + offs, mask=offs < n, other=float("-inf")).to(tl.float32)
    v = tl.where(offs < visible, v, float("-inf"))
    return v, _order_key(v)


@triton.jit
def _count_ge(ptr, n, visible, thr, BLOCK: tl.constexpr):
    """How many of the row's n entries have a key >= thr (int64 scalar)."""
    c = tl.zeros([], dtype=tl.int64)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        _, key = _load(ptr, offs, n, visible)
        c += tl.sum(((key.to(tl.int64) >= thr) & (offs < n)).to(tl.int64), axis=0)
    return c


@triton.jit
def _threshold(ptr, n, visible, k, BLOCK: tl.constexpr):
    """(thr, need_eq): the stable descending sort's first min(k, n) entries are those with a
    key > thr plus the first `need_eq` (by id) with key == thr."""
    k_eff = tl.minimum(k, n).to(tl.int64)
    lo = tl.zeros([], dtype=tl.int64) + _INT32_MIN  # count(key >= lo) = n >= k_eff
    hi = tl.zeros([], dtype=tl.int64) + _INT32_MAX
    if k_eff >= n:
        hi = lo  # every entry is picked: no search (no key equals INT32_MIN)
    while lo < hi:
        mid = lo + (hi - lo + 1) // 2
        if _count_ge(ptr, n, visible, mid, BLOCK) >= k_eff:
            lo = mid
        else:
            hi = mid - 1
    return lo, k_eff - _count_ge(ptr, n, visible, lo + 1, BLOCK)


@triton.jit
def _pick(v, key, offs, n, thr, need_eq, eq_seen):
    """Which entries of this tile the stable sort picks (`eq_seen`: entries equal to the
    threshold in earlier tiles); returns (picked, kept = picked with a score above -inf, the
    number of threshold-equal entries in this tile)."""
    inb = offs < n
    eq = (key.to(tl.int64) == thr) & inb
    eq_i = eq.to(tl.int32)
    eq_rank = eq_seen + (tl.cumsum(eq_i, axis=0) - eq_i).to(tl.int64)
    picked = inb & ((key.to(tl.int64) > thr) | (eq & (eq_rank < need_eq)))
    kept = picked & (v > float("-inf"))  # NaN > -inf is false
    return picked, kept, tl.sum(eq_i, axis=0).to(tl.int64)


@triton.jit(do_not_specialize=["stride_t", "n", "topk"])
def _index_topk_kernel(
    scores_ptr, stride_t, lens_ptr, out_ptr, n, topk, BLOCK: tl.constexpr, OUT_BLOCK: tl.constexpr
):
    t = tl.program_id(0).to(tl.int64)
    row = scores_ptr + t * stride_t
    visible = tl.load(lens_ptr + t).to(tl.int64)
    thr, need_eq = _threshold(row, n, visible, topk, BLOCK)
    out = out_ptr + t * topk
    eq_seen = tl.zeros([], dtype=tl.int64)
    written = tl.zeros([], dtype=tl.int64)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        v, key = _load(row, offs, n, visible)
        _, kept, n_eq = _pick(v, key, offs, n, thr, need_eq, eq_seen)
        kept_i = kept.to(tl.int32)
        slot = written + (tl.cumsum(kept_i, axis=0) - kept_i).to(tl.int64)
        tl.store(out + slot, offs.to(tl.int64), mask=kept)
        eq_seen += n_eq
        written += tl.sum(kept_i, axis=0).to(tl.int64)
    for start in range(0, topk, OUT_BLOCK):
        slot = start + tl.arange(0, OUT_BLOCK)
        pad = (slot >= written) & (slot < topk)
        tl.store(out + slot, tl.full([OUT_BLOCK], -1, tl.int64), mask=pad)


@triton.jit(do_not_specialize=["stride_t", "n", "nb", "topk_blocks", "block_size"])
def _candidate_blocks_kernel(
    scores_ptr,
    stride_t,
    lens_ptr,
    block_ptr,
    keep_ptr,
    out_ptr,
    n,
    nb,
    topk_blocks,
    block_size,
    TILE_B: tl.constexpr,
    BS_P: tl.constexpr,
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    row = scores_ptr + t * stride_t
    visible = tl.load(lens_ptr + t).to(tl.int64)
    last = tl.where(visible > 0, (visible - 1) // block_size, -1)  # floor division, as the ref
    bscores = block_ptr + t * nb
    # block scores: max of the visible entries (NaN if any is NaN), the newest visible block +inf
    c = tl.arange(0, BS_P)
    for start in range(0, nb, TILE_B):
        b = start + tl.arange(0, TILE_B)
        j = b.to(tl.int64)[:, None] * block_size + c[None, :]
        inside = (b[:, None] < nb) & (c[None, :] < block_size) & (j < n)
        v = tl.load(row + j, mask=inside, other=float("-inf")).to(tl.float32)
        v = tl.where(inside & (j < visible), v, float("-inf"))
        has_nan = tl.max((v != v).to(tl.int32), axis=1) > 0
        m = tl.max(tl.where(v != v, float("-inf"), v), axis=1)
        m = tl.where(has_nan, float("nan"), m)
        m = tl.where(b == last, float("inf"), m)
        tl.store(bscores + b, m, mask=b < nb)
    tl.debug_barrier()
    thr, need_eq = _threshold(bscores, nb, nb, topk_blocks, BLOCK)
    keep = keep_ptr + t * nb
    eq_seen = tl.zeros([], dtype=tl.int64)
    for start in range(0, nb, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        v, key = _load(bscores, offs, nb, nb)
        _, kept, n_eq = _pick(v, key, offs, nb, thr, need_eq, eq_seen)
        tl.store(keep + offs, kept.to(tl.int8), mask=offs < nb)
        eq_seen += n_eq
    tl.debug_barrier()
    out = out_ptr + t * n
    for start in range(0, n, BLOCK):
        j = start + tl.arange(0, BLOCK).to(tl.int64)
        kb = tl.load(keep + j // block_size, mask=j < n, other=0)
        tl.store(out + j, ((kb != 0) & (j < visible)).to(tl.int8), mask=j < n)


def _row_major(scores: torch.Tensor) -> torch.Tensor:
    return scores if scores.stride(1) == 1 or scores.shape[1] <= 1 else scores.contiguous()


def _check(name: str, scores: torch.Tensor, lens: torch.Tensor) -> None:
    if scores.dim() != 2:
        raise ValueError(f"{name}: scores must be [T, N], got {list(scores.shape)}")
    if lens.shape != (scores.shape[0],):
        raise ValueError(f"{name}: lens must be [{scores.shape[0]}], got {list(lens.shape)}")


def index_topk(scores: torch.Tensor, lens: torch.Tensor, topk: int, **_: object) -> torch.Tensor:
    """As `ref.indexer.index_topk`: per row the `topk` best entries among the first lens[t] with
    a finite score, ascending ids, -1 padded, ties to the lower id. scores [T, N] (fp32/bf16/
    fp16), lens [T] int; returns [T, topk] int64."""
    _check("index_topk", scores, lens)
    if topk < 0:
        raise ValueError(f"index_topk: topk must be >= 0, got {topk}")
    t, n = scores.shape
    if t == 0 or n == 0 or topk == 0:
        return torch.full((t, topk), -1, dtype=torch.int64, device=scores.device)
    out = torch.empty((t, topk), dtype=torch.int64, device=scores.device)
    s = _row_major(scores)
    _index_topk_kernel[(t,)](
        s,
        s.stride(0),
        lens.contiguous(),
        out,
        n,
        topk,
        BLOCK=1024 if n > 256 else 256,
        OUT_BLOCK=256,
        num_warps=4,
    )
    return out


def candidate_blocks(
    scores: torch.Tensor, lens: torch.Tensor, topk_blocks: int, block_size: int, **_: object
) -> torch.Tensor:
    """As `ref.indexer.candidate_blocks`: bool [T, N], the entries of the `topk_blocks` best
    blocks of `block_size` entries (block score = max visible entry, the newest visible entry's
    block always kept), restricted to the visible entries."""
    _check("candidate_blocks", scores, lens)
    if block_size < 1 or topk_blocks < 0:
        raise ValueError(
            f"candidate_blocks: block_size must be >= 1 and topk_blocks >= 0, got "
            f"{block_size}, {topk_blocks}"
        )
    t, n = scores.shape
    if t == 0 or n == 0:
        return torch.zeros(t, n, dtype=torch.bool, device=scores.device)
    nb = -(-n // block_size)
    s = _row_major(scores)
    dev = scores.device
    block = torch.empty((t, nb), dtype=torch.float32, device=dev)  # scratch: block scores
    keep = torch.empty((t, nb), dtype=torch.int8, device=dev)  # scratch: kept blocks
    out = torch.empty((t, n), dtype=torch.uint8, device=dev)
    bs_p = triton.next_power_of_2(block_size)
    _candidate_blocks_kernel[(t,)](
        s,
        s.stride(0),
        lens.contiguous(),
        block,
        keep,
        out,
        n,
        nb,
        topk_blocks,
        block_size,
        TILE_B=max(1, 1024 // bs_p),
        BS_P=bs_p,
        BLOCK=1024 if max(n, nb) > 256 else 256,
        num_warps=4,
    )
    return out.view(torch.bool)
