"""Benchmark the deepinfer-kernels GPU ops on this machine and print one table.

For each op and shape: median time (CUDA events via triton.testing.do_bench), achieved TFLOP/s and
GB/s (the fewest bytes the op must move: each input read once, each output written once), percent
of the ceilings (FP8 dense 1495 TFLOP/s as DeepGEMM measured on our H200; copy bandwidth measured
here), and the speed-up over a torch baseline timed in the same run:
- fp8_gemm: dequantise the FP8 weight to bf16 + bf16 torch.matmul (`torch` column); the bf16
  matmul alone, with the weight dequantised beforehand, is in `mm_only`.
- moe: a loop over the active experts, each dequantising its FP4 weights to bf16 and running
  bf16 matmuls with the same clamped SwiGLU.
Decode shapes rotate among several weight sets / routings so the L2 cache does not serve them.

Usage (on the GPU machine): python tools/bench_kernels.py [--quick] [--json PATH] [--only PARTS]
`--only decode4` the decode rows (single-call and 16-call chained CUDA graphs; bench_decode.py);
`--only sweep` / `--only probe` the first pass's tile sweep and batch-invariance probe; `--only
tilelang` the TileLang and CUDA FP8 prefill GEMMs (`fp8_gemm[tilelang]`, `fp8_gemm[cuda]` and tile
variants, a trailing `!` marks a variant that failed its check).
Sections live beside it: `bench_moe.py` (the MoE layer), `bench_decode.py` (decode rows),
`bench_common.py` (timing helpers); this file is the command line and the dense GEMM rows.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys

import torch
from bench_common import FP8_CEILING_TFLOPS, Rotating, bench_graphs, bench_ms, measure_copy_gbs
from bench_decode import decode4_rows, print_decode4_table
from bench_moe import moe_rows


def torch_baselines(sets) -> tuple[float, float]:
    """The torch baselines of an FP8 GEMM over rotating (x, xq, xs, w, ws) sets, ms: dequantise
    the weight to bf16 + bf16 matmul (`torch`), and the matmul alone on weights dequantised
    beforehand (`mm_only`)."""
    from deepinfer_kernels import quant

    def dequant_matmul(x, xq, xs, w, ws):
        return x @ quant.dequantize_fp8_blocks(w, ws, torch.bfloat16).t()

    w_bf16 = [quant.dequantize_fp8_blocks(s[3], s[4], torch.bfloat16) for s in sets]
    t_torch = bench_ms(Rotating(dequant_matmul, sets))
    pairs = [(s[0], wd) for s, wd in zip(sets, w_bf16, strict=True)]
    t_mm = bench_ms(Rotating(lambda x, wd: x @ wd.t(), pairs))
    return t_torch, t_mm


def gemm_rows(shapes, quick):
    """fp8_gemm[auto] / [inv]: `ops.fp8_gemm`, the registry's choice in each mode (the mode set
    once around the timing, as an engine sets it);
    fp8_gemm[triton]: the triton tier's own choice (not --quick: [fp8mma], its FP8-MMA tiles);
    fp8_linear (through the registry, activation quantisation included) and [bf16A] at M > 256."""
    from deepinfer_kernels import REGISTRY, ops, quant
    from deepinfer_kernels.triton import linear as tl_linear

    rows = []
    for m, n, k in shapes:
        copies = max(1, min(4, (256 << 20) // (n * k)))  # > 256 MiB of weights in rotation
        sets = []
        for _ in range(copies):
            w, ws = quant.quantize_fp8_blocks(torch.randn(n, k, device="cuda") * 0.02)
            x = torch.randn(m, k, device="cuda").bfloat16()
            xq, xs = quant.act_quant_fp8(x)
            sets.append((x, xq, xs, w, ws))
        flops = 2.0 * m * n * k
        nbytes = n * k + (n // 32 + 1) * (k // 32) + m * k + m * k // 8 + 2 * m * n

        t_torch, t_mm = torch_baselines(sets)
        if m > 256:
            from deepinfer_kernels.triton.quant import act_fake_quant_bf16

            xa_sets = [(act_fake_quant_bf16(st[0]), st[3], st[4]) for st in sets]
            ms = bench_ms(
                Rotating(
                    lambda xa, w, ws: tl_linear.fp8_gemm(xa, xa, w, ws, torch.bfloat16), xa_sets
                )
            )
            rows.append(
                dict(
                    op="fp8_gemm[bf16A]",
                    shape=f"{m}x{n}x{k}",
                    ms=ms,
                    flops=flops,
                    bytes=nbytes + m * k,
                    torch_ms=t_torch,
                    mm_only_ms=t_mm,
                )
            )
            ms = bench_ms(Rotating(lambda x, xq, xs, w, ws: ops.fp8_linear(x, w, ws), sets))
            rows.append(
                dict(
                    op="fp8_linear",
                    shape=f"{m}x{n}x{k}",
                    ms=ms,
                    flops=flops,
                    bytes=nbytes + m * k,
                    torch_ms=t_torch,
                    mm_only_ms=t_mm,
                )
            )
        variants = [("auto", None), ("inv", None), ("triton", None)]
        if not quick:
            auto = tl_linear.pick_config(m, n, k, False)
            fp8mma = tl_linear.GemmConfig(
                auto.block_m, auto.block_n, auto.split_k, auto.num_warps, 3, dequant_bf16=False
            )
            variants.append(("fp8mma", fp8mma))
        for name, cfg in variants:
            if name in ("auto", "inv"):
                fn = Rotating(lambda x, xq, xs, w, ws: ops.fp8_gemm(xq, xs, w, ws), sets)
            else:
                fn = Rotating(
                    lambda x, xq, xs, w, ws, cfg=cfg: tl_linear.fp8_gemm(
                        xq, xs, w, ws, torch.bfloat16, config=cfg
                    ),
                    sets,
                )
            with REGISTRY.batch_invariant_mode(name == "inv"):
                ms = bench_ms(fn)
            rows.append(
                dict(
                    op=f"fp8_gemm[{name}]",
                    shape=f"{m}x{n}x{k}",
                    ms=ms,
                    flops=flops,
                    bytes=nbytes,
                    torch_ms=t_torch,
                    mm_only_ms=t_mm,
                )
            )
        del sets
    return rows


TILELANG_VARIANTS = [
    # (row name, TileConfig kwargs): the default (128x128, column-major activation scales, 128-B
    # rows, two wgmmas in flight, early scales) first, then one change each (H200 findings in
    # NOTES.md)
    ("tilelang", {}),
    ("tl 32B slices", {"row_swizzle": False}),
    ("tl invariant", None),  # batch-invariant mode: invariant_config(N, K), the decode K split
    ("tl late scales", {"early_scales": False}),
    ("tl sa rows", {"sa_col_major": False}),
    ("tl depth4 n2", {"n_split": 2, "depth": 4}),
    ("tl 128x192 n3 d3", {"block_n": 192, "n_split": 3, "depth": 3}),
    ("tl 128x256 n2 d1", {"block_n": 256, "n_split": 2, "depth": 1}),
]
CUDA_VARIANTS = [
    # (row name, Fp8GemmCudaConfig kwargs): the CUDA kernel (`cuda/fp8_gemm.cu`; fifteenth
    # session), its default first
    ("cuda", {}),
    ("cuda persistent", {"persistent": True}),  # one CTA per SM over the tiles
    ("cuda s5", {"stages": 5}),
    ("cuda n64", {"block_n": 64}),
    ("cuda g8", {"group_m": 8}),
]


def _gemm_variants(n: int, k: int, quick: bool) -> list:
    """(row name, fn(xq, xs, w, ws) -> bf16 out) of the TileLang and CUDA variants."""
    from deepinfer_kernels.cuda import fp8_gemm as cg
    from deepinfer_kernels.tilelang import fp8_gemm as tg

    out = []
    for name, kwargs in TILELANG_VARIANTS[:4] if quick else TILELANG_VARIANTS:
        cfg = tg.invariant_config(n, k) if kwargs is None else tg.TileConfig(**kwargs)
        out.append((name, lambda *a, cfg=cfg: tg.fp8_gemm(*a, torch.bfloat16, config=cfg)))
    for name, kwargs in CUDA_VARIANTS[:2] if quick else CUDA_VARIANTS:
        cfg = cg.Fp8GemmCudaConfig(**kwargs)
        out.append((name, lambda *a, cfg=cfg: cg.fp8_gemm(*a, torch.bfloat16, config=cfg)))
    return out


def tilelang_rows(quick):
    """fp8_gemm[tilelang] (deepinfer_kernels.tilelang.fp8_gemm) and fp8_gemm[cuda]
    (deepinfer_kernels.cuda.fp8_gemm), FP8 wgmma with per-32 promotion, at prefill shapes, beside
    the Triton default (`fp8_gemm[triton]`) and the torch baselines of the same run. Each variant is
    checked against ref (printed) before it is timed."""
    from deepinfer_kernels import quant
    from deepinfer_kernels.ref import linear as ref_linear
    from deepinfer_kernels.triton import linear as tl_linear

    shapes = [(128, 5120, 8192), (512, 5120, 8192), (2048, 5120, 8192), (8192, 5120, 8192)]
    shapes += [(8192, 32768, 1280), (16384, 5120, 8192)]
    rows = []
    for m, n, k in shapes:
        copies = max(1, min(4, (256 << 20) // (n * k)))  # > 256 MiB of weights in rotation
        sets = []
        for _ in range(copies):
            w, ws = quant.quantize_fp8_blocks(torch.randn(n, k, device="cuda") * 0.02)
            x = torch.randn(m, k, device="cuda").bfloat16()
            xq, xs = quant.act_quant_fp8(x)
            sets.append((x, xq, xs, w, ws))
        flops = 2.0 * m * n * k
        nbytes = n * k + (n // 32 + 1) * (k // 32) + m * k + m * k // 8 + 2 * m * n
        shape = f"{m}x{n}x{k}"

        t_torch, t_mm = torch_baselines(sets)
        base = dict(shape=shape, flops=flops, bytes=nbytes, torch_ms=t_torch, mm_only_ms=t_mm)
        ms = bench_ms(
            Rotating(
                lambda x, xq, xs, w, ws: tl_linear.fp8_gemm(xq, xs, w, ws, torch.bfloat16), sets
            )
        )
        rows.append(dict(op="fp8_gemm[triton]", ms=ms, **base))
        want = ref_linear.fp8_gemm(*sets[0][1:], torch.float32)
        for name, fn in _gemm_variants(n, k, quick):
            try:
                got = fn(*sets[0][1:])
            except Exception as e:  # a failing variant must not hide the others' numbers
                print(f"fp8_gemm[{name}] {shape}: FAILED {type(e).__name__}: {e}", flush=True)
                continue
            diff = got.double() - want.double()
            rel = (diff.norm() / want.double().norm()).item()
            ok = bool(torch.isfinite(got).all()) and rel < 1e-2
            ms = bench_ms(Rotating(lambda x, xq, xs, w, ws, fn=fn: fn(xq, xs, w, ws), sets))
            tflops = flops / ms / 1e9
            print(f"fp8_gemm[{name}] {shape}: rel {rel:.2e} {'ok' if ok else 'WRONG'} "
                  f"{ms:.4f} ms {tflops:.0f} TFLOP/s", flush=True)  # fmt: skip
            rows.append(dict(op=f"fp8_gemm[{name}]" + ("" if ok else "!"), ms=ms, rel=rel, **base))
        del sets, want
    return rows


def quant_rows():
    """The activation quantisers (triton tier; TileKernels' act_quant_fp8 as a `[vendor]` row
    when it is installed), at a prefill and a decode size."""
    import importlib.util

    from deepinfer_kernels.triton import quant as tq

    vtk = None
    if importlib.util.find_spec("tile_kernels") is not None:
        from deepinfer_kernels.vendor import tile_kernels as vtk
    rows = []
    for m in (8192, 64):
        x = torch.randn(m, 5120, device="cuda").bfloat16()
        w = (torch.rand(5120, device="cuda") + 0.5).bfloat16()
        cases = [
            ("act_quant_fp8", lambda x=x: tq.act_quant_fp8(x)),
            ("rms_norm_act_quant_fp8", lambda x=x, w=w: tq.rms_norm_act_quant_fp8(x, w, 1e-6)),
        ]
        if vtk is not None:  # TileKernels' fused RMSNorm is slower (NOTES.md): not a vendor op
            cases.append(("act_quant_fp8[vendor]", lambda x=x: vtk.act_quant_fp8(x)))
        for name, fn in cases:
            rows.append(
                dict(
                    op=name,
                    shape=f"{m}x5120 bf16",
                    ms=bench_ms(fn),
                    flops=0.0,
                    bytes=x.numel() * 2 + x.numel() + x.numel() // 8,
                    torch_ms=float("nan"),
                    mm_only_ms=float("nan"),
                )
            )
    gate = torch.randn(8192 * 6, 2304, device="cuda").bfloat16()
    up = torch.randn_like(gate)
    rw = torch.rand(8192 * 6, 1, device="cuda")
    nb = gate.numel() * 5 + gate.numel() // 8
    rows.append(
        dict(
            op="swiglu_act_quant_fp8",
            shape="49152x2304 bf16",
            ms=bench_ms(lambda: tq.swiglu_act_quant_fp8(gate, up, rw, 10.0)),
            flops=0.0,
            bytes=nb,
            torch_ms=float("nan"),
            mm_only_ms=float("nan"),
        )
    )
    return rows


def sweep_rows():
    """Candidate tile configurations for the decode/prefill GEMM and the decode MoE kernels."""
    from deepinfer_kernels import quant
    from deepinfer_kernels.triton import linear as tl_linear
    from deepinfer_kernels.triton import moe as tmoe
    from deepinfer_kernels.triton.quant import act_fake_quant_bf16

    G = tl_linear.GemmConfig
    rows = []
    cands = {
        1: [
            G(16, 64, 8, 4, 6, True, swap_ab=True),
            G(16, 64, 4, 4, 4, True, swap_ab=True, block_k=128),
            G(16, 64, 2, 4, 4, True, swap_ab=True, block_k=128),
            G(16, 64, 8, 4, 4, True, swap_ab=True, block_k=128),
            G(16, 64, 4, 4, 4, True, block_k=128),
        ],
        64: [
            G(64, 64, 4, 4, 5, True),
            G(64, 64, 2, 4, 5, True),
            G(16, 64, 4, 4, 4, True, swap_ab=True, block_k=128),
            G(64, 64, 4, 4, 4, True, block_k=64),
            G(64, 128, 2, 4, 5, True),
        ],
        8192: [
            G(128, 128, 1, 8, 4, True),
            G(128, 128, 1, 8, 3, True),
            G(128, 128, 1, 8, 4, True, block_k=64),
            G(128, 64, 1, 4, 5, True),
        ],
    }
    for m, cfgs in cands.items():
        n, k = 5120, 8192
        sets = []
        for _ in range(4 if m < 8192 else 1):
            w, ws = quant.quantize_fp8_blocks(torch.randn(n, k, device="cuda") * 0.02)
            xq, xs = quant.act_quant_fp8(torch.randn(m, k, device="cuda"))
            sets.append((xq, xs, w, ws))
        for cfg in cfgs:
            for a_bf16 in (False, True) if m == 8192 else (False,):
                args = [
                    (act_fake_quant_bf16(quant.act_dequant_fp8(a, b)) if a_bf16 else a, b, w, ws)
                    for a, b, w, ws in sets
                ]
                try:
                    ms = bench_ms(
                        Rotating(
                            lambda a, b, w, ws, cfg=cfg: tl_linear.fp8_gemm(
                                a, b, w, ws, torch.bfloat16, config=cfg
                            ),
                            args,
                        )
                    )
                except Exception as exc:  # a config that does not compile is reported, not fatal
                    print(f"sweep: {cfg} failed: {type(exc).__name__}: {str(exc)[:200]}")
                    continue
                rows.append(
                    dict(
                        op=f"sweep gemm{' bf16A' if a_bf16 else ''}",
                        shape=f"{m}x{n}x{k} {cfg.block_m}x{cfg.block_n} s{cfg.split_k} "
                        f"k{cfg.block_k} st{cfg.num_stages}{' swap' if cfg.swap_ab else ''}",
                        ms=ms,
                        flops=2.0 * m * n * k,
                        bytes=n * k + m * k,
                        torch_ms=float("nan"),
                        mm_only_ms=float("nan"),
                    )
                )
    d, i, e, kk = 5120, 2304, 384, 6
    g = torch.Generator(device="cuda").manual_seed(1)
    w1 = torch.randint(-128, 128, (e, i, d // 2), device="cuda", generator=g, dtype=torch.int8)
    w3, w2 = (
        torch.randint_like(w1, -128, 128),
        torch.randint(-128, 128, (e, d, i // 2), device="cuda", dtype=torch.int8),
    )

    def sc(*shape):
        u8 = torch.randint(118, 123, shape, device="cuda", dtype=torch.uint8)
        return u8.view(torch.float8_e8m0fnu)

    s1, s3, s2 = sc(e, i, d // 32), sc(e, i, d // 32), sc(e, d, i // 32)
    M = tmoe.MoeConfig
    moe_cands = {
        1: (
            M(16, 64, 64, 4, 4, 4, True, 128),
            M(16, 64, 64, 4, 4, 4, True, 64),
            M(16, 64, 128, 4, 4, 4, True, 128),
            M(16, 64, 64, 4, 4, 4, False, 128),
        ),
        64: (
            M(16, 64, 64, 4, 4, 4, True, 128),
            M(16, 64, 64, 4, 4, 4, False, 128),
            M(64, 64, 64, 4, 4, 4, True, 32),
        ),
        8192: (
            M(128, 64, 64, 8, 8, 4, False, 32),
            M(128, 64, 64, 8, 8, 4, False, 64),
            M(128, 64, 64, 8, 8, 3, False, 64),
        ),
    }
    for t in (1, 64, 8192):
        sets = []
        for _ in range(8 if t < 8192 else 1):
            x = torch.randn(t, d, device="cuda").bfloat16()
            ids = torch.rand(t, e, device="cuda").topk(kk, dim=-1).indices
            sets.append((x, torch.rand(t, kk, device="cuda"), ids))
        active = sum(int(torch.unique(st[2]).numel()) for st in sets) / len(sets)
        for cfg in moe_cands[t]:
            try:
                ms = bench_graphs(
                    lambda x, tw, ids, cfg=cfg: tmoe.moe_experts(
                        x, tw, ids, w1, s1, w3, s3, w2, s2, 10.0, config=cfg
                    ),
                    sets,
                )
            except Exception as exc:
                print(f"sweep: {cfg} failed: {type(exc).__name__}: {str(exc)[:200]}")
                continue
            rows.append(
                dict(
                    op="sweep moe graph",
                    shape=f"T={t} {cfg.block_m}x{cfg.block_n1}/{cfg.block_n2} "
                    f"k{cfg.block_k} st{cfg.stages}{' swap' if cfg.swap_ab else ''}",
                    ms=ms,
                    flops=6.0 * t * kk * d * i,
                    bytes=active * 3 * (i * d // 2 + i * d // 32),
                    torch_ms=float("nan"),
                    mm_only_ms=float("nan"),
                )
            )
    return rows


def invariance_probe() -> None:
    """Which GEMM tile configurations give bitwise-identical rows (same K step, no split-K)?"""
    from deepinfer_kernels import quant
    from deepinfer_kernels.triton import linear as tl_linear

    G = tl_linear.GemmConfig
    xq, xs = quant.act_quant_fp8(torch.randn(300, 4096, device="cuda"))
    w, ws = quant.quantize_fp8_blocks(torch.randn(2048, 4096, device="cuda"))
    cfgs = {
        "128x128 w8": G(128, 128, 1, 8, 4, True),
        "64x128 w4": G(64, 128, 1, 4, 5, True),
        "64x64 w4": G(64, 64, 1, 4, 5, True),
        "16x64 swap": G(16, 64, 1, 4, 6, True, swap_ab=True),
        "16x128 mma": G(16, 128, 1, 4, 6, True),
        "128x128 k64": G(128, 128, 1, 8, 4, True, block_k=64),
        "16x64 swap k128": G(16, 64, 1, 4, 4, True, swap_ab=True, block_k=128),
    }
    outs = {k: tl_linear.fp8_gemm(xq, xs, w, ws, torch.float32, config=c) for k, c in cfgs.items()}
    base = outs["64x128 w4"]
    for k, o in outs.items():
        print(
            f"invariance probe: {k:<18} bitwise equal to 64x128 w4: {torch.equal(o, base)}"
            f"  max|diff| {(o - base).abs().max().item():.3e}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer variants (no bf16-dequant GEMM)")
    ap.add_argument(
        "--json", default=os.path.join(os.environ.get("OUT", "."), "bench_kernels.json")
    )
    ap.add_argument(
        "--only",
        default="gemm,moe,quant",
        help="comma list of gemm, moe, quant, decode4 (single-call and "
        "16-call chained graphs, TileLang decode candidates), sweep, "
        "probe, tilelang (the TileLang and CUDA FP8 GEMMs at prefill shapes)",
    )
    ap.add_argument(
        "--moe-tokens",
        nargs="*",
        type=int,
        default=[1, 16, 64, 256, 8192],
        help="T of the MoE-layer rows (graph replays up to 256)",
    )
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_kernels: needs a CUDA GPU")
    torch.backends.cuda.matmul.allow_tf32 = False
    copy_gbs = measure_copy_gbs()
    print(f"copy ceiling {copy_gbs:.0f} GB/s", flush=True)
    parts = set(args.only.split(","))
    rows = []
    # `timeout` sends SIGTERM: leave through the finally below, so the finished parts still print
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("bench_kernels: SIGTERM"))
    try:
        if "quant" in parts:
            rows += quant_rows()
        if "gemm" in parts:
            shapes = [
                (1, 5120, 8192),
                (16, 5120, 8192),
                (64, 5120, 8192),
                (64, 32768, 1280),
                (128, 5120, 8192),
                (256, 5120, 8192),
                (2048, 5120, 8192),
                (8192, 5120, 8192),
                (8192, 32768, 1280),
                (16384, 5120, 8192),
            ]
            if args.quick:
                shapes = [s for s in shapes if s[0] in (1, 64, 256, 8192)]
            rows += gemm_rows(shapes, args.quick)
        if "moe" in parts:
            rows += moe_rows(args.moe_tokens, args.quick)
        if "decode4" in parts:  # its own table (single-call and chained graphs side by side)
            print_decode4_table(decode4_rows(), copy_gbs)
        if "tilelang" in parts:
            rows += tilelang_rows(args.quick)
        if "sweep" in parts:
            rows += sweep_rows()
        if "probe" in parts:
            invariance_probe()
    finally:
        print_table(rows, copy_gbs, args.json)


def print_table(rows: list[dict], copy_gbs: float, json_path: str) -> None:
    """The one table (and its rows as JSON at json_path): per row ms, TFLOP/s, GB/s, percent of
    the FP8 and copy ceilings, and the speed-up over the torch baselines."""
    dev = torch.cuda.get_device_name()
    with open(json_path, "w") as f:
        json.dump(dict(device=dev, copy_gbs=copy_gbs, rows=rows), f, indent=1)
    print(
        f"\n{dev}, torch {torch.__version__}; copy ceiling measured {copy_gbs:.0f} GB/s; "
        f"FP8 ceiling {FP8_CEILING_TFLOPS:.0f} TFLOP/s (DeepGEMM on H200)"
    )
    hdr = f"{'op':<24}{'shape':<30}{'ms':>9}{'TFLOP/s':>9}{'GB/s':>8}{'%fp8':>6}{'%bw':>6}"
    hdr += f"{'xtorch':>8}{'xmm':>7}"
    print(hdr)
    for r in rows:
        tf = r["flops"] / r["ms"] / 1e9
        gbs = r["bytes"] / r["ms"] / 1e6
        print(
            f"{r['op']:<24}{r['shape']:<30}{r['ms']:>9.4f}{tf:>9.1f}{gbs:>8.0f}"
            f"{100 * tf / FP8_CEILING_TFLOPS:>6.1f}{100 * gbs / copy_gbs:>6.1f}"
            f"{r['torch_ms'] / r['ms']:>8.2f}{r['mm_only_ms'] / r['ms']:>7.2f}"
        )


if __name__ == "__main__":
    main()
