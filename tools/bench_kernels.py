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
`--only decode3` the third pass's decode rows (graph replays, floor probes; NOTES.md);
`--only decode` measures just the decode rows (dense FP8 GEMM at M <= 256 and the MoE layer at
T <= 256, eager and CUDA-graph replays, auto and batch-invariant, plus decode-kernel candidates,
each checked against the reference before it is timed); `--only sweep` / `--only probe` the
first pass's tile sweep and batch-invariance probe; `--only tilelang` the TileLang FP8 GEMM
(`fp8_gemm[tilelang]` and tile variants, a trailing `!` marks a variant that failed its check).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import torch
import torch.nn.functional as F

FP8_CEILING_TFLOPS = 1495.0


def _bench(fn, rep_ms: int = 100) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median")


def _bench_graphs(fn, arg_sets) -> float:
    """Median time of replaying one CUDA graph per argument set (rotating): the way the engine
    runs decode, without the host's launch overhead."""
    graphs = []
    for args in arg_sets:
        fn(*args)  # compile and warm outside the capture
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn(*args)
        graphs.append(g)
    return _bench(Rotating(lambda g: g.replay(), [(g,) for g in graphs]))


def measure_copy_gbs() -> float:
    """Device-to-device copy of 2 GiB: bytes read + bytes written over the time."""
    a = torch.empty(1 << 31, dtype=torch.uint8, device="cuda").random_()
    b = torch.empty_like(a)
    ms = _bench(lambda: b.copy_(a))
    return 2 * a.numel() / ms / 1e6


class Rotating:
    """Calls fn(*args_i) cycling over several argument sets (to defeat the L2 cache)."""

    def __init__(self, fn, arg_sets):
        self.fn, self.arg_sets, self.i = fn, arg_sets, 0

    def __call__(self):
        args = self.arg_sets[self.i % len(self.arg_sets)]
        self.i += 1
        return self.fn(*args)


def gemm_rows(shapes, quick):
    from deepinfer_kernels import quant
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

        def torch_base(x, xq, xs, w, ws):
            wd = quant.dequantize_fp8_blocks(w, ws, torch.bfloat16)
            return x @ wd.t()

        w_bf16 = [quant.dequantize_fp8_blocks(s[3], s[4], torch.bfloat16) for s in sets]
        t_torch = _bench(Rotating(torch_base, sets))
        t_mm = _bench(
            Rotating(
                lambda x, wd: x @ wd.t(), [(s[0], wd) for s, wd in zip(sets, w_bf16, strict=True)]
            )
        )
        del w_bf16
        if m > 256:
            from deepinfer_kernels.triton.quant import act_fake_quant_bf16

            xa_sets = [(act_fake_quant_bf16(st[0]), st[3], st[4]) for st in sets]
            ms = _bench(
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
            ms = _bench(Rotating(lambda x, xq, xs, w, ws: tl_linear.fp8_linear(x, w, ws), sets))
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
        variants = [("auto", None, False), ("inv", None, True)]
        if not quick:
            auto = tl_linear.pick_config(m, n, k, False)
            fp8mma = tl_linear.GemmConfig(
                auto.block_m, auto.block_n, auto.split_k, auto.num_warps, 3, dequant_bf16=False
            )
            variants.append(("fp8mma", fp8mma, False))
        for name, cfg, inv in variants:
            fn = Rotating(
                lambda x, xq, xs, w, ws, cfg=cfg, inv=inv: tl_linear.fp8_gemm(
                    xq, xs, w, ws, torch.bfloat16, batch_invariant=inv, config=cfg
                ),
                sets,
            )
            ms = _bench(fn)
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
    # (row name, TileConfig kwargs): the default (128x128, column-major activation scales, two
    # wgmmas in flight) first, then one change each (H200 findings in NOTES.md: Nsight Compute
    # shows L2 94% busy at 128x128; a wider tile helps a little, deeper wgmma pipelines do not)
    ("tilelang", {}),
    ("tl sa rows", {"sa_col_major": False}),
    ("tl depth4 n2", {"n_split": 2, "depth": 4}),
    ("tl 128x192 n3 d3", {"block_n": 192, "n_split": 3, "depth": 3}),
    ("tl 128x256 n2 d1", {"block_n": 256, "n_split": 2, "depth": 1}),
    # 128-B rows with the 128-B swizzle (one TMA box per operand and stage): not yet measured
    ("tl row-swizzle", {"row_swizzle": True}),
    ("tl 128x256 row-swizzle", {"block_n": 256, "n_split": 2, "depth": 1, "row_swizzle": True}),
]


