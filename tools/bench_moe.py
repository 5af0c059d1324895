"""MoE-layer rows of the kernel benchmark: one V4.1 MoE layer at real dimensions (random FP4
experts), the fused kernels against a torch loop over the active experts, and the router gate."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from bench_common import Rotating, bench_graphs, bench_ms

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
    """moe_routing, moe_experts through the registry (graph replay at decode sizes, and eager) in
    auto mode, batch-invariant mode, and batch-invariant mode on fragment-order weights
    (`inv frag`), against a torch loop; and the gate."""
    from deepinfer_kernels import REGISTRY, ops, quant
    from deepinfer_kernels.triton import moe as tmoe

    d, i, e, k, limit = MOE_D, MOE_I, MOE_E, MOE_K, MOE_LIMIT
    g = torch.Generator(device="cuda").manual_seed(0)
    (w1, s1, w3, s3, w2, s2), per_expert_bytes = moe_layer_weights(g)
    weights = {"auto": (w1, s1, w3, s3, w2, s2), "inv": (w1, s1, w3, s3, w2, s2)}
    weights["inv frag"] = fragment_experts(weights["auto"])
    # ops.moe_experts as the engine calls it (the registry's choice per size: the cuda tier at
    # decode sizes, Triton at prefill sizes), per row: whether the weights are in fragment order
    fragment_order = {"auto": False, "inv": False, "inv frag": True}
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
            bench_ms(Rotating(base, sets), rep_ms=50 if t > 256 else 100)
            if (t <= 256 or not quick)
            else float("nan")
        )
        route_ms = bench_ms(Rotating(lambda x, tw, ids: tmoe.build_routing(tw, ids, e, 16), sets))
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
        timings = []  # (row name, ms)
        for name, frag in fragment_order.items():

            def fn(x, tw, ids, frag=frag, ws=weights[name]):
                return ops.moe_experts(x, tw, ids, *ws, limit, fragment_order=frag)

            # the mode set once around the timing (captured in it), as an engine sets it
            with REGISTRY.batch_invariant_mode(name != "auto"):
                if t <= 256:
                    timings.append(
                        (f"graph {name}" if name != "auto" else "graph", bench_graphs(fn, sets))
                    )
                timings.append((name, bench_ms(Rotating(fn, sets))))
        for name, ms in timings:
            rows.append(
                dict(
                    op=f"moe_experts[{name}]",
                    shape=f"T={t} E=384 k=6 D=5120 I=2304",
                    ms=ms,
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
        ms = bench_ms(lambda x=x: tmoe.moe_gate(x, wg, bias, k, 1.5))
        ref_ms = bench_ms(lambda x=x: _torch_gate(x, wg, bias, k, 1.5))
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


def _torch_gate(x, wg, bias, k, route_scale):
    s = torch.sqrt(F.softplus(x.float() @ wg.float().t()))
    ids = (s + bias).topk(k, dim=-1).indices
    w = s.gather(-1, ids)
    return w / (w.sum(-1, keepdim=True) + 1e-20) * route_scale, ids


# ---------------------------------------------------------------------------------------------
# Prefill variants (fourth session): candidate MoeConfigs at T = 8192, each timed whole and split
# by kernel (torch.profiler), each checked against the ref tier and the old default.
# ---------------------------------------------------------------------------------------------


def prefill_variants() -> dict:
    """name -> MoeConfig of the candidates (first call: round 1; second: round 2), old default
    first."""
    from deepinfer_kernels.triton import moe as tmoe

    M = tmoe.MoeConfig
    cf = dict(cols_fast=True, fp4_mode=2)
    pf = dict(cf, prefetch_scales=True)
    return {
        "old PREFILL": M(128, 64, 64, 8, 8, 3, block_k=64),
        # round 1
        "cols": M(128, 64, 64, 8, 8, 3, block_k=64, cols_fast=True),
        "cols m2": M(128, 64, 64, 8, 8, 3, block_k=64, **cf),
        "cols m2 pf": M(128, 64, 64, 8, 8, 3, block_k=64, **pf),
        "cols m2 pf n2=128": M(128, 64, 128, 8, 8, 3, block_k=64, **pf),
        "cols m2 pf n1=n2=128": M(128, 128, 128, 8, 8, 3, block_k=64, **pf),
        "cols m2 pf n2=256": M(128, 64, 256, 8, 8, 3, block_k=64, **pf),
        "cols m2 pf st4": M(128, 64, 64, 8, 8, 4, block_k=64, **pf),
        "cols m2 k128 words st2": M(128, 64, 64, 8, 8, 2, block_k=128, scale_words=True, **cf),
        "cols m2 pf w2:k128 words st2": M(
            128, 64, 64, 8, 8, 3, block_k=64, block_k2=128, stages2=2, scale_words=True, **pf
        ),
        "cols m2 pf m64 n1=n2=128": M(64, 128, 128, 8, 8, 3, block_k=64, **pf),
        "cols m2 pf m64 w4 n2=128": M(64, 64, 128, 4, 4, 3, block_k=64, **pf),
        # round 2: around the best of round 1 (m64, 4 warps); W13 / W2 parts varied together,
        # read separately from the kernel split
        "r2 m64w4 n64/n128 rowfast": M(
            64, 64, 128, 4, 4, 3, block_k=64, fp4_mode=2, prefetch_scales=True
        ),
        "r2 m64w4 n64/n128 w13cols": M(64, 64, 128, 4, 4, 3, block_k=64, cols_fast2=False, **pf),
        "r2 m64w4 n64st2/n256": M(64, 64, 256, 4, 4, 2, block_k=64, stages2=3, **pf),
        "r2 m64w4 n32/n64": M(64, 32, 64, 4, 4, 3, block_k=64, **pf),
        "r2 m64 w4n128/w8n256": M(64, 128, 256, 4, 8, 3, block_k=64, **pf),
        "r2 m64w4 st4": M(64, 64, 128, 4, 4, 4, block_k=64, **pf),
        "r2 m64w4 no-pf": M(64, 64, 128, 4, 4, 3, block_k=64, **cf),
        "r2 m64w4 m0": M(64, 64, 128, 4, 4, 3, block_k=64, cols_fast=True, prefetch_scales=True),
        "r2 m128 n128 rowfast": M(
            128, 128, 128, 8, 8, 3, block_k=64, fp4_mode=2, prefetch_scales=True
        ),
        "r2 m64 w8n128/w8n256": M(64, 128, 256, 8, 8, 3, block_k=64, **pf),
        "r2 m64w4 n64/n128 k2=128": M(64, 64, 128, 4, 4, 3, block_k=64, block_k2=128, **pf),
    }


ROUNDS = {
    1: [
        "old PREFILL",
        "cols",
        "cols m2",
        "cols m2 pf",
        "cols m2 pf n2=128",
        "cols m2 pf n1=n2=128",
        "cols m2 pf n2=256",
        "cols m2 pf st4",
        "cols m2 k128 words st2",
        "cols m2 pf w2:k128 words st2",
        "cols m2 pf m64 n1=n2=128",
        "cols m2 pf m64 w4 n2=128",
    ],
    2: [
        "old PREFILL",
        "cols m2 pf m64 w4 n2=128",
        "r2 m64w4 n64/n128 rowfast",
        "r2 m64w4 n64/n128 w13cols",
        "r2 m64w4 n64st2/n256",
        "r2 m64w4 n32/n64",
        "r2 m64 w4n128/w8n256",
        "r2 m64w4 st4",
        "r2 m64w4 no-pf",
        "r2 m64w4 m0",
        "r2 m128 n128 rowfast",
        "r2 m64 w8n128/w8n256",
        "r2 m64w4 n64/n128 k2=128",
    ],
}
SWEEP = ["old PREFILL", "cols m2 pf m64 w4 n2=128", "r2 m64w4 n64/n128 w13cols"]
"""The configs timed at other prefill sizes (T = 2048, 16384) in round 2."""


def _kernel_split_ms(fn, calls: int = 5) -> dict:
    """Device time per call of each kernel group (W1/W3, W2, everything else), by the profiler."""
    split = {"w13": 0.0, "w2": 0.0, "other": 0.0}
    for name, us in _node_split_us(fn, calls).items():
        key = "w13" if "_w13_kernel" in name else "w2" if "_w2_kernel" in name else "other"
        split[key] += us / 1000.0
    return split


def _compile_config(cfg, tokens: int) -> None:
    """Compile one MoE configuration's kernels (a small routed batch of `tokens` at the real D, I;
    E = 8): run in parallel processes before timing so the Triton disk cache holds every
    candidate (prefill variants with 64 tokens, decode candidates with 4)."""
    from deepinfer_kernels.triton import moe as tmoe

    g = torch.Generator(device="cuda").manual_seed(1)
    e = 8

    def fp4(n, kk):
        packed = torch.randint(-128, 128, (e, n, kk // 2), device="cuda", generator=g)
        scale = torch.randint(118, 123, (e, n, kk // 32), device="cuda", generator=g)
        return packed.to(torch.int8), scale.to(torch.uint8).view(torch.float8_e8m0fnu)

    ws = (*fp4(MOE_I, MOE_D), *fp4(MOE_I, MOE_D), *fp4(MOE_D, MOE_I))
    x = torch.randn(tokens, MOE_D, device="cuda", generator=g).bfloat16()
    ids = torch.rand(tokens, e, device="cuda", generator=g).topk(MOE_K, dim=-1).indices
    tw = torch.rand(tokens, MOE_K, device="cuda", generator=g)
    tmoe.moe_experts(x, tw, ids, *ws, MOE_LIMIT, config=cfg)
    torch.cuda.synchronize()


def precompile(flag: str, names, jobs: int) -> None:
    """Compile the named candidates in parallel processes (`python bench_moe.py <flag> <name>`
    each; Triton's disk cache keeps the kernels), at most `jobs` at a time."""
    import subprocess
    import sys
    import time

    procs = []
    for name in names:
        procs.append(subprocess.Popen([sys.executable, __file__, flag, name]))
        while len([p for p in procs if p.poll() is None]) >= jobs:
            time.sleep(0.2)
    for p in procs:
        p.wait()


def prefill_variant_rows(t: int = 8192, names=None) -> list[dict]:
    """Every candidate at T tokens: median ms, TFLOP/s, kernel split, rel error vs ref and vs the
    old default (same routed batch)."""
    from deepinfer_kernels.ref import moe as ref_moe
    from deepinfer_kernels.triton import moe as tmoe

    variants = prefill_variants()
    names = names or list(variants)
    g = torch.Generator(device="cuda").manual_seed(0)
    experts, _ = moe_layer_weights(g)
    (x, tw, ids) = moe_routed_inputs(t, 1, g)[0]
    want = ref_moe.moe_experts(x, tw, ids, *experts, MOE_LIMIT).double()
    flops = 6.0 * t * MOE_K * MOE_D * MOE_I
    base = None
    rows = []
    for name in names:
        cfg = variants[name]

        def fn(cfg=cfg):
            return tmoe.moe_experts(x, tw, ids, *experts, MOE_LIMIT, config=cfg)

        try:
            out = fn().double()
            if base is None:
                base = out
            rel = ((out - want).norm() / want.norm()).item()
            rel_old = ((out - base).norm() / base.norm()).item()
            ms = bench_ms(fn)
            split = _kernel_split_ms(fn)
        except Exception as ex:  # a candidate that fails to compile or run: report, go on
            print(f"{name}: FAILED {type(ex).__name__}: {str(ex)[:300]}", flush=True)
            continue
        row = dict(
            variant=name, t=t, ms=ms, tflops=flops / ms / 1e9, rel_ref=rel, rel_old=rel_old, **split
        )
        print(
            f"{name:32s} {ms:8.3f} ms {row['tflops']:7.1f} TF/s  w13 {split['w13']:7.3f}"
            f"  w2 {split['w2']:7.3f}  other {split['other']:6.3f}  rel {rel:.2e} / {rel_old:.2e}",
            flush=True,
        )
        rows.append(row)
    return rows


def decode_graph_rows(t: int) -> list[dict]:
    """moe_experts at decode size T in auto mode (DECODE config), CUDA-graph replays rotating over
    8 routed batches (> L2): the decode path this session leaves as it was."""
    from deepinfer_kernels.triton import moe as tmoe

    g = torch.Generator(device="cuda").manual_seed(0)
    experts, _ = moe_layer_weights(g)
    sets = moe_routed_inputs(t, 8, g)
    ms = bench_graphs(lambda x, tw, ids: tmoe.moe_experts(x, tw, ids, *experts, MOE_LIMIT), sets)
    flops = 6.0 * t * MOE_K * MOE_D * MOE_I
    print(f"decode graph auto T={t}: {ms:.4f} ms", flush=True)
    nan = float("nan")
    return [
        dict(
            variant="decode graph auto",
            t=t,
            ms=ms,
            tflops=flops / ms / 1e9,
            rel_ref=nan,
            rel_old=nan,
            w13=nan,
            w2=nan,
            other=nan,
        )
    ]


# ---------------------------------------------------------------------------------------------
# Decode candidates (fifth session): the MoE layer at T <= 256 in the engine's harness (one CUDA
# graph of 8 calls on 8 routings, time / 8, as bench_decode's decode4 MoE rows), each candidate
# checked against the default's output first, and the device time of each kernel node.
# ---------------------------------------------------------------------------------------------

HEAD_MOE = "build/moe5-head/moe_head.py"
"""Optional (git-ignored, carried to the GPU by hand): moe.py as committed before this session's
change, so the old default runs in the same process as the new one (`head DECODE` rows)."""


def decode_candidates() -> dict:
    """name -> MoeConfig for decode (T <= 256): `DECODE` variants, each the same K order and
    the same bf16 operand values as `DECODE` (so the same or nearly the same bits)."""
    import dataclasses

    from deepinfer_kernels.triton import moe as tmoe

    r = dataclasses.replace
    d = tmoe.DECODE
    return {
        "m3": r(d, fp4_mode=3),  # fewer expansion instructions, scale multiply in the PTX
        "pf": r(d, prefetch_scales=True),  # next step's scale bytes loaded a step ahead
        "m3 pf": r(d, fp4_mode=3, prefetch_scales=True),
        "m3 w8": r(d, fp4_mode=3, warps1=8, warps2=8),  # twice the warps per program (T=1)
        "m3 st3": r(d, fp4_mode=3, stages=3),
        "m3 st6": r(d, fp4_mode=3, stages=6),  # more weight bytes in flight per program
        # measured in call 2 and removed since (commit e235098 has it): MoeConfig.warm_scales,
        # each program's scale rows prefetched into L1 / L2 at its start: no gain
    }


def cuda_decode_candidates() -> dict:
    """name -> config of the cuda decode experts (`cuda/moe_decode.py`): the mma.sync kernels'
    default and work splits, and batch-invariant mode's wgmma kernels' default and variants."""
    from dataclasses import replace

    from deepinfer_kernels.cuda import moe_decode as cmd

    c = cmd.MoeDecodeCudaConfig
    return {
        "cuda": cmd.REGISTER,
        # two K steps of loads in flight (-6% at T=1, worse from T=6; ninth session)
        "cuda d2": c(depth=2, min_blocks1=2, min_blocks2=4),
        "cuda d2 s2=4": c(depth=2, min_blocks1=2, split2=4, min_blocks2=2),
        "cuda s2=4": c(split2=4, min_blocks2=3),
        # one W1/W3 wave at T=1 (432 CTAs; 396 slots at split1=4, min_blocks1=3): T=1 -2..+2%,
        # T>=16 +6..21% (eighth session)
        "cuda s1=3": c(split1=3, min_blocks1=4),
        "cuda s1=3 s2=3": c(split1=3, min_blocks1=4, split2=3, min_blocks2=4),
        "cuda s1=2": c(split1=2, min_blocks1=6),
        # W2 at 3 warps (10.9 warps per SM at T=1): within 2% of the default at every T
        "cuda s2=3": c(split2=3, min_blocks2=4),
        # the same sums fed by the TMA (the default: TMA up to TMA_TILE8_TOKENS tokens, then
        # TMA_TILE16)
        "cuda tma d2": cmd.TMA,
        "cuda tma t16": cmd.TMA_TILE16,
        "cuda tma d3": replace(cmd.TMA, depth=3),
        # more, smaller W2 CTAs (H200: T=1 61.2 / 65.3 us vs 60.6, T=2 96.3 / 98.0 vs 100.6,
        # T=4 163.8 / 170.4 vs 165.2: within a run's noise or worse; ninth session)
        "cuda tma rt2=2": replace(cmd.TMA, rt2=2, min_blocks2=8),
        "cuda tma rt2=1": replace(cmd.TMA, rt2=1, min_blocks2=8),
        # batch-invariant mode's wgmma kernels (rows bitwise those of Triton's PREFILL)
        "cuda inv": cmd.WGMMA_DEFAULT,
        "cuda inv 1wg d6": replace(cmd.WGMMA_DEFAULT, warpgroups1=1, depth1=6, min_blocks1=1),
        "cuda inv w2 d4 mb5": replace(cmd.WGMMA_DEFAULT, depth2=4, min_blocks2=5),
        "cuda inv w2 d3 mb5": replace(cmd.WGMMA_DEFAULT, depth2=3, min_blocks2=5),
        "cuda inv w2 2wg d6": replace(cmd.WGMMA_DEFAULT, warpgroups2=2),
        # the weights in fragment order (quant.fp4_fragment_order): no byte exchange per K step
        "cuda inv frag": replace(cmd.WGMMA_DEFAULT, fragment_weights=True),
        "cuda inv frag mb1 d4": replace(
            cmd.WGMMA_DEFAULT, fragment_weights=True, min_blocks1=1, depth1=4
        ),
        # spill-free W1/W3 schedules with 1 warpgroup per CTA, for large T: 1.23-1.35x cuda at
        # T=64/256, against 1.16/1.19 for "cuda inv frag" (which spills) and 1.20/1.24 for
        # WGMMA_FRAGMENT in the same run (eighth session)
        "cuda inv frag 1wg mb2 d3": replace(
            cmd.WGMMA_FRAGMENT, warpgroups1=1, min_blocks1=2, depth1=3
        ),
        "cuda inv frag 1wg mb2 d4": replace(
            cmd.WGMMA_FRAGMENT, warpgroups1=1, min_blocks1=2, depth1=4
        ),
        "cuda inv frag 1wg mb3 d2": replace(
            cmd.WGMMA_FRAGMENT, warpgroups1=1, min_blocks1=3, depth1=2
        ),
        # W1 and W3 on separate warpgroup pairs (16 warps per CTA at 79-121 registers): "w4 d4"
        # is WGMMA_FRAGMENT since the eleventh session, 4-5% faster than "mb1 d4" (the old one)
        "cuda inv frag w4 d4": replace(cmd.WGMMA_FRAGMENT, warpgroups1=4, depth1=4),
        "cuda inv frag w4 d6": replace(cmd.WGMMA_FRAGMENT, warpgroups1=4, depth1=6),
        # one wgmma group in flight while the next one's weights expand (see "pf g1"): chained
        # harness T=1 2% faster, T=16 7% slower, T=64 / 256 the same (fourteenth session)
        "cuda inv g2": replace(cmd.WGMMA_DEFAULT, wgmma_groups=2),
        "cuda inv frag g2": replace(cmd.WGMMA_FRAGMENT, wgmma_groups=2),
        # measured before (NOTES.md): split1=2 / 5 / 8, 16-token tiles, min_blocks 2 / 4, W2 with
        # 2 row tiles x 4 warps; L2 prefetches, the L2 fetch size and a dependent W2 launch
        # (eighth session, not kept)
    }


def _load_head_moe():
    """moe.py as committed before this session (HEAD_MOE), as a module of the same package (its
    relative imports resolve), or None when the file is absent."""
    import importlib.util
    import os
    import sys

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", HEAD_MOE)
    if not os.path.exists(path):
        return None
    spec = importlib.util.spec_from_file_location("deepinfer_kernels.triton._moe_head", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def _node_split_us(fn, calls: int = 5) -> dict:
    """Device time (us per call) of each kernel one call launches, by name (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    out = {}
    for ev in prof.key_averages():
        us = getattr(ev, "device_time_total", None)
        if us is None:
            us = ev.cuda_time_total
        if us > 0:
            out[ev.key[:40]] = us / calls
    return out


def decode_candidate_rows(ts, names, split_ts=(1, 64), split_names=("m3",)) -> list[dict]:
    """The MoE layer at each T: `head DECODE` (the committed default before this session, if
    HEAD_MOE is present), `auto` / `inv` (`moe_experts`' defaults now), the named candidates;
    each timed in the chained harness (`chain_graph_ms`, 8 routings, us per call); candidates
    checked against `auto` on the first routing first (`same` = bitwise; else the relative
    difference; over 1e-3 marks the row ` BAD`). Kernel split (device us per node) at split_ts
    for `auto`, split_names and the cuda candidates."""
    from bench_common import chain_graph_ms
    from deepinfer_kernels.cuda import moe_decode as cmd
    from deepinfer_kernels.triton import moe as tmoe

    head = _load_head_moe()
    cands = decode_candidates()
    cuda_cands = cuda_decode_candidates()
    g, experts, per_expert, experts_frag = _layer_both_orders()
    rows = []
    for t in ts:
        sets = moe_routed_inputs(t, 8, g)
        active = sum(int(torch.unique(st[2]).numel()) for st in sets) / len(sets)
        nbytes = active * per_expert
        fns = {}
        if head is not None:
            fns["head DECODE"] = lambda x, tw, ids: head.moe_experts(
                x, tw, ids, *experts, MOE_LIMIT, config=head.DECODE
            )
        fns["auto"] = lambda x, tw, ids: tmoe.moe_experts(x, tw, ids, *experts, MOE_LIMIT)
        fns["inv"] = lambda x, tw, ids: tmoe.moe_experts(
            x, tw, ids, *experts, MOE_LIMIT, batch_invariant=True
        )
        for name in names:
            if name in cuda_cands:
                cfg = cuda_cands[name]
                frag = getattr(cfg, "fragment_weights", False)
                ws = experts_frag if frag else experts
                fns[name] = lambda x, tw, ids, cfg=cfg, ws=ws, frag=frag: cmd.moe_experts(
                    x, tw, ids, *ws, MOE_LIMIT, config=cfg, fragment_order=frag
                )
            else:
                fns[name] = lambda x, tw, ids, cfg=cands[name]: tmoe.moe_experts(
                    x, tw, ids, *experts, MOE_LIMIT, config=cfg
                )
        want = fns["auto"](*sets[0]).double()
        want_inv = fns["inv"](*sets[0]).double()
        for name, fn in fns.items():
            try:
                got = fn(*sets[0]).double()
                # batch-invariant candidates must equal Triton's invariant rows bit for bit
                inv = isinstance(cuda_cands.get(name), cmd.MoeDecodeWgmmaConfig)
                if inv and not torch.equal(got, want_inv):
                    name += " NOT INVARIANT"
                diff = ((got - want).norm() / want.norm()).item()
                check = "same" if torch.equal(got, want) else f"{diff:.1e}"
                # the cuda tier sums K in another order: bf16 roundings may differ (ref-level)
                bad = name != "inv" and diff > (1.5e-2 if name in cuda_cands else 1e-3)
                us = chain_graph_ms(fn, sets) * 1e3
            except Exception as exc:  # reported; the other rows still run
                print(f"moe5 {name} T={t} failed: {type(exc).__name__}: {str(exc)[:300]}")
                continue
            row = dict(name=name + (" BAD" if bad else ""), t=t, us=us, bytes=nbytes, check=check)
            print(f"moe5 {row['name']:<16} T={t:<4} {us:9.1f} us  {check}", flush=True)
            rows.append(row)
            split_this = name in ("auto", "head DECODE", *split_names) or name in cuda_cands
            if t in split_ts and split_this:
                split = _node_split_us(lambda fn=fn, a=sets[0]: fn(*a))
                cells = "  ".join(f"{k} {v:.1f}" for k, v in sorted(split.items()))
                print(f"split {name} T={t} (us per node, eager): {cells}", flush=True)
                row["split"] = split
    return rows


def print_decode_table(rows, copy_gbs: float) -> None:
    """One line per (candidate, T): us per call in the chained harness, % of the copy ceiling on
    the expert bytes read, ratio to the head (or auto) row of the same T, check."""
    print(f"\nMoE decode (chained graph, 8 routings; copy ceiling {copy_gbs:.0f} GB/s)")
    print(f"{'candidate':<18}{'T':>5}{'us':>9}{'%bw':>7}{'/base':>7}  check")
    base = {}
    for r in rows:
        if r["name"] in ("head DECODE", "auto") and r["t"] not in base:
            base[r["t"]] = r["us"]
    for r in rows:
        pct = 100 * r["bytes"] / (r["us"] * 1e-6) / 1e9 / copy_gbs
        ratio = r["us"] / base[r["t"]] if r["t"] in base else float("nan")
        print(f"{r['name']:<18}{r['t']:>5}{r['us']:>9.1f}{pct:>7.1f}{ratio:>7.3f}  {r['check']}")


def main() -> None:
    import argparse
    import json
    import os

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--compile-one", help="(internal) compile one prefill variant")
    ap.add_argument("--prefill-variants", action="store_true", help="time the prefill candidates")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--only", nargs="*", help="variant names (default: the round's)")
    ap.add_argument("--round", type=int, default=2, help="candidate round (1 or 2)")
    ap.add_argument("--sweep", nargs="*", type=int, default=[], help="more T for SWEEP configs")
    ap.add_argument("--decode", nargs="*", type=int, default=[], help="T for decode graph rows")
    ap.add_argument("--compile-decode", help="(internal) compile one decode candidate")
    ap.add_argument(
        "--decode-candidates", nargs="*", help="decode candidates to time (names or 'all')"
    )
    ap.add_argument("--decode-t", nargs="*", type=int, default=[1, 16, 64, 256])
    ap.add_argument("--prefill-row", action="store_true", help="PREFILL at T=8192, eager")
    ap.add_argument("--profile-once", action="store_true", help="calls for ncu (see profile_once)")
    ap.add_argument(
        "--wgmma-prefill", nargs="*", help="cuda prefill candidates to time (names or 'all')"
    )
    ap.add_argument("--prefill-t", nargs="*", type=int, default=[2048, 8192])
    args = ap.parse_args()
    if args.wgmma_prefill is not None:
        every = list(cuda_prefill_candidates())
        names = every if args.wgmma_prefill in ([], ["all"]) else args.wgmma_prefill
        rows = cuda_prefill_rows(args.prefill_t, names)
        out = os.environ.get("OUT")
        if out:
            with open(os.path.join(out, "moe_wgmma_prefill.json"), "w") as f:
                json.dump(rows, f, indent=1)
        print_cuda_prefill_table(rows)
        return
    if args.compile_one:
        _compile_config(prefill_variants()[args.compile_one], tokens=64)
        return
    if args.compile_decode:
        _compile_config(decode_candidates()[args.compile_decode], tokens=4)
        return
    if args.decode_candidates is not None:
        decode_main(args)
        return
    if args.profile_once:
        profile_once()
        return
    if args.prefill_variants:
        names = args.only or ROUNDS[args.round]
        precompile("--compile-one", names, jobs=12)
        rows = prefill_variant_rows(args.tokens, names)
        for t in args.sweep:
            rows += prefill_variant_rows(t, [n for n in SWEEP if n in names])
        for t in args.decode:
            rows += decode_graph_rows(t)
        out = os.environ.get("OUT")
        if out:
            with open(os.path.join(out, f"moe_prefill_variants_T{args.tokens}.json"), "w") as f:
                json.dump(rows, f, indent=1)
        print("\nMoE prefill variants (T, ms, TFLOP/s, W13/W2/other ms, rel err vs ref / old)")
        for r in rows:
            print(
                f"{r['variant']:32s} {r['t']:6d} {r['ms']:8.3f} {r['tflops']:7.1f} {r['w13']:7.3f}"
                f" {r['w2']:7.3f} {r['other']:6.3f} {r['rel_ref']:.1e} {r['rel_old']:.1e}"
            )


def decode_main(args) -> None:
    """`--decode-candidates [names|all] [--decode-t ...] [--prefill-row]`: the decode table (and
    the T=8192 PREFILL row: head and now), JSON under $OUT; the table prints last, also when a
    `timeout` cuts the run short (SIGTERM)."""
    import json
    import os
    import signal
    import sys

    from bench_common import measure_copy_gbs

    signal.signal(signal.SIGTERM, lambda *_: sys.exit("bench_moe: SIGTERM"))
    every = [*decode_candidates(), *cuda_decode_candidates()]
    names = every if args.decode_candidates in ([], ["all"]) else args.decode_candidates
    precompile("--compile-decode", [n for n in names if n in decode_candidates()], jobs=8)
    copy_gbs = measure_copy_gbs()
    rows, pre = [], []
    try:
        if args.prefill_row:
            pre = prefill_head_rows()
        rows += decode_candidate_rows(args.decode_t, names)
    finally:
        out = os.environ.get("OUT")
        if out:
            with open(os.path.join(out, "moe_decode_candidates.json"), "w") as f:
                json.dump(dict(copy_gbs=copy_gbs, rows=rows, prefill=pre), f, indent=1)
        for r in pre:
            print(f"prefill {r['name']:<12} T=8192 {r['ms']:8.3f} ms {r['tflops']:6.1f} TFLOP/s")
        print_decode_table(rows, copy_gbs)


def profile_once() -> None:
    """For Nsight Compute: `moe_experts` (auto) at T=1 twice, then at T=16 once, so that
    `ncu --kernel-name regex:"_w(13|2)_kernel" --launch-skip 2 --launch-count 4` profiles the
    W1/W3 and W2 kernels of a warm call at T=1 and at T=16."""
    from deepinfer_kernels.triton import moe as tmoe

    g = torch.Generator(device="cuda").manual_seed(0)
    experts, _ = moe_layer_weights(g)
    for t, n in ((1, 2), (16, 1)):
        x, tw, ids = moe_routed_inputs(t, 1, g)[0]
        for _ in range(n):
            tmoe.moe_experts(x, tw, ids, *experts, MOE_LIMIT)
        torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------------
# wgmma prefill candidates (twelfth session): the cuda wgmma kernels at prefill sizes against
# Triton's prefill tiles on the same routed batch, whole and split by kernel.
# ---------------------------------------------------------------------------------------------


def cuda_prefill_candidates() -> dict:
    """name -> config: the baselines (Triton's `PREFILL` and `PREFILL_FRAGMENT`, the cuda TMA
    decode kernels), then the wgmma kernels on the checkpoint's order (permuted K: auto mode; the
    byte exchange: batch-invariant mode) and on fragment order (batch-invariant mode); names with
    `frag` run on fragment-order weights."""
    from dataclasses import replace

    from deepinfer_kernels.cuda import moe_decode as cmd
    from deepinfer_kernels.triton import moe as tmoe

    p, f, x = cmd.WGMMA_PREFILL, cmd.WGMMA_PREFILL_FRAGMENT, cmd.WGMMA_PREFILL_EXCHANGE
    # the fourteenth session's kernels: the weights loaded by every thread 2 K steps ahead, one
    # wgmma group in flight; the fifteenth session's defaults (weights by TMA, two groups) are
    # 3-8% faster at 2K-16K tokens on 128-token tiles, 3-8% on 160-token ones
    reg = dict(w_tma=False, wgmma_groups=2)
    reg_wide = dict(reg, tile_tokens=160, depth1=1, depth2=1, tail_depth=2, wgmma_groups=1)
    # the twelfth session's kernels: the activations copied by every thread (cp.async) as well,
    # weights one step ahead, tails two, no wgmma group in flight (1.22x slower at 8K tokens)
    copy = dict(x_tma=False, w_tma=False, depth1=1, depth2=1, tail_depth=2, wgmma_groups=1)
    # H200 results per candidate: packages/deepinfer-kernels/NOTES.md, twelfth to fifteenth
    # sessions, which also name the schedules tried and not kept
    return {
        "triton PREFILL": tmoe.PREFILL,
        "triton PREFILL_FRAGMENT frag": tmoe.PREFILL_FRAGMENT,
        "cuda TMA_TILE16": cmd.TMA_TILE16,  # auto mode's decode kernels, up to 16 pairs/expert
        "WGMMA_PREFILL": p,
        "WGMMA_PREFILL_FRAGMENT frag": f,
        "WGMMA_PREFILL_EXCHANGE": x,
        # 160-token tiles (`wide_tiles`, what both modes run where `wide_tiles_pay`)
        "pf wide": cmd.wide_tiles(p),
        "frag wide": cmd.wide_tiles(f),
        "exchange wide": cmd.wide_tiles(x),
        # two groups in flight on 160-token tiles: 4-6% slower than one
        "pf wide g3": replace(cmd.wide_tiles(p), wgmma_groups=3),
        "pf reg": replace(p, **reg),
        "frag reg": replace(f, **reg),
        "exchange reg": replace(x, **reg),
        "pf reg wide": replace(p, **reg_wide),
        "exchange reg wide": replace(x, **reg_wide),
        "pf copy": replace(p, **copy),
        "frag copy": replace(f, **copy),
        # PTX's `wgmma.wait_group 1` compiles to a wait for every group (ptxas reuses the
        # fragments' registers): `wgmma_groups` N keeps N - 1 groups in flight
        "pf g1": replace(p, wgmma_groups=1),
        "pf g2": replace(p, wgmma_groups=2),
        "pf xs3": replace(p, x_stages=3),
        # W2 on 2 warpgroups at one CTA per SM (144 registers; fourteenth session, weights by
        # registers: W2 1.24x slower at 8K tokens)
        "pf w2 2wg": replace(p, warpgroups2=2),
    }


def _kernel_group(name: str) -> str:
    """The split key of a kernel name (Triton's `_w13_kernel` / `_w2_kernel`, the cuda `moe_w13`
    / `moe_w2`)."""
    return "w13" if "w13" in name else "w2" if "w2" in name else "other"


def cuda_prefill_rows(ts, names) -> list[dict]:
    """Each named candidate (`cuda_prefill_candidates`) at each T on one routed batch: ms,
    TFLOP/s, W1/W3, W2 and other device ms (profiler), and the relative difference to the
    baseline of its weight order (Triton PREFILL / PREFILL_FRAGMENT; 0 = bitwise)."""
    from deepinfer_kernels.cuda import moe_decode as cmd
    from deepinfer_kernels.triton import moe as tmoe

    cands = cuda_prefill_candidates()
    g, experts, _, frag = _layer_both_orders()
    rows = []
    for t in ts:
        x, tw, ids = moe_routed_inputs(t, 1, g)[0]
        flops = 6.0 * t * MOE_K * MOE_D * MOE_I
        base = {}
        for name in names:
            cfg = cands[name]
            on_frag = "frag" in name
            ws = frag if on_frag else experts
            mod = tmoe if isinstance(cfg, tmoe.MoeConfig) else cmd

            def fn(mod=mod, ws=ws, cfg=cfg, on_frag=on_frag, args=(x, tw, ids)):
                return mod.moe_experts(*args, *ws, MOE_LIMIT, config=cfg, fragment_order=on_frag)

            try:
                out = fn().float()
                ref = base.setdefault(on_frag, out)
                diff = ((out - ref).norm() / ref.norm()).item()
                ms = bench_ms(fn)
                split = {"w13": 0.0, "w2": 0.0, "other": 0.0}
                for kname, us in _node_split_us(fn).items():
                    split[_kernel_group(kname)] += us / 1000.0
            except Exception as ex:  # a candidate that fails to compile or run: report, go on
                print(f"{name} T={t}: FAILED {type(ex).__name__}: {str(ex)[:300]}", flush=True)
                continue
            rows.append(dict(name=name, t=t, ms=ms, tflops=flops / ms / 1e9, diff=diff, **split))
            print(f"{name} T={t}: {ms:.3f} ms", flush=True)
    return rows


def print_cuda_prefill_table(rows) -> None:
    """The `cuda_prefill_rows` table, with each row's speed-up over its weight order's Triton
    baseline at the same T."""
    print(f"\n{'candidate':30s} {'T':>6s} {'ms':>8s} {'TF/s':>6s} {'w13':>7s} {'w2':>7s}"
          f" {'other':>6s} {'vs triton':>9s} {'diff':>8s}")  # fmt: skip
    for r in rows:
        frag = "frag" in r["name"]
        tri = next(
            (b["ms"] for b in rows if b["t"] == r["t"] and b["name"].startswith("triton")
             and ("frag" in b["name"]) == frag),
            float("nan"),
        )  # fmt: skip
        print(
            f"{r['name']:30s} {r['t']:6d} {r['ms']:8.3f} {r['tflops']:6.1f} {r['w13']:7.3f}"
            f" {r['w2']:7.3f} {r['other']:6.3f} {tri / r['ms']:8.2f}x {r['diff']:8.1e}"
        )


def _layer_both_orders():
    """(generator seeded 0 for the inputs that follow, experts, bytes per expert, the same
    experts in fragment order)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    experts, per_expert = moe_layer_weights(g)
    return g, experts, per_expert, fragment_experts(experts)


def fragment_experts(experts):
    """The same experts with w1, w3, w2 in `quant.fp4_fragment_order`."""
    from deepinfer_kernels.quant import fp4_fragment_order as f

    w1, s1, w3, s3, w2, s2 = experts
    return f(w1), s1, f(w3), s3, f(w2), s2


def prefill_head_rows() -> list[dict]:
    """PREFILL at T=8192 (eager, one routed batch): the committed module before this session
    (HEAD_MOE, if present), now, and now on fragment-order weights, same run; the outputs
    compared bitwise with now's."""
    from dataclasses import replace

    from deepinfer_kernels.triton import moe as tmoe

    g = torch.Generator(device="cuda").manual_seed(0)
    experts, _ = moe_layer_weights(g)
    x, tw, ids = moe_routed_inputs(8192, 1, g)[0]
    flops = 6.0 * 8192 * MOE_K * MOE_D * MOE_I
    runs = {"now": (tmoe, experts, tmoe.PREFILL)}
    head = _load_head_moe()
    if head is not None:
        runs["head"] = (head, experts, head.PREFILL)
    # on fragment-order weights: PREFILL's own tiles (its 64-wide K steps gather half of each
    # 64-byte step: +17% in the eighth session), and PREFILL_FRAGMENT (+3%)
    frag = fragment_experts(experts)
    runs["now fragment"] = (tmoe, frag, replace(tmoe.PREFILL, fragment_weights=True))
    runs["now PREFILL_FRAGMENT"] = (tmoe, frag, tmoe.PREFILL_FRAGMENT)
    outs, rows = {}, []
    for name, (mod, ws, cfg) in runs.items():
        order = dict(fragment_order=True) if cfg.fragment_weights else {}

        def fn(mod=mod, ws=ws, cfg=cfg, order=order):
            return mod.moe_experts(x, tw, ids, *ws, MOE_LIMIT, config=cfg, **order)

        outs[name] = fn()
        ms = bench_ms(fn)
        rows.append(dict(name=name, ms=ms, tflops=flops / ms / 1e9))
        same = torch.equal(outs[name], outs["now"])
        print(f"prefill {name} T=8192: {ms:.3f} ms (bitwise now's: {same})", flush=True)
    return rows


if __name__ == "__main__":
    main()
