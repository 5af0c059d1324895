"""Triton sparse attention with a per-head sink: one program per (token, block of heads).

Each program loads its token's query heads once, then walks the token's index list in tiles of
BLOCK_K: it gathers those kv rows once for all its heads (K = V, a single latent head shared by
every query head, which is why heads are blocked), scores them with one dot
``[BLOCK_H, d] @ [d, BLOCK_K]`` and accumulates ``p @ kv`` with an online softmax. The sink
enters as the softmax's starting state (running max = sink, running sum = exp(sink - sink) = 1,
accumulator 0), so it counts in the denominator only and a row with no valid index returns 0.

Numerics: bf16/fp16 operands go to the tensor cores with fp32 accumulation; q . kv of two bf16
values is exact in fp32, and the probabilities are split into a bf16 high part and a bf16
remainder (two dots) so `p @ kv` keeps ~16 bits of p, close to the reference's fp32 math. fp32
inputs use IEEE fp32 dots (correct, but they spill at d = 512: the registry sends fp32 calls to
the ref tier; the CPU tests use this path under the interpreter). Everything a row computes
depends only on that row (tile order is fixed by K), so the result is batch invariant by
construction, and -1 padding tiles are exact no-ops (alpha = 1, p = 0).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class AttentionConfig:
    """Tile sizes and launch shape. Chosen from (H, d) only, never from T, so a token's result
    does not depend on the batch it runs in."""

    block_h: int
    block_k: int
    num_warps: int
    num_stages: int


def attention_config(heads: int, head_dim: int) -> AttentionConfig:
    """V4.1 (H 64, d 512): 32 heads per program, so the [32, 512] fp32 accumulator takes 64
    registers per thread over 8 warps (no spills for bf16 on sm_90; 64-head blocks spill), and a
    decode batch of 64 tokens fills 128 programs.
    Smaller heads (the tiny model) take 16-head blocks and longer key tiles."""
    d_pad = max(16, triton.next_power_of_2(head_dim))
    block_h = min(32, max(16, triton.next_power_of_2(heads)))
    if d_pad >= 256:
        return AttentionConfig(block_h=block_h, block_k=32, num_warps=8, num_stages=2)
    return AttentionConfig(block_h=16, block_k=64, num_warps=4, num_stages=2)


@triton.jit
def _dot(a, b, acc, F32_DOT: tl.constexpr):
    """acc + a @ b with fp32 accumulation. F32_DOT runs fp32 IEEE dots (fp32 inputs, and the
    Triton interpreter, whose bf16 arithmetic is wrong); else the operands' own tensor-core dot."""
    if F32_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc)


# the pool size and index count change from step to step: no divisibility variants for them
@triton.jit(do_not_specialize=["K", "N", "stride_it"])
def _sparse_sink_attention_kernel(
    q_ptr,
    kv_ptr,
    idx_ptr,
    sink_ptr,
    o_ptr,
    H,
    D,
    K,
    N,
    stride_qt,
    stride_qh,
    stride_kv,
    stride_it,
    stride_ot,
    stride_oh,
    scale,
    BLOCK_H: tl.constexpr,
    BLOCK_K: tl.constexpr,
    D_PAD: tl.constexpr,
    SPLIT_P: tl.constexpr,
    F32_DOT: tl.constexpr,
):
    """q [T, H, D], kv [N, D] (unit last stride), idx [T, K], sink [H] -> o [T, H, D]."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, D_PAD)
    hmask = h < H
    dmask = d < D
    qmask = hmask[:, None] & dmask[None, :]
    q = tl.load(q_ptr + t * stride_qt + h[:, None] * stride_qh + d[None, :], mask=qmask, other=0.0)
    # online-softmax state starts at the sink: m = sink, l = exp(sink - m) = 1, acc = 0
    m = tl.load(sink_ptr + h, mask=hmask, other=0.0).to(tl.float32)
    l_sum = tl.full([BLOCK_H], 1.0, tl.float32)
    acc = tl.zeros([BLOCK_H, D_PAD], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        idx = tl.load(idx_ptr + t * stride_it + kk, mask=kk < K, other=-1).to(tl.int64)
        # an index past the pool is skipped like -1 (the reference would fail on it), so a bad
        # index can never read outside kv
        valid = (idx >= 0) & (idx < N)
        rows = tl.load(
            kv_ptr + idx[:, None] * stride_kv + d[None, :],
            mask=valid[:, None] & dmask[None, :],
            other=0.0,
        )  # [BLOCK_K, D_PAD], shared by every head of the block
        s = _dot(q, tl.trans(rows), tl.zeros([BLOCK_H, BLOCK_K], tl.float32), F32_DOT) * scale
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))  # finite: m starts at the sink
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        if SPLIT_P:
            p_hi = p.to(rows.dtype)
            p_lo = (p - p_hi.to(tl.float32)).to(rows.dtype)
            acc = _dot(p_hi, rows, acc, F32_DOT)
            acc = _dot(p_lo, rows, acc, F32_DOT)
        else:
            acc = _dot(p, rows, acc, F32_DOT)
        m = m_new
    o = acc / l_sum[:, None]
    tl.store(
        o_ptr + t * stride_ot + h[:, None] * stride_oh + d[None, :],
        o.to(o_ptr.dtype.element_ty),
        mask=qmask,
    )


def sparse_sink_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sink: torch.Tensor,
    scale: float,
    *,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """q [T, H, d], kv [N, d], indices [T, K] int (-1 = none), sink [H] fp32 -> [T, H, d] q.dtype.

    ``o[t,h] = sum_i exp(l_i) kv_i / (sum_i exp(l_i) + exp(sink_h))``, ``l_i = scale q.kv_i``;
    a row with no valid index is 0. Always batch invariant (`batch_invariant` is accepted for the
    registry's uniform call and changes nothing). Indices >= N are skipped like -1.
    """
    del batch_invariant  # every program computes one token's rows only
    t, h, d = q.shape
    n, k = kv.shape[0], indices.shape[1]
    out = torch.empty((t, h, d), dtype=q.dtype, device=q.device)
    if t == 0:
        return out
    if n == 0 or k == 0:
        return out.zero_()
    if q.stride(2) != 1:
        q = q.contiguous()
    if kv.stride(1) != 1:
        kv = kv.contiguous()
    if indices.stride(1) != 1:
        indices = indices.contiguous()
    sink = sink.contiguous().float()
    cfg = attention_config(h, d)
    native = q.dtype == kv.dtype and q.dtype in (torch.bfloat16, torch.float16)
    _sparse_sink_attention_kernel[(t, triton.cdiv(h, cfg.block_h))](
        q,
        kv,
        indices,
        sink,
        out,
        h,
        d,
        k,
        n,
        q.stride(0),
        q.stride(1),
        kv.stride(0),
        indices.stride(0),
        out.stride(0),
        out.stride(1),
        float(scale),
        BLOCK_H=cfg.block_h,
        BLOCK_K=cfg.block_k,
        D_PAD=max(16, triton.next_power_of_2(d)),
        SPLIT_P=native,
        # CPU tensors only ever run under the Triton interpreter (the CPU tests)
        F32_DOT=not native or q.device.type == "cpu",
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out