def tilelang_rows(quick):
    """fp8_gemm[tilelang] (deepinfer_kernels.tilelang.fp8_gemm, FP8 wgmma with per-32 promotion)
    at prefill shapes, beside the Triton default (`fp8_gemm[auto]`) and the torch baselines of the
    same run. Each variant is checked against ref (printed) before it is timed."""
    from deepinfer_kernels import quant
    from deepinfer_kernels.ref import linear as ref_linear
    from deepinfer_kernels.tilelang import fp8_gemm as tg
    from deepinfer_kernels.triton import linear as tl_linear

    shapes = [(128, 5120, 8192), (512, 5120, 8192), (2048, 5120, 8192), (8192, 5120, 8192)]
    shapes += [(8192, 32768, 1280), (16384, 5120, 8192)]
    variants = TILELANG_VARIANTS[:2] if quick else TILELANG_VARIANTS
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

        def torch_base(x, xq, xs, w, ws):
            return x @ quant.dequantize_fp8_blocks(w, ws, torch.bfloat16).t()

        w_bf16 = [quant.dequantize_fp8_blocks(s[3], s[4], torch.bfloat16) for s in sets]
        t_torch = _bench(Rotating(torch_base, sets))
        t_mm = _bench(
            Rotating(
                lambda x, wd: x @ wd.t(), [(s[0], wd) for s, wd in zip(sets, w_bf16, strict=True)]
            )
        )
        del w_bf16
        base = dict(shape=shape, flops=flops, bytes=nbytes, torch_ms=t_torch, mm_only_ms=t_mm)
        ms = _bench(
            Rotating(
                lambda x, xq, xs, w, ws: tl_linear.fp8_gemm(xq, xs, w, ws, torch.bfloat16), sets
            )
        )
        rows.append(dict(op="fp8_gemm[auto]", ms=ms, **base))
        want = ref_linear.fp8_gemm(*sets[0][1:], torch.float32)
        for name, kwargs in variants:
            cfg = tg.TileConfig(**kwargs)
            try:
                got = tg.fp8_gemm(*sets[0][1:], torch.bfloat16, config=cfg)
            except Exception as e:  # a failing variant must not hide the others' numbers
                print(f"fp8_gemm[{name}] {shape}: FAILED {type(e).__name__}: {e}", flush=True)
                continue
            diff = got.double() - want.double()
            rel = (diff.norm() / want.double().norm()).item()
            ok = bool(torch.isfinite(got).all()) and rel < 1e-2
            ms = _bench(
                Rotating(
                    lambda x, xq, xs, w, ws, cfg=cfg: tg.fp8_gemm(
                        xq, xs, w, ws, torch.bfloat16, config=cfg
                    ),
                    sets,
                )
            )
            tflops = flops / ms / 1e9
            print(f"fp8_gemm[{name}] {shape}: rel {rel:.2e} {'ok' if ok else 'WRONG'} "
                  f"{ms:.4f} ms {tflops:.0f} TFLOP/s", flush=True)  # fmt: skip
            rows.append(dict(op=f"fp8_gemm[{name}]" + ("" if ok else "!"), ms=ms, rel=rel, **base))
        del sets, want
    return rows


# One V4.1 MoE layer: hidden, expert intermediate, routed experts, top-k, SwiGLU limit.
MOE_D, MOE_I, MOE_E, MOE_K, MOE_LIMIT = 5120, 2304, 384, 6, 10.0


