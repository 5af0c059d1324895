"""Triton mHC ops, the math of `ref/mhc.py` with one launch per op (two for `hc_mixes`).

Every op is per token: a token's outputs depend only on its own inputs, and every reduction runs in
a fixed order inside one program (or, for `hc_mixes`, over a fixed split of K summed in a fixed
order), so results do not depend on how many tokens a call has (batch invariant). Sizes are runtime
ints; compile-time constants are block shapes and `hc` rounded up to a power of two.

exp uses libdevice and divisions are IEEE (`div_rn`), as torch's CUDA kernels compute them; under
TRITON_INTERPRET=1 (CPU tests) libdevice is unavailable and numpy's exp stands in.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from ._common import rsqrt

_SINKHORN_BLOCK_T = 32  # tokens per program in hc_split_sinkhorn
_BLOCK_D = 512  # hidden columns per program in hc_pre / hc_post
_MIX_BLOCK_T = 16  # tokens per program in hc_mixes (the smallest tl.dot M)
_MIX_BLOCK_K = 64  # K step of one tl.dot in hc_mixes
_MIX_K_CHUNK = 1024  # K per split in hc_mixes: fixed, so the sum order never depends on T


def _interpreted(kernel: object) -> bool:
    return type(kernel).__name__ == "InterpretedFunction"


@triton.jit
def _exp(v, ACCURATE: tl.constexpr):
    if ACCURATE:
        return libdevice.exp(v)
    else:
        return tl.exp(v)


@triton.jit
def _sigmoid(v, ACCURATE: tl.constexpr):
    # torch's CUDA sigmoid: 1 / (1 + exp(-v)) in fp32
    return tl.math.div_rn(1.0, 1.0 + _exp(-v, ACCURATE))


@triton.jit
def _sinkhorn_kernel(
    mix_ptr,
    scale_ptr,
    base_ptr,
    pre_ptr,
    post_ptr,
    comb_ptr,
    T,
    hc,
    mix_stride,
    iters,
    eps,
    BLOCK_T: tl.constexpr,
    HC_P: tl.constexpr,
    ACCURATE: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = t < T
    t64 = t.to(tl.int64)
    k = tl.arange(0, HC_P)
    kmask = k < hc
    s0 = tl.load(scale_ptr).to(tl.float32)
    s1 = tl.load(scale_ptr + 1).to(tl.float32)
    s2 = tl.load(scale_ptr + 2).to(tl.float32)
    row = mix_ptr + t64[:, None] * mix_stride
    m2 = tmask[:, None] & kmask[None, :]

    # pre = sigmoid(m s0 + b) + eps; post = 2 sigmoid(m s1 + b)  [BLOCK_T, HC_P]
    m = tl.load(row + k[None, :], mask=m2, other=0.0).to(tl.float32)
    b = tl.load(base_ptr + k, mask=kmask, other=0.0).to(tl.float32)
    pre = _sigmoid(m * s0 + b[None, :], ACCURATE) + eps
    m = tl.load(row + hc + k[None, :], mask=m2, other=0.0).to(tl.float32)
    b = tl.load(base_ptr + hc + k, mask=kmask, other=0.0).to(tl.float32)
    post = 2.0 * _sigmoid(m * s1 + b[None, :], ACCURATE)
    out2 = t64[:, None] * hc + k[None, :]
    tl.store(pre_ptr + out2, pre, mask=m2)
    tl.store(post_ptr + out2, post, mask=m2)

    # comb[j, k] = softmax_k(m s2 + b) + eps, padded entries held at 0  [BLOCK_T, HC_P, HC_P]
    jk = k[:, None] * hc + k[None, :]
    jkmask = kmask[:, None] & kmask[None, :]
    m3 = tmask[:, None, None] & jkmask[None, :, :]
    m = tl.load(row[:, :, None] + 2 * hc + jk[None, :, :], mask=m3, other=0.0).to(tl.float32)
    b = tl.load(base_ptr + 2 * hc + jk, mask=jkmask, other=0.0).to(tl.float32)
    logit = tl.where(jkmask[None, :, :], m * s2 + b[None, :, :], float("-inf"))
    mx = tl.where(kmask[None, :], tl.max(logit, axis=2), 0.0)  # padded rows: no -inf - -inf
    e = _exp(logit - mx[:, :, None], ACCURATE)
    c = tl.math.div_rn(e, tl.where(kmask[None, :], tl.sum(e, axis=2), 1.0)[:, :, None])
    c = tl.where(jkmask[None, :, :], c + eps, 0.0)
    # one column normalisation, then iters - 1 (row, column) pairs, each x / (sum + eps)
    c = tl.math.div_rn(c, tl.sum(c, axis=1)[:, None, :] + eps)
    for _ in range(iters - 1):
        c = tl.math.div_rn(c, tl.sum(c, axis=2)[:, :, None] + eps)
        c = tl.math.div_rn(c, tl.sum(c, axis=1)[:, None, :] + eps)
    tl.store(comb_ptr + t64[:, None, None] * (hc * hc) + jk[None, :, :], c, mask=m3)


def hc_split_sinkhorn(
    mixes: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    hc_mult: int,
    iters: int,
    eps: float,
    **_: object,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mixes [T, (2+hc)*hc] -> pre [T, hc], post [T, hc], comb [T, hc, hc] fp32 (see ref.mhc)."""
    hc = int(hc_mult)
    t = mixes.shape[0]
    if mixes.dim() != 2 or mixes.shape[1] != (2 + hc) * hc:
        raise ValueError(
            f"hc_split_sinkhorn: mixes must be [T, {(2 + hc) * hc}] for hc_mult={hc}, "
            f"got {list(mixes.shape)}"
        )
    if iters < 1:
        raise ValueError(f"hc_split_sinkhorn: iters must be >= 1, got {iters}")
    if mixes.stride(1) != 1:
        mixes = mixes.contiguous()
    dev = mixes.device
    pre = torch.empty(t, hc, dtype=torch.float32, device=dev)
    post = torch.empty(t, hc, dtype=torch.float32, device=dev)
    comb = torch.empty(t, hc, hc, dtype=torch.float32, device=dev)
    if t:
        _sinkhorn_kernel[(triton.cdiv(t, _SINKHORN_BLOCK_T),)](
            mixes,
            scale.contiguous(),
            base.contiguous(),
            pre,
            post,
            comb,
            t,
            hc,
            mixes.stride(0),
            int(iters),
            float(eps),
            BLOCK_T=_SINKHORN_BLOCK_T,
            HC_P=triton.next_power_of_2(hc),
            ACCURATE=not _interpreted(_sinkhorn_kernel),
            num_warps=4,
        )
    return pre, post, comb


