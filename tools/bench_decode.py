"""Decode (weight-bandwidth) rows of the kernel benchmark: the dense FP8 GEMM at M <= 256 and the
MoE layer at T <= 256, as CUDA-graph replays (how the engine runs decode), with candidates."""

from __future__ import annotations

import dataclasses

import torch
from bench_common import Rotating, bench_graphs, bench_ms, chain_graph_ms, measure_copy_gbs
from bench_moe import MOE_D, MOE_E, MOE_I, MOE_K, MOE_LIMIT, moe_layer_weights, moe_routed_inputs


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

        t_torch = bench_ms(Rotating(torch_base, sets))
        for name, inv in (("auto", False), ("inv", True)):

            def fn(x, xq, xs, w, ws, inv=inv):
                return tl_linear.fp8_gemm(xq, xs, w, ws, torch.bfloat16, batch_invariant=inv)

            try:
                ms_eager = bench_ms(Rotating(fn, sets))
                ms_graph = bench_graphs(fn, sets) if m <= 256 else float("nan")
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
                ms = bench_graphs(
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
        ms = bench_graphs(lambda x, tw, ids: tmoe.build_routing(tw, ids, e, 16), sets)
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
                    ms = bench_graphs(
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
        t_torch = bench_ms(
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
                row(label, shape, bench_graphs(fn, sets), nbytes, t_torch)
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
                ms = bench_graphs(
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
                        ms = bench_graphs(
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
            bench_graphs(lambda p: gemv.sum_splits(p, torch.float32), [(tiny,)] * 2),
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
            bench_graphs(
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


# -- fourth pass: the engine's harness (L consecutive calls in one graph) ------------------------

CHAIN_L = 16
"""Calls per captured graph in the chained harness: L distinct weight sets (> L2 in total)."""


def decode4_rows(rows: list | None = None):
    """Fourth-pass decode rows. Every row twice: `1` = a graph of one call per weight set, replays
    rotating (the third pass's harness, `decode3`); `L16` = one graph of 16 consecutive calls on
    16 distinct weight sets (672 MB for 5120x8192, > L2), replay time / 16 (the engine's: one graph
    per decode step over all layers). Dense FP8 GEMM 5120x8192 at M = 1 / 2 / 16 / 64 (auto and
    batch-invariant defaults, and the TileLang swap-AB decode kernel `tl ...`, each candidate
    checked against the fp32 reference first; ` BAD` marks a miss), M=1 at 2112x7168 and
    32768x1280, floor probes (a tiny kernel; a bare streaming read of 42 MB), the MoE layer at
    T = 1 / 16 / 64 / 256 through `moe_experts` (auto / invariant; the chain is 8 calls on one
    layer's weights with 8 distinct routings: each call reads 6-384 distinct experts, 113 MB to
    7 GB, so L2 does not serve them either). Rows print as measured and are appended to `rows`
    (returned), so a caller keeps those measured before an interruption."""
    from deepinfer_kernels import quant
    from deepinfer_kernels.ref import linear as ref_linear
    from deepinfer_kernels.tilelang import decode_gemm as tld
    from deepinfer_kernels.triton import gemv
    from deepinfer_kernels.triton import linear as tl_linear
    from deepinfer_kernels.triton import moe as tmoe

    rows = [] if rows is None else rows

    def row(op, harness, shape, ms, nbytes):
        gbs = nbytes / ms / 1e6
        print(f"row {op:<30}{harness:<4}{shape:<16}{ms * 1e3:>9.2f} us {gbs:>7.0f} GB/s")
        rows.append(dict(op=op, harness=harness, shape=shape, ms=ms, bytes=nbytes))

    def both(op, shape, fn, sets, nbytes):
        try:
            row(op, "1", shape, bench_graphs(fn, sets[:4]), nbytes)
            row(op, f"L{len(sets)}", shape, chain_graph_ms(fn, sets), nbytes)
        except Exception as exc:  # reported; the other rows still run
            print(f"dec4 {op} {shape} failed: {type(exc).__name__}: {str(exc)[:400]}")

    T = tld.DecodeTileConfig
    tl_cands = {  # name: (config or None for pick_tile_config, the M it runs at); call 1 of the
        # fourth pass measured 32-B-row boxes (row_swizzle off), one CTA per SM, 4 stages at
        # 4 CTAs/SM, 8 chunks and 128-row weight tiles: none faster than the default
        "tl default": (None, (1, 2, 16, 64)),
        "tl fused": (T(fused_sum=True), (1, 2, 16, 64)),
        "tl d2": (T(depth=2), (1, 16, 64)),
        "tl fused d2": (T(fused_sum=True, depth=2), (1, 16, 64)),
        "tl fused st4 mb4": (T(fused_sum=True, num_stages=4, min_blocks=4), (1, 16)),
    }
    weights = {}

    def dense(n, k, ms_list, cands=True):
        weights.clear()
        weights[(n, k)] = [
            quant.quantize_fp8_blocks(torch.randn(n, k, device="cuda") * 0.02)
            for _ in range(CHAIN_L)
        ]
        nbytes = n * k + (n // 32 + 1) * (k // 32)
        for m in ms_list:
            sets = []
            for w, ws in weights[(n, k)]:
                xq, xs = quant.act_quant_fp8(torch.randn(m, k, device="cuda").bfloat16())
                sets.append((xq, xs, w, ws))
            shape = f"{m}x{n}x{k}"
            want = ref_linear.fp8_gemm(*sets[0], torch.float32).double()
            for inv in (False, True):
                both(
                    f"fp8_gemm[{'inv' if inv else 'auto'}]",
                    shape,
                    lambda xq, xs, w, ws, inv=inv: tl_linear.fp8_gemm(
                        xq, xs, w, ws, torch.bfloat16, batch_invariant=inv
                    ),
                    sets,
                    nbytes,
                )
            for name, (cfg, ms_for) in tl_cands.items():
                if m not in ms_for or (not cands and name not in ("tl default", "tl fused")):
                    continue
                if cfg is None:
                    cfg = tld.pick_tile_config(m, n, k)
                else:  # the candidate's schedule with the default's tile for this M
                    cfg = dataclasses.replace(cfg, block_t=tld.pick_tile_config(m, n, k).block_t)
                try:
                    got = tld.decode_gemm(*sets[0], torch.float32, cfg).double()
                    err = ((got - want).norm() / want.norm()).item()
                except Exception as exc:
                    print(f"dec4 {name} failed: {type(exc).__name__}: {str(exc)[:400]}")
                    continue
                print(f"dec4 {name} {shape} rel err {err:.2e}")
                both(
                    f"{name}{'' if err < 1e-4 else ' BAD'}",
                    shape,
                    lambda xq, xs, w, ws, cfg=cfg: tld.decode_gemm(
                        xq, xs, w, ws, torch.bfloat16, cfg
                    ),
                    sets,
                    nbytes,
                )
        weights.clear()

    def probes():
        """A tiny kernel (the graph's own cost per replay / per node) and a plain streaming read
        of a 42 MB weight (1280 programs x 32 KB, 16-byte loads), in both harnesses."""
        import triton
        import triton.language as tl

        @triton.jit
        def read_kernel(w_ptr, out_ptr, BLOCK: tl.constexpr):
            pid = tl.program_id(0)
            v = tl.load(w_ptr + pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK))
            tl.store(out_ptr + pid, tl.sum(v, axis=0))

        tiny = [(torch.zeros(1, 1, 1, device="cuda"),) for _ in range(CHAIN_L)]
        both("probe[tiny kernel]", "1", lambda p: gemv.sum_splits(p, torch.float32), tiny, 4)
        ws = [
            torch.randint(0, 1 << 30, (5120 * 8192 // 4,), device="cuda", dtype=torch.int32)
            for _ in range(CHAIN_L)
        ]
        outs = torch.empty(5120 * 8192 // 4 // 8192, device="cuda", dtype=torch.int32)
        both(
            "probe[read 42 MB]",
            "5120x8192",
            lambda w: read_kernel[(outs.numel(),)](w, outs, BLOCK=8192, num_warps=4),
            [(w,) for w in ws],
            5120 * 8192,
        )
        del ws

    def moe():
        g = torch.Generator(device="cuda").manual_seed(0)
        experts, per_expert = moe_layer_weights(g)
        for t in (1, 16, 64, 256):
            sets = moe_routed_inputs(t, 8, g)
            active = sum(int(torch.unique(st[2]).numel()) for st in sets) / len(sets)
            for inv in (False, True):
                both(
                    f"moe_experts[{'inv' if inv else 'auto'}]",
                    f"T={t}",
                    lambda x, tw, ids, inv=inv: tmoe.moe_experts(
                        x, tw, ids, *experts, MOE_LIMIT, batch_invariant=inv
                    ),
                    sets,
                    active * per_expert,
                )
            if t > 16:
                continue
            # candidates for few tokens (not yet measured): narrower column blocks, so the
            # handful of expert tiles spreads over more programs (T=1: 6 tiles x 36 W1/W3 column
            # blocks = 216 programs for 132 SMs); the K order is unchanged, so the same bits
            want = tmoe.moe_experts(*sets[0], *experts, MOE_LIMIT)
            for name, cfg in (
                ("n1=32", dataclasses.replace(tmoe.DECODE, block_n1=32)),
                ("n1=32 n2=32", dataclasses.replace(tmoe.DECODE, block_n1=32, block_n2=32)),
            ):
                try:
                    got = tmoe.moe_experts(*sets[0], *experts, MOE_LIMIT, config=cfg)
                except Exception as exc:  # reported; the other rows still run
                    print(f"dec4 moe_experts[{name}] T={t} failed: {type(exc).__name__}: {exc}")
                    continue
                same = "" if torch.equal(got, want) else " BAD"
                both(
                    f"moe_experts[{name}]{same}",
                    f"T={t}",
                    lambda x, tw, ids, cfg=cfg: tmoe.moe_experts(
                        x, tw, ids, *experts, MOE_LIMIT, config=cfg
                    ),
                    sets,
                    active * per_expert,
                )

    def prefill_invariant(n, k):
        """Batch-invariant mode above decode sizes: `fp8_gemm[inv]` (now the TileLang decode
        kernel at every M, 64-token tiles) against the Triton invariant tiles it replaced
        (`pick_config(..., tilelang_decode=False)`), eager, rotating over 2 weight sets."""
        ws_sets = [
            quant.quantize_fp8_blocks(torch.randn(n, k, device="cuda") * 0.02) for _ in range(2)
        ]
        for m in (256, 2048, 8192):
            sets = []
            for w, ws in ws_sets:
                xq, xs = quant.act_quant_fp8(torch.randn(m, k, device="cuda").bfloat16())
                sets.append((xq, xs, w, ws))
            old = tl_linear.pick_config(m, n, k, True)
            fns = {
                "fp8_gemm[inv]": lambda xq, xs, w, ws: tl_linear.fp8_gemm(
                    xq, xs, w, ws, torch.bfloat16, batch_invariant=True
                ),
                "triton inv tiles": lambda xq, xs, w, ws, old=old: tl_linear.fp8_gemm(
                    xq, xs, w, ws, torch.bfloat16, batch_invariant=True, config=old
                ),
                "fp8_gemm[auto]": lambda xq, xs, w, ws: tl_linear.fp8_gemm(
                    xq, xs, w, ws, torch.bfloat16
                ),
            }
            for name, fn in fns.items():
                try:
                    state = {"i": 0}

                    def call(fn=fn, state=state, sets=sets):
                        fn(*sets[state["i"] % len(sets)])
                        state["i"] += 1

                    ms = bench_ms(call)
                    tf = 2.0 * m * n * k / ms / 1e9
                    print(f"row {name:<30}eager {m}x{n}x{k}: {ms:.4f} ms {tf:.0f} TFLOP/s")
                    rows.append(
                        dict(op=name, harness="eager", shape=f"{m}x{n}x{k}", ms=ms, bytes=n * k)
                    )
                except Exception as exc:
                    print(f"dec4 {name} {m}x{n}x{k} failed: {type(exc).__name__}: {exc}")

    # most telling first, so that a run cut off by its time limit still has them
    dense(5120, 8192, (16, 1, 64, 2))
    probes()
    dense(2112, 7168, (1, 16), cands=False)
    dense(32768, 1280, (1, 16), cands=False)
    prefill_invariant(5120, 8192)
    moe()
    return rows


def print_decode4_table(rows, copy_gbs: float) -> None:
    """The decode4 rows side by side: single-call graph (`1`) and chained (`L`) per op."""
    print(f"\ndecode4 (copy ceiling {copy_gbs:.0f} GB/s; %bw on weight/expert bytes)")
    print(f"{'op':<30}{'shape':<16}{'us[1]':>8}{'%bw':>6}{'us[L]':>8}{'%bw':>6}")
    seen = {}
    for r in rows:
        if r["harness"] != "eager":
            seen.setdefault((r["op"], r["shape"]), {})[r["harness"][:1]] = r
    for (op, shape), h in seen.items():
        cells = ""
        for key in ("1", "L"):
            r = h.get(key)
            if r is None:
                cells += f"{'-':>8}{'-':>6}"
            else:
                cells += f"{r['ms'] * 1e3:>8.1f}{100 * r['bytes'] / r['ms'] / 1e6 / copy_gbs:>6.1f}"
        print(f"{op:<30}{shape:<16}{cells}")
    eager = [r for r in rows if r["harness"] == "eager"]
    if eager:
        print(f"\n{'op (eager, prefill sizes)':<30}{'shape':<16}{'ms':>8}{'TFLOP/s':>9}")
        for r in eager:
            m, n, k = (int(v) for v in r["shape"].split("x"))
            tf = 2.0 * m * n * k / r["ms"] / 1e9
            print(f"{r['op']:<30}{r['shape']:<16}{r['ms']:>8.3f}{tf:>9.0f}")


def main() -> None:
    """`python tools/bench_decode.py` (on the GPU machine): the decode4 rows and their table,
    JSON under $OUT (timing helpers from bench_common)."""
    import json
    import os
    import signal
    import sys

    # `timeout` sends SIGTERM: leave through the finally below, so the table still prints
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("bench_decode: SIGTERM"))
    if not torch.cuda.is_available():
        sys.exit("bench_decode: needs a CUDA GPU")
    copy_gbs = measure_copy_gbs()
    print(f"copy ceiling {copy_gbs:.0f} GB/s", flush=True)
    rows = []
    try:
        decode4_rows(rows)
    finally:
        path = os.path.join(os.environ.get("OUT", "."), "bench_decode4.json")
        with open(path, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), copy_gbs=copy_gbs, rows=rows), f)
        print_decode4_table(rows, copy_gbs)


if __name__ == "__main__":
    main()