def moe_layer_weights(g: torch.Generator):
    """Random FP4 experts of one MoE layer on CUDA: (w1, s1, w3, s3, w2, s2), and the bytes one
    expert's three matrices occupy (packed values + UE8M0 scales)."""
    d, i, e = MOE_D, MOE_I, MOE_E

    def fp4(n, kk):
        packed = torch.randint(
            -128, 128, (e, n, kk // 2), device="cuda", generator=g, dtype=torch.int8
        )
        scale = torch.randint(
            118, 123, (e, n, kk // 32), device="cuda", generator=g, dtype=torch.uint8
        )
        return packed, scale.view(torch.float8_e8m0fnu)

    (w1, s1), (w3, s3), (w2, s2) = fp4(i, d), fp4(i, d), fp4(d, i)
    return (w1, s1, w3, s3, w2, s2), 3 * (i * d // 2 + i * d // 32)


def moe_routed_inputs(t: int, n_sets: int, g: torch.Generator):
    """n_sets random routed batches of t tokens: [(x [t, D] bf16, weights [t, k], ids [t, k])]."""
    sets = []
    for _ in range(n_sets):
        x = torch.randn(t, MOE_D, device="cuda", generator=g).bfloat16()
        ids = torch.rand(t, MOE_E, device="cuda", generator=g).topk(MOE_K, dim=-1).indices
        sets.append((x, torch.rand(t, MOE_K, device="cuda", generator=g), ids))
    return sets


def moe_rows(tokens_list, quick):
    from deepinfer_kernels import quant
    from deepinfer_kernels.triton import moe as tmoe

    d, i, e, k, limit = MOE_D, MOE_I, MOE_E, MOE_K, MOE_LIMIT
    g = torch.Generator(device="cuda").manual_seed(0)
    (w1, s1, w3, s3, w2, s2), per_expert_bytes = moe_layer_weights(g)
    rows = []
    for t in tokens_list:
        sets = moe_routed_inputs(t, 8 if t <= 256 else 1, g)
        active = sum(int(torch.unique(s[2]).numel()) for s in sets) / len(sets)
        nbytes = active * per_expert_bytes + 2 * t * d * 2 + t * k * 12
        flops = 6.0 * t * k * d * i

        def base(x, tw, ids):
            y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
            for ex in torch.unique(ids).tolist():
                r, c = torch.nonzero(ids == ex, as_tuple=True)
                a = quant.dequantize_fp4(w1[ex], s1[ex], torch.bfloat16)
                b = quant.dequantize_fp4(w3[ex], s3[ex], torch.bfloat16)
                o = quant.dequantize_fp4(w2[ex], s2[ex], torch.bfloat16)
                xe = x[r]
                gte, up = (
                    (xe @ a.t()).float().clamp(max=limit),
                    (xe @ b.t()).float().clamp(-limit, limit),
                )
                h = (F.silu(gte) * up * tw[r, c, None]).bfloat16()
                y.index_add_(0, r, (h @ o.t()).float())
            return y.bfloat16()

        t_torch = (
            _bench(Rotating(base, sets), rep_ms=50 if t > 256 else 100)
            if (t <= 256 or not quick)
            else float("nan")
        )
        route_ms = _bench(Rotating(lambda x, tw, ids: tmoe.build_routing(tw, ids, e, 16), sets))
        rows.append(
            dict(
                op="moe_routing",
                shape=f"T={t} E=384 k=6",
                ms=route_ms,
                flops=0.0,
                bytes=t * k * 12,
                torch_ms=float("nan"),
                mm_only_ms=float("nan"),
            )
        )
        if t <= 256:
            ms_graph = _bench_graphs(
                lambda x, tw, ids: tmoe.moe_experts(x, tw, ids, w1, s1, w3, s3, w2, s2, limit),
                sets,
            )
            rows.append(
                dict(
                    op="moe_experts[graph]",
                    shape=f"T={t} E=384 k=6 D=5120 I=2304",
                    ms=ms_graph,
                    flops=flops,
                    bytes=nbytes,
                    torch_ms=t_torch,
                    mm_only_ms=float("nan"),
                )
            )
        for name, inv in (("auto", False), ("inv", True)):
            fn = Rotating(
                lambda x, tw, ids, inv=inv: tmoe.moe_experts(
                    x, tw, ids, w1, s1, w3, s3, w2, s2, limit, batch_invariant=inv
                ),
                sets,
            )
            rows.append(
                dict(
                    op=f"moe_experts[{name}]",
                    shape=f"T={t} E=384 k=6 D=5120 I=2304",
                    ms=_bench(fn),
                    flops=flops,
                    bytes=nbytes,
                    torch_ms=t_torch,
                    mm_only_ms=float("nan"),
                )
            )
    # the gate at one decode and one prefill size
    wg = (torch.randn(e, d, device="cuda", generator=g) * 0.02).bfloat16()
    bias = torch.randn(e, device="cuda", generator=g) * 0.1
    for t in (64, 8192):
        x = torch.randn(t, d, device="cuda", generator=g).bfloat16()
        ms = _bench(lambda x=x: tmoe.moe_gate(x, wg, bias, k, 1.5))
        ref_ms = _bench(lambda x=x: _torch_gate(x, wg, bias, k, 1.5))
        rows.append(
            dict(
                op="moe_gate",
                shape=f"T={t} E=384 D=5120",
                ms=ms,
                flops=2.0 * t * e * d,
                bytes=e * d * 2 + t * d * 2 + t * k * 12,
                torch_ms=ref_ms,
                mm_only_ms=float("nan"),
            )
        )
    return rows


def decode_rows(quick):
    """The decode (weight-bandwidth) rows: dense FP8 GEMM at M <= 256 and the MoE layer at
    T <= 256, each timed eagerly and as CUDA-graph replays (how the engine runs decode), in auto
    and batch-invariant mode, plus a few candidate configurations of the decode kernels."""
    from deepinfer_kernels import quant
    from deepinfer_kernels.ref import linear as ref_linear
    from deepinfer_kernels.triton import gemv
    from deepinfer_kernels.triton import linear as tl_linear
    from deepinfer_kernels.triton import moe as tmoe

    rows = []

    def row(op, shape, ms, flops, nbytes, torch_ms=float("nan"), mm_ms=float("nan")):
        # printed as measured too, so a run cut off by a timeout still reports its rows
        print(f"row {op:<28}{shape:<30}{ms:>9.4f} ms {nbytes / ms / 1e6:>7.0f} GB/s", flush=True)
        rows.append(
            dict(
                op=op,
                shape=shape,
                ms=ms,
                flops=flops,
                bytes=nbytes,
                torch_ms=torch_ms,
                mm_only_ms=mm_ms,
            )
        )

    D = gemv.DecodeConfig
    sweep = {  # candidates for M=1/16 (block_m 16) and M=64 (block_m 64); split fixed per row
        "swap k128 s8": D(split_k=8),  # the default tiles at M > 64 (M tiles of 64 rows)
        "swap k128 s16": D(split_k=16),
        "swap k128 st3 s8": D(num_stages=3, split_k=8),
        "fp8 n64 st6 s8": D(block_k=32, num_stages=6, split_k=8, mma_fp8=True),
        "fp8 n128 st6 s4": D(block_n=128, block_k=32, num_stages=6, split_k=4, mma_fp8=True),
        "fp8 n128 st6 s8": D(block_n=128, block_k=32, num_stages=6, split_k=8, mma_fp8=True),
        "fp8 n128 st8 s16": D(block_n=128, block_k=32, num_stages=8, split_k=16, mma_fp8=True),
        "fp8 n256 w8 st4 s8": D(
            block_n=256, block_k=32, num_warps=8, num_stages=4, split_k=8, mma_fp8=True
        ),
        "fold A16 s8": D(block_n=32, split_k=8, fold=True),
    }
    shapes = [
        (1, 5120, 8192),
        (16, 5120, 8192),
        (64, 5120, 8192),
        (128, 5120, 8192),
        (256, 5120, 8192),
        (1, 2112, 7168),
        (64, 32768, 1280),
        (2048, 5120, 8192),
        (8192, 5120, 8192),
    ]
    for m, n, k in shapes:
        sets = []
        for _ in range(max(2, min(6, (256 << 20) // (n * k)))):
            w, ws = quant.quantize_fp8_blocks(torch.randn(n, k, device="cuda") * 0.02)
            x = torch.randn(m, k, device="cuda").bfloat16()
            xq, xs = quant.act_quant_fp8(x)
            sets.append((x, xq, xs, w, ws))
        flops = 2.0 * m * n * k
        nbytes = n * k + (n // 32 + 1) * (k // 32)  # weight bytes (what decode must stream)
        shape = f"{m}x{n}x{k}"

        def torch_base(x, xq, xs, w, ws):
            return x @ quant.dequantize_fp8_blocks(w, ws, torch.bfloat16).t()

        t_torch = _bench(Rotating(torch_base, sets))
        for name, inv in (("auto", False), ("inv", True)):

            def fn(x, xq, xs, w, ws, inv=inv):
                return tl_linear.fp8_gemm(xq, xs, w, ws, torch.bfloat16, batch_invariant=inv)

            try:
                ms_eager = _bench(Rotating(fn, sets))
                ms_graph = _bench_graphs(fn, sets) if m <= 256 else float("nan")
            except Exception as exc:  # reported, the other rows still run
                print(f"decode: fp8_gemm {name} {shape} failed: {type(exc).__name__}: {exc}")
                continue
            row(f"fp8_gemm[{name}]", shape, ms_eager, flops, nbytes, t_torch)
            if m <= 256:
                row(f"fp8_gemm[graph {name}]", shape, ms_graph, flops, nbytes, t_torch)
        if quick or m > 256 or n != 5120:
            continue
        for name, cfg in sweep.items():
            cfg = dataclasses.replace(cfg, block_m=16 if m <= 16 else 64)
            if m <= 64 and name == "swap k128 s8":
                continue  # the fp8_gemm[graph auto] row
            if m > 16 and name in ("swap k128 s16", "fp8 n128 st8 s16", "fp8 n256 w8 st4 s8"):
                continue
            if m > 64 and name not in ("swap k128 st3 s8", "fp8 n128 st6 s8", "swap k128 s8"):
                continue
            if cfg.fold:
                cfg = dataclasses.replace(cfg, block_m=64)
            a16 = "A16" in name
            # every candidate is checked against the fp32 reference before it is timed
            _, xq0, xs0, w0, ws0 = sets[0]
            want = ref_linear.fp8_gemm(xq0, xs0, w0, ws0, torch.float32)
            try:
                got = gemv.decode_gemm(
                    quant.act_dequant_fp8(xq0, xs0, torch.bfloat16) if a16 else xq0,
                    xs0,
                    w0,
                    ws0,
                    torch.float32,
                    cfg,
                )
                err = ((got.double() - want.double()).norm() / want.double().norm()).item()
            except Exception as exc:
                print(f"sweep: {name} failed: {type(exc).__name__}: {str(exc)[:300]}")
                continue
            name = f"{name} {'ok' if err < 1e-3 else 'BAD'}"
            print(f"sweep: {name} {shape} rel err {err:.2e}")
            try:
                ms = _bench_graphs(
                    lambda x, xq, xs, w, ws, cfg=cfg, a16=a16: gemv.decode_gemm(
                        x if a16 else xq, xs, w, ws, torch.bfloat16, cfg
                    ),
                    [(quant.act_dequant_fp8(st[1], st[2], torch.bfloat16), *st[1:]) for st in sets]
                    if a16
                    else sets,
                )
            except Exception as exc:  # a config that does not compile is reported, not fatal
                print(f"sweep: {name} failed: {type(exc).__name__}: {str(exc)[:300]}")
                continue
            row(f"sweep dec[{name}]", shape, ms, flops, nbytes)
        del sets

    # MoE decode: graph replays of the whole layer's experts, a few tile configurations
    d, i, e, k, limit = MOE_D, MOE_I, MOE_E, MOE_K, MOE_LIMIT
    g = torch.Generator(device="cuda").manual_seed(0)
    experts, per_expert = moe_layer_weights(g)
    M = tmoe.MoeConfig
    moe_cands = {
        "auto": None,
        "mma k128 m0": M(16, 64, 64, 4, 4, 4, False, 128),
        "mma k128 m2 n32": M(16, 32, 32, 4, 4, 4, False, 128, fp4_mode=2),
        "mma k128 m2 n32/64": M(16, 32, 64, 4, 4, 4, False, 128, fp4_mode=2),
        "mma k128 m2 st3": M(16, 64, 64, 4, 4, 3, False, 128, fp4_mode=2),
    }
    for t in (1, 16, 64, 256):
        sets = moe_routed_inputs(t, 8, g)
        active = sum(int(torch.unique(st[2]).numel()) for st in sets) / len(sets)
        nbytes = active * per_expert
        shape = f"T={t} E=384 k=6 D=5120 I=2304"
        ms = _bench_graphs(lambda x, tw, ids: tmoe.build_routing(tw, ids, e, 16), sets)
        row("moe_routing[graph]", f"T={t} E=384 k=6", ms, 0.0, t * k * 12)
        base = tmoe.moe_experts(*sets[0], *experts, limit)
        for name, cfg in moe_cands.items():
            if cfg is not None:  # candidates are checked against the default before timing
                got = tmoe.moe_experts(*sets[0], *experts, limit, config=cfg)
                err = ((got.double() - base.double()).norm() / base.double().norm()).item()
                print(f"sweep: moe {name} T={t} rel diff to auto {err:.2e}")
                name = f"{name} {'ok' if err < 1e-2 else 'BAD'}"
            for inv in (False, True) if cfg is None else (False,):
                try:
                    ms = _bench_graphs(
                        lambda x, tw, ids, cfg=cfg, inv=inv: tmoe.moe_experts(
                            x,
                            tw,
                            ids,
                            *experts,
                            limit,
                            batch_invariant=inv,
                            config=cfg,
                        ),
                        sets,
                    )
                except Exception as exc:
                    print(f"sweep: moe {name} failed: {type(exc).__name__}: {str(exc)[:300]}")
                    continue
                label = ("graph inv" if inv else "graph auto") if cfg is None else name
                row(f"moe_experts[{label}]", shape, ms, 6.0 * t * k * d * i, nbytes)
    return rows


def decode3_rows():
    """Third-pass decode rows, graph replays only (the engine's decode): the dense FP8 GEMM's
    defaults (auto, batch-invariant) at M = 1 / 2 / 16 / 64 (5120x8192) and M=1 (2112x7168,
    32768x1280), CUDA-core GEMV and swap candidates at M = 1 / 2 (each checked against the
    reference first; ` BAD` marks a miss), two floor probes (a graph of one tiny kernel; a bare
    streaming read of 42 MB), and the MoE layer's defaults at T = 1 / 16 / 64 / 256. Rows:
    `dec3[...]`, `probe[...]`, `moe3[...]`; call 1's other candidates are in NOTES.md."""
    from deepinfer_kernels import quant
    from deepinfer_kernels.ref import linear as ref_linear
    from deepinfer_kernels.triton import gemv
    from deepinfer_kernels.triton import linear as tl_linear
    from deepinfer_kernels.triton import moe as tmoe

    rows = []

    def row(op, shape, ms, nbytes, torch_ms=float("nan")):
        print(f"row {op:<34}{shape:<26}{ms:>9.4f} ms {nbytes / ms / 1e6:>7.0f} GB/s", flush=True)
        rows.append(
            dict(
                op=op,
                shape=shape,
                ms=ms,
                flops=0.0,
                bytes=nbytes,
                torch_ms=torch_ms,
                mm_only_ms=float("nan"),
            )
        )

    D = gemv.DecodeConfig
    cands = {  # name: (config, the M it runs at); the default rows come first
        # call 1 of the third pass: int32 scale words (swap, fp8, MoE) were slower, the chunked
        # CUDA-core GEMV (n16 c1024, partials + sum kernel) 28 us at M=1
        "swap bytes s8": (D(split_k=8), (1, 2)),
        "gemv full n4 nopf": (D(cuda_core=True, block_n=4, split_k=1, prefetch=False), (1, 2)),
        "gemv full n8": (D(cuda_core=True, block_n=8, split_k=1), (1,)),
        "gemv full n2": (D(cuda_core=True, block_n=2, split_k=1), (1,)),
        "gemv full n4 w8": (D(cuda_core=True, block_n=4, split_k=1, num_warps=8), (1,)),
        "gemv full n4": (D(cuda_core=True, block_n=4, split_k=1), (2,)),
        "gemv n16 c1024": (D(cuda_core=True, block_n=16, block_k=1024), (1, 2)),
        "gemv n16 c1024 nopf": (D(cuda_core=True, block_n=16, block_k=1024, prefetch=False), (1,)),
    }
    weights = {}

    def dense(n, k, m):
        if (n, k) not in weights:
            weights.clear()
            weights[(n, k)] = [
                quant.quantize_fp8_blocks(torch.randn(n, k, device="cuda") * 0.02)
                for _ in range(max(2, min(6, (256 << 20) // (n * k))))
            ]
        nbytes = n * k + (n // 32 + 1) * (k // 32)
        sets = []
        for w, ws in weights[(n, k)]:
            xq, xs = quant.act_quant_fp8(torch.randn(m, k, device="cuda").bfloat16())
            sets.append((xq, xs, w, ws))
        shape = f"{m}x{n}x{k}"
        want = ref_linear.fp8_gemm(*sets[0], torch.float32).double()
        t_torch = _bench(
            Rotating(
                lambda xq, xs, w, ws: (
                    quant.act_dequant_fp8(xq, xs, torch.bfloat16)
                    @ quant.dequantize_fp8_blocks(w, ws, torch.bfloat16).t()
                ),
                sets,
            )
        )
        for inv in (False, True):

            def fn(xq, xs, w, ws, inv=inv):
                return tl_linear.fp8_gemm(xq, xs, w, ws, torch.bfloat16, batch_invariant=inv)

            try:
                label = f"dec3[default {'inv' if inv else 'auto'}]"
                row(label, shape, _bench_graphs(fn, sets), nbytes, t_torch)
            except Exception as exc:
                print(f"dec3 default failed: {type(exc).__name__}: {str(exc)[:300]}")
        for name, (cfg, ms_for) in cands.items():
            if m not in ms_for or (n != 5120 and name != "gemv full n4 nopf"):
                continue
            if not cfg.cuda_core:
                cfg = dataclasses.replace(cfg, block_m=16 if m <= 16 else 64)
            try:
                got = gemv.decode_gemm(*sets[0], torch.float32, cfg).double()
                err = ((got - want).norm() / want.norm()).item()
                ms = _bench_graphs(
                    lambda xq, xs, w, ws, cfg=cfg: gemv.decode_gemm(
                        xq, xs, w, ws, torch.bfloat16, cfg
                    ),
                    sets,
                )
            except Exception as exc:
                print(f"dec3 {name} failed: {type(exc).__name__}: {str(exc)[:300]}")
                continue
            row(f"dec3[{name}{'' if err < 1e-3 else ' BAD'}]", shape, ms, nbytes, t_torch)

    def moe():
        limit = MOE_LIMIT
        g = torch.Generator(device="cuda").manual_seed(0)
        experts, per_expert = moe_layer_weights(g)
        moe_cands = {"default": None}  # words (call 1): 0.124 / 1.18 / 3.20 / 4.95 ms
        for t in (1, 16, 64, 256):
            sets = moe_routed_inputs(t, 8, g)
            active = sum(int(torch.unique(st[2]).numel()) for st in sets) / len(sets)
            nbytes = active * per_expert
            base = tmoe.moe_experts(*sets[0], *experts, limit).double()
            for name, cfg in moe_cands.items():
                for inv in (False, True) if cfg is None else (False,):
                    try:
                        got = tmoe.moe_experts(
                            *sets[0],
                            *experts,
                            limit,
                            batch_invariant=inv,
                            config=cfg,
                        ).double()
                        err = ((got - base).norm() / base.norm()).item()
                        ms = _bench_graphs(
                            lambda x, tw, ids, cfg=cfg, inv=inv: tmoe.moe_experts(
                                x,
                                tw,
                                ids,
                                *experts,
                                limit,
                                batch_invariant=inv,
                                config=cfg,
                            ),
                            sets,
                        )
                    except Exception as exc:
                        print(f"moe3 {name} failed: {type(exc).__name__}: {str(exc)[:300]}")
                        continue
                    label = f"{name} inv" if inv else name
                    row(f"moe3[{label}{'' if err < 1e-2 else ' BAD'}]", f"T={t}", ms, nbytes)

    def floor_probes():
        """What the harness itself costs: a graph of one tiny kernel, and a plain streaming read
        of the 5120x8192 weight (1280 programs x 32 KB, 16-byte loads, one add per 4 bytes)."""
        import triton
        import triton.language as tl

        @triton.jit
        def read_kernel(w_ptr, out_ptr, BLOCK: tl.constexpr):
            pid = tl.program_id(0)
            v = tl.load(w_ptr + pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK))
            tl.store(out_ptr + pid, tl.sum(v, axis=0))

        tiny = torch.zeros(1, 1, 1, device="cuda")
        row(
            "probe[graph of one tiny kernel]",
            "1",
            _bench_graphs(lambda p: gemv.sum_splits(p, torch.float32), [(tiny,)] * 2),
            4,
        )
        ws = [
            torch.randint(0, 1 << 30, (5120 * 8192 // 4,), device="cuda", dtype=torch.int32)
            for _ in range(6)
        ]
        outs = torch.empty(5120 * 8192 // 4 // 8192, device="cuda", dtype=torch.int32)
        row(
            "probe[read 42 MB, 32 KB/program]",
            "5120x8192",
            _bench_graphs(
                lambda w: read_kernel[(outs.numel(),)](w, outs, BLOCK=8192, num_warps=4),
                [(w,) for w in ws],
            ),
            5120 * 8192,
        )
        del ws

    # most telling first, so that a run cut off by its time limit still has them
    dense(5120, 8192, 1)
    floor_probes()
    dense(5120, 8192, 2)
    moe()
    for m in (16, 64):
        dense(5120, 8192, m)
    dense(2112, 7168, 1)
    dense(32768, 1280, 1)
    return rows


def _torch_gate(x, wg, bias, k, route_scale):
    s = torch.sqrt(F.softplus(x.float() @ wg.float().t()))
    ids = (s + bias).topk(k, dim=-1).indices
    w = s.gather(-1, ids)
    return w / (w.sum(-1, keepdim=True) + 1e-20) * route_scale, ids


def quant_rows():
    from deepinfer_kernels.triton import quant as tq

    rows = []
    x = torch.randn(8192, 5120, device="cuda").bfloat16()
    w = torch.rand(5120, device="cuda") + 0.5
    nbytes = x.numel() * 2 + x.numel() + x.numel() // 8
    for name, fn in (
        ("act_quant_fp8", lambda: tq.act_quant_fp8(x)),
        ("rms_norm_act_quant_fp8", lambda: tq.rms_norm_act_quant_fp8(x, w, 1e-6)),
    ):
        rows.append(
            dict(
                op=name,
                shape="8192x5120 bf16",
                ms=_bench(fn),
                flops=0.0,
                bytes=nbytes,
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
            ms=_bench(lambda: tq.swiglu_act_quant_fp8(gate, up, rw, 10.0)),
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
                    ms = _bench(
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
                ms = _bench_graphs(
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
        help="comma list of gemm, moe, quant, decode (decode GEMM/MoE rows + candidates), "
        "decode3 (third-pass decode candidates, graph replays), sweep, "
        "probe, tilelang (the TileLang FP8 GEMM at prefill shapes)",
    )
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_kernels: needs a CUDA GPU")
    torch.backends.cuda.matmul.allow_tf32 = False
    copy_gbs = measure_copy_gbs()
    print(f"copy ceiling {copy_gbs:.0f} GB/s", flush=True)
    parts = set(args.only.split(","))
    rows = []
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
        rows += moe_rows([1, 16, 64, 256, 8192], args.quick)
    if "decode" in parts:
        rows += decode_rows(args.quick)
    if "decode3" in parts:
        rows += decode3_rows()
    if "tilelang" in parts:
        rows += tilelang_rows(args.quick)
    if "sweep" in parts:
        rows += sweep_rows()
    if "probe" in parts:
        invariance_probe()
    dev = torch.cuda.get_device_name()
    with open(args.json, "w") as f:
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