@triton.jit
def _hc_pre_kernel(
    h_ptr,
    pre_ptr,
    out_ptr,
    hc,
    D,
    h_stride_t,
    h_stride_k,
    pre_stride_t,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    dmask = d < D
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for k in range(hc):
        p = tl.load(pre_ptr + t * pre_stride_t + k).to(tl.float32)
        x = tl.load(h_ptr + t * h_stride_t + k * h_stride_k + d, mask=dmask, other=0.0)
        acc += p * x.to(tl.float32)
    tl.store(out_ptr + t * D + d, acc.to(out_ptr.dtype.element_ty), mask=dmask)


def hc_pre(h: torch.Tensor, pre: torch.Tensor, **_: object) -> torch.Tensor:
    """Collapse the streams: h [T, hc, D], pre [T, hc] -> [T, D] h.dtype (fp32 sum)."""
    if h.dim() != 3 or pre.shape != h.shape[:2]:
        raise ValueError(
            f"hc_pre: h must be [T, hc, D] and pre [T, hc]; got {list(h.shape)}, {list(pre.shape)}"
        )
    t, hc, d = h.shape
    if d > 1 and h.stride(2) != 1:
        h = h.contiguous()
    if hc > 1 and pre.stride(1) != 1:
        pre = pre.contiguous()
    out = torch.empty(t, d, dtype=h.dtype, device=h.device)
    if t and d:
        _hc_pre_kernel[(t, triton.cdiv(d, _BLOCK_D))](
            h, pre, out, hc, d, h.stride(0), h.stride(1), pre.stride(0), BLOCK_D=_BLOCK_D
        )
    return out


@triton.jit
def _hc_post_kernel(
    y_ptr,
    res_ptr,
    post_ptr,
    comb_ptr,
    out_ptr,
    hc,
    D,
    y_stride_t,
    res_stride_t,
    res_stride_k,
    post_stride_t,
    comb_stride_t,
    HC_P: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    dmask = d < D
    k = tl.arange(0, HC_P)
    kmask = k < hc
    y = tl.load(y_ptr + t * y_stride_t + d, mask=dmask, other=0.0)
    post = tl.load(post_ptr + t * post_stride_t + k, mask=kmask, other=0.0).to(tl.float32)
    out = post[:, None] * y.to(tl.float32)[None, :]  # [HC_P, BLOCK_D]
    for j in range(hc):
        # comb[t, j, :] mixes stream j into every output stream k
        cj = tl.load(comb_ptr + t * comb_stride_t + j * hc + k, mask=kmask, other=0.0)
        rj = tl.load(res_ptr + t * res_stride_t + j * res_stride_k + d, mask=dmask, other=0.0)
        out += cj.to(tl.float32)[:, None] * rj.to(tl.float32)[None, :]
    dst = out_ptr + (t * hc + k[:, None]) * D + d[None, :]
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=kmask[:, None] & dmask[None, :])


def hc_post(
    y: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, **_: object
) -> torch.Tensor:
    """``out[k] = post[k] * y + sum_j comb[j, k] * residual[j]``.

    y [T, D]; residual [T, hc, D]; post [T, hc]; comb [T, hc, hc] -> [T, hc, D] y.dtype.
    """
    if residual.dim() != 3:
        raise ValueError(f"hc_post: residual must be [T, hc, D], got {list(residual.shape)}")
    t, hc, d = residual.shape
    if y.shape != (t, d) or post.shape != (t, hc) or comb.shape != (t, hc, hc):
        raise ValueError(
            f"hc_post: for residual [{t}, {hc}, {d}] need y [{t}, {d}], post [{t}, {hc}], "
            f"comb [{t}, {hc}, {hc}]; got {list(y.shape)}, {list(post.shape)}, "
            f"{list(comb.shape)}"
        )
    if d > 1 and y.stride(1) != 1:
        y = y.contiguous()
    if d > 1 and residual.stride(2) != 1:
        residual = residual.contiguous()
    if hc > 1 and post.stride(1) != 1:
        post = post.contiguous()
    if comb.stride(2) != 1 or comb.stride(1) != hc:
        comb = comb.contiguous()
    out = torch.empty(t, hc, d, dtype=y.dtype, device=y.device)
    if t and d:
        _hc_post_kernel[(t, triton.cdiv(d, _BLOCK_D))](
            y,
            residual,
            post,
            comb,
            out,
            hc,
            d,
            y.stride(0),
            residual.stride(0),
            residual.stride(1),
            post.stride(0),
            comb.stride(0),
            HC_P=triton.next_power_of_2(hc),
            BLOCK_D=_BLOCK_D,
        )
    return out


@triton.jit
def _hc_mixes_partial_kernel(
    x_ptr,
    fn_ptr,
    part_ptr,
    sq_ptr,
    T,
    K,
    mix,
    x_stride_t,
    fn_stride,
    K_CHUNK: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
    MIX_P: tl.constexpr,
):
    """part[s, t, :] = x[t, chunk s] . fn[:, chunk s]^T and sq[s, t] = sum x[t, chunk s]^2."""
    s = tl.program_id(1)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = t < T
    t64 = t.to(tl.int64)
    n = tl.arange(0, MIX_P)
    nmask = n < mix
    kk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_T, MIX_P), dtype=tl.float32)
    sq = tl.zeros((BLOCK_T,), dtype=tl.float32)
    for k0 in range(0, K_CHUNK, BLOCK_K):
        k = s * K_CHUNK + k0 + kk
        kmask = k < K
        x = tl.load(
            x_ptr + t64[:, None] * x_stride_t + k[None, :],
            mask=tmask[:, None] & kmask[None, :],
            other=0.0,
        ).to(tl.float32)
        w = tl.load(
            fn_ptr + n[None, :].to(tl.int64) * fn_stride + k[:, None],
            mask=kmask[:, None] & nmask[None, :],
            other=0.0,
        ).to(tl.float32)
        acc = tl.dot(x, w, acc, input_precision="ieee")
        sq += tl.sum(x * x, axis=1)
    base = s.to(tl.int64) * T + t64
    tl.store(part_ptr + base[:, None] * MIX_P + n[None, :], acc, mask=tmask[:, None])
    tl.store(sq_ptr + base, sq, mask=tmask)


