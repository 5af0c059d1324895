"""The Triton MoE expert kernels (triton/moe.py) under the Triton interpreter on CPU, against the
float64 loops of test_moe.py: run by test_moe_interpreted.py in a subprocess with
TRITON_INTERPRET=1 (Triton reads it at import). Each configuration below exercises one option of
`MoeConfig` (grid order, scale prefetch, K steps, scale words, swapped operands); on
CPU the kernels run their F32_MATH paths (the same exact values through fp32; see `_dot`)."""

from __future__ import annotations

import sys
from dataclasses import replace

import torch
from deepinfer_kernels import quant
from deepinfer_kernels.triton import moe as tmoe
from test_moe import _experts_f64

M = tmoe.MoeConfig
CONFIGS = {
    "plain k64": M(32, 32, 32, 4, 4, 2, block_k=64),
    "cols_fast": M(32, 32, 64, 4, 4, 2, block_k=64, cols_fast=True),
    "prefetch": M(32, 32, 32, 4, 4, 2, block_k=64, prefetch_scales=True),
    "cols_fast prefetch words": M(
        16,
        32,
        32,
        4,
        4,
        2,
        block_k=128,
        cols_fast=True,
        prefetch_scales=True,
        scale_words=True,
    ),
    "fp4 words k2=64 stages2": M(
        32, 64, 32, 4, 4, 2, block_k=128, block_k2=64, stages2=3, cols_fast=True
    ),
    "m64-like w13 cols, w2 rows": M(
        16,
        32,
        64,
        4,
        4,
        2,
        block_k=64,
        cols_fast=True,
        cols_fast2=False,
        prefetch_scales=True,
    ),
    "swap prefetch": M(16, 32, 32, 4, 4, 2, swap_ab=True, block_k=64, prefetch_scales=True),
    "PREFILL": tmoe.PREFILL,
    # the decode tile with narrower column blocks
    "decode n32": M(16, 32, 32, 4, 4, 4, block_k=128),
    "decode prefetch": M(16, 64, 32, 4, 4, 4, block_k=128, prefetch_scales=True),
}
# run on the same weights in `quant.fp4_fragment_order`: bitwise the rows of their counterpart
FRAGMENT = {
    "PREFILL fragment": (tmoe.PREFILL, "PREFILL"),
    "fp4 words k2=64 fragment": ("fp4 words k2=64 stages2", "fp4 words k2=64 stages2"),
    "decode n32 fragment": ("decode n32", "decode n32"),
}


def experts(e, d, i, gen, scale=0.1):
    """FP4 experts whose per-32 scales differ from group to group (a wrong scale index shows)."""

    def q(n, k):
        spread = torch.randint(-3, 4, (e, n, k // 32), generator=gen).float().exp2()
        w = torch.randn(e, n, k, generator=gen) * scale * spread.repeat_interleave(32, -1)
        return quant.quantize_fp4_experts(w)

    (w1, s1), (w3, s3), (w2, s2) = q(i, d), q(i, d), q(d, i)
    return w1, s1, w3, s3, w2, s2


def main() -> None:
    gen = torch.Generator().manual_seed(7)
    t, d, i, e, k = 37, 256, 128, 5, 2
    x = (torch.randn(t, d, generator=gen) * 2).bfloat16()
    ws = experts(e, d, i, gen)
    ids = torch.stack([torch.randperm(e - 1, generator=gen)[:k] for _ in range(t)])  # e-1: empty
    ids[::4, 1] = -1  # experts held by another rank
    tw = torch.rand(t, k, generator=gen)
    want = _experts_f64(x, tw, ids, *ws, 0.5)
    failed = []
    for name, cfg in CONFIGS.items():
        got = tmoe.moe_experts(x, tw, ids, *ws, 0.5, config=cfg)
        err = ((got.double() - want).norm() / want.norm()).item()
        ok = got.dtype == torch.bfloat16 and err < 1e-2
        print(f"{name:28s} rel err {err:.2e} {'ok' if ok else 'FAILED'}")
        if not ok:
            failed.append(name)
    f = quant.fp4_fragment_order
    w1, s1, w3, s3, w2, s2 = ws
    frag = (f(w1), s1, f(w3), s3, f(w2), s2)
    for name, (cfg, twin) in FRAGMENT.items():
        cfg = CONFIGS[cfg] if isinstance(cfg, str) else cfg
        on_frag = replace(cfg, fragment_weights=True)
        got = tmoe.moe_experts(x, tw, ids, *frag, 0.5, config=on_frag, fragment_order=True)
        same = torch.equal(got, tmoe.moe_experts(x, tw, ids, *ws, 0.5, config=CONFIGS[twin]))
        print(f"{name:28s} {'bitwise its twin' if same else 'FAILED: not its twin'}")
        if not same:
            failed.append(name)
    if failed:
        print("failed:", failed)
        sys.exit(1)
    print("interpreted moe checks passed")


if __name__ == "__main__":
    main()
