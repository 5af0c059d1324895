"""Decode (weight-bandwidth) rows of the kernel benchmark: the dense FP8 GEMM at M <= 256 and the
MoE layer at T <= 256, as CUDA-graph replays (how the engine runs decode), with candidates."""

from __future__ import annotations

import dataclasses

import torch
from bench_common import Rotating, bench_graphs, bench_ms
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