@triton.jit
def _hc_mixes_finish_kernel(
    part_ptr,
    sq_ptr,
    out_ptr,
    T,
    K,
    mix,
    n_split,
    norm_eps,
    BLOCK_T: tl.constexpr,
    MIX_P: tl.constexpr,
    ACCURATE: tl.constexpr,
):
    """out[t] = (sum_s part[s, t]) * rsqrt(sum_s sq[s, t] / K + eps), the splits summed in order."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = t < T
    t64 = t.to(tl.int64)
    n = tl.arange(0, MIX_P)
    acc = tl.zeros((BLOCK_T, MIX_P), dtype=tl.float32)
    sq = tl.zeros((BLOCK_T,), dtype=tl.float32)
    for s in range(n_split):
        base = s * T + t64
        acc += tl.load(part_ptr + base[:, None] * MIX_P + n[None, :], mask=tmask[:, None])
        sq += tl.load(sq_ptr + base, mask=tmask)
    rstd = rsqrt(sq / K + norm_eps, ACCURATE)
    tl.store(
        out_ptr + t64[:, None] * mix + n[None, :],
        acc * rstd[:, None],
        mask=tmask[:, None] & (n < mix)[None, :],
    )


def hc_mixes(h: torch.Tensor, fn: torch.Tensor, norm_eps: float, **_: object) -> torch.Tensor:
    """``(flat(h) . fn^T) * rsqrt(mean(flat(h)^2) + norm_eps)``: h [T, hc, D], fn [mix, hc*D]
    -> [T, mix] fp32. Always batch invariant (the `batch_invariant` flag changes nothing here):
    K is cut into fixed 1024-wide splits whose partial sums are added in split order."""
    if h.dim() != 3:
        raise ValueError(f"hc_mixes: h must be [T, hc, D], got {list(h.shape)}")
    t = h.shape[0]
    k = h.shape[1] * h.shape[2]
    if fn.dim() != 2 or fn.shape[1] != k:
        raise ValueError(f"hc_mixes: fn must be [mix, {k}], got {list(fn.shape)}")
    x = h.reshape(t, k)
    if k > 1 and x.stride(1) != 1:
        x = x.contiguous()
    if fn.stride(1) != 1:
        fn = fn.contiguous()
    mix = fn.shape[0]
    mix_p = max(16, triton.next_power_of_2(mix))
    out = torch.empty(t, mix, dtype=torch.float32, device=h.device)
    if t == 0 or mix == 0:
        return out
    n_split = triton.cdiv(k, _MIX_K_CHUNK)
    part = torch.empty(n_split, t, mix_p, dtype=torch.float32, device=h.device)
    sq = torch.empty(n_split, t, dtype=torch.float32, device=h.device)
    _hc_mixes_partial_kernel[(triton.cdiv(t, _MIX_BLOCK_T), n_split)](
        x,
        fn,
        part,
        sq,
        t,
        k,
        mix,
        x.stride(0),
        fn.stride(0),
        K_CHUNK=_MIX_K_CHUNK,
        BLOCK_T=_MIX_BLOCK_T,
        BLOCK_K=_MIX_BLOCK_K,
        MIX_P=mix_p,
        num_warps=4,
    )
    _hc_mixes_finish_kernel[(triton.cdiv(t, 32),)](
        part,
        sq,
        out,
        t,
        k,
        mix,
        n_split,
        float(norm_eps),
        BLOCK_T=32,
        MIX_P=mix_p,
        ACCURATE=not _interpreted(_hc_mixes_finish_kernel),
    )
    return out
