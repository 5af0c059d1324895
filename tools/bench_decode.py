"""Decode (weight-bandwidth) rows of the kernel benchmark: the dense FP8 GEMM at M <= 256 and the
MoE layer at T <= 256, as CUDA-graph replays (how the engine runs decode), with candidates."""

from __future__ import annotations

import dataclasses

import torch
from bench_common import bench_graphs, bench_ms, chain_graph_ms, fp8_weights, measure_copy_gbs
from bench_moe import MOE_LIMIT, moe_layer_weights, moe_routed_inputs

# -- fourth pass: the engine's harness (L consecutive calls in one graph) ------------------------

CHAIN_L = 16
"""Calls per captured graph in the chained harness: L distinct weight sets (> L2 in total)."""


PARTS = ("cuda", "dense", "probes", "shapes", "prefill", "moe", "dense64", "msweep")
"""`decode4_rows`' sections, in the order they run: the CUDA decode GEMM's candidates beside the
registry's two modes at 5120x8192 (M = 64 / 32 / 16 / 1), 2112x7168 and 32768x1280 (M = 64 / 16 /
1); dense 5120x8192 at M = 64 / 32 / 16 / 1 with the TileLang candidates; floor probes; 2112x7168
and 32768x1280 at M = 64 / 16 / 1 with the candidates; batch-invariant mode at prefill sizes
(eager); the MoE layer; (only when named) 5120x8192 and 32768x1280 at M = 64 with the 128-row-tile
candidates, and the registry's `fp8_gemm` at those shapes and 1280x5120 across M = 1..256
(partial token tiles, the decode kernel's token tiles where `cuda.decode_gemm.takes`, the prefill
kernel elsewhere)."""
DEFAULT_PARTS = PARTS[:-2]
SWEEP_M = (1, 8, 16, 24, 32, 33, 40, 48, 56, 63, 64, 65, 72, 96, 128, 129, 160, 192, 193, 256)
"""The M of the `msweep` part."""


def _cuda_configs():
    """The CUDA decode GEMM's candidates (sixteenth session): 128-row tiles at 2 CTAs per SM
    (the default) or 64-row tiles at 3 / 4, each also as a programmatic dependent launch."""
    from deepinfer_kernels.cuda.decode_gemm import DecodeGemmCudaConfig as C

    return {
        "cuda c2 mb2": C(programmatic=False),
        "cuda c2 mb2 pdl": C(),
        "cuda c1 mb3": C(consumers=1, min_blocks=3, programmatic=False),
        "cuda c1 mb3 pdl": C(consumers=1, min_blocks=3),
        "cuda c1 mb4 pdl": C(consumers=1, min_blocks=4),
    }


def _tile_configs():
    """(fourth session, fifth candidates): the fourth session's defaults per token tile (the
    reference every candidate must equal bitwise) and this session's candidates (the schedule
    only: CTAs per SM, ring depth, wgmmas in flight, setmaxnreg; split_k set per shape)."""
    from deepinfer_kernels.tilelang.decode_gemm import DecodeTileConfig as T

    fourth = {16: T(block_t=16), 32: T(block_t=32), 64: T(block_t=64, depth=2)}
    fifth = {  # name: t<tokens>[g<token groups>] d<depth> st<stages> mb<CTAs per SM> r<regs>
        # (first call of the fifth session also had t64 d1 st4 mb3, t32 d1 st5 mb3, t32 d2 st5
        # mb3, t16/t32 d1 st4 mb4 (now defaults): NOTES.md "Dense decode, fifth session")
        "t64 d2 st4 mb3 r136": T(64, 64, 0, 4, 3, depth=2, consumer_regs=136),
        "t64 d1 st3 mb4 r104": T(64, 64, 0, 3, 4, consumer_regs=104),
        "t64g2 d1 st4 mb3": T(64, 64, 0, 4, 3, token_groups=2),
        "t64g2 d2 st4 mb3 r72": T(64, 64, 0, 4, 3, depth=2, consumer_regs=72, token_groups=2),
        "t32g2 d1 st4 mb4": T(64, 32, 0, 4, 4, token_groups=2),
        "t16g2 d1 st4 mb4": T(64, 16, 0, 4, 4, token_groups=2),
        # ninth session: 128-row weight tiles (two consumer warpgroups share each stage's
        # activation tile: half the activation bytes per weight byte at 64 tokens)
        # (H200, 16-call graphs: 5120x8192 29.8-30.4 us vs 24.8 for the default, 160 CTAs on
        # 132 SMs; 32768x1280 19.8-20.3 vs 20.5; not kept)
        "t64n128 d1 st3 mb2 r104": T(128, 64, 0, 3, 2, consumer_regs=104),
        "t64n128 d1 st4 mb2 r104": T(128, 64, 0, 4, 2, consumer_regs=104),
        "t64n128 d1 st3 mb2": T(128, 64, 0, 3, 2),
    }
    return fourth, fifth


def decode4_rows(rows: list | None = None, parts: tuple[str, ...] = PARTS):
    """Decode rows (fourth pass, candidates of the fifth), the sections named in `parts`. Every
    row twice: `1` = a graph of one call per weight set, replays rotating (the third pass's
    harness); `L16` = one graph of 16 consecutive calls on 16 distinct weight sets (672 MB for
    5120x8192, > L2), replay time / 16 (the engine's: one graph per decode step over all layers).
    Dense FP8 GEMM 5120x8192 at M = 64 / 32 / 16 / 1: auto and batch-invariant defaults, and the
    TileLang swap-AB decode kernel: `tl fourth` (the fourth session's schedule for the M's token
    tile), `tl default` (today's, if it differs) and the candidates `t<tokens> ...` of that tile,
    each checked bitwise against `tl fourth` before it is timed (` BAD` marks a difference; the
    relative error to the ref tier is printed); the same at M = 64 / 16 / 1 for 2112x7168 and
    32768x1280; floor probes (a tiny kernel; a bare streaming read of 42 MB); the MoE layer at
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

    fourth_session, fifth_candidates = _tile_configs()
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

    weights = {}

    def token_sets(weight_sets, m, k):
        """(xq, xs, w, ws) per weight set: fresh M x K activations quantised per 32."""
        sets = []
        for w, ws in weight_sets:
            xq, xs = quant.act_quant_fp8(torch.randn(m, k, device="cuda").bfloat16())
            sets.append((xq, xs, w, ws))
        return sets

    def triton_modes(label, shape, sets, nbytes):
        """The triton tier's fp8_gemm in auto and batch-invariant mode: rows label[auto/inv]."""
        for inv in (False, True):
            both(
                f"{label}[{'inv' if inv else 'auto'}]",
                shape,
                lambda xq, xs, w, ws, inv=inv: tl_linear.fp8_gemm(
                    xq, xs, w, ws, torch.bfloat16, batch_invariant=inv
                ),
                sets,
                nbytes,
            )

    def chain_weights(n, k):
        """CHAIN_L distinct [n, k] FP8 weight sets (w, w_scale) and their bytes per call."""
        return fp8_weights(n, k, CHAIN_L), n * k + (n // 32 + 1) * (k // 32)

    def m_sweep(n, k):
        """The registry's `ops.fp8_gemm` at every M of SWEEP_M, both harnesses."""
        from deepinfer_kernels import ops

        sets_w, nbytes = chain_weights(n, k)
        for m in SWEEP_M:
            both("ops.fp8_gemm", f"{m}x{n}x{k}", ops.fp8_gemm, token_sets(sets_w, m, k), nbytes)
        del sets_w

    def dense_cuda(n, k, ms_list):
        """The triton tier's two modes (auto: the GEMV at M=1, the TileLang decode kernel above;
        inv: that kernel at every M), the registry's choice (`ops.fp8_gemm`: the CUDA decode
        kernel with `pick_config` on Hopper) and the CUDA decode kernel's candidates, each
        checked bitwise against `triton[inv]`'s output (the same K split and order) first."""
        from deepinfer_kernels import ops
        from deepinfer_kernels.cuda import decode_gemm as cdg

        sets_w, nbytes = chain_weights(n, k)
        for m in ms_list:
            sets = token_sets(sets_w, m, k)
            shape = f"{m}x{n}x{k}"
            triton_modes("triton", shape, sets, nbytes)
            base = tl_linear.fp8_gemm(*sets[0], torch.bfloat16, batch_invariant=True)
            same = torch.equal(ops.fp8_gemm(*sets[0]), base)
            both(f"ops.fp8_gemm{'' if same else ' BAD'}", shape, ops.fp8_gemm, sets, nbytes)
            for name, cfg in _cuda_configs().items():
                try:
                    got = cdg.decode_gemm(*sets[0], torch.bfloat16, config=cfg)
                except Exception as exc:
                    print(f"dec4 {name} failed: {type(exc).__name__}: {str(exc)[:400]}")
                    continue
                same = torch.equal(got, base)
                both(
                    f"{name}{'' if same else ' BAD'}",
                    shape,
                    lambda xq, xs, w, ws, cfg=cfg: cdg.decode_gemm(
                        xq, xs, w, ws, torch.bfloat16, config=cfg
                    ),
                    sets,
                    nbytes,
                )
        del sets_w

    def dense(n, k, ms_list, only=""):
        """Rows at each M; the candidates of the M's token tile whose names contain `only`."""
        weights.clear()
        weights[(n, k)], nbytes = chain_weights(n, k)
        split = tld.decode_tile_split(n, k)
        # split > 1: the kernel stores fp32 partials whatever the output dtype, so the check runs
        # the timed kernel itself in fp32; split 1 stores the output dtype directly
        check_dtype = torch.float32 if split > 1 else torch.bfloat16
        for m in ms_list:
            sets = token_sets(weights[(n, k)], m, k)
            shape = f"{m}x{n}x{k}"
            triton_modes("fp8_gemm", shape, sets, nbytes)
            want = ref_linear.fp8_gemm(*sets[0], torch.float32).double()
            bt = tld.pick_tile_config(m, n, k).block_t
            base_cfg = dataclasses.replace(fourth_session[bt], split_k=split)
            base = tld.decode_gemm(*sets[0], check_dtype, base_cfg)
            cands = {"tl fourth": base_cfg}
            now = tld.pick_tile_config(m, n, k)
            if now != base_cfg:
                cands["tl default"] = now
            for name, cfg in fifth_candidates.items():
                if only not in name:
                    continue
                if cfg.block_t == bt and dataclasses.replace(cfg, split_k=split) not in (
                    base_cfg,
                    now,
                ):
                    cands[name] = dataclasses.replace(cfg, split_k=split)
            for name, cfg in cands.items():
                try:
                    got = tld.decode_gemm(*sets[0], check_dtype, cfg)
                except Exception as exc:
                    print(f"dec4 {name} failed: {type(exc).__name__}: {str(exc)[:400]}")
                    continue
                err = ((got.double() - want).norm() / want.norm()).item()
                same = torch.equal(got, base)
                print(f"dec4 {name} {shape} rel err {err:.2e} bitwise {same}")
                both(
                    f"{name}{'' if same else ' BAD'}",
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
            # the two modes, then the candidate configs (fifth session; NOTES "MoE decode, fifth
            # session"), each checked bitwise against auto mode's output before it is timed (` BAD`
            # marks a difference). FP4 mode 3: fewer expansion instructions, the same bits
            # (chained: -2% at T=16/256, +10% at T=64). Measured slower and dropped: 32-wide
            # column blocks, scale prefetch, scale rows warmed into L1/L2, 6 stages, 8 warps
            # (`bench_moe.py --decode-candidates`)
            runs = (
                ("auto", {"batch_invariant": False}),
                ("inv", {"batch_invariant": True}),
                ("fp4 m3", {"config": dataclasses.replace(tmoe.DECODE, fp4_mode=3)}),
            )
            want = tmoe.moe_experts(*sets[0], *experts, MOE_LIMIT)
            for name, kw in runs:
                mark = ""
                if "config" in kw:
                    try:
                        got = tmoe.moe_experts(*sets[0], *experts, MOE_LIMIT, **kw)
                    except Exception as exc:  # reported; the other rows still run
                        print(f"dec4 moe_experts[{name}] T={t} failed: {type(exc).__name__}: {exc}")
                        continue
                    mark = "" if torch.equal(got, want) else " BAD"
                both(
                    f"moe_experts[{name}]{mark}",
                    f"T={t}",
                    lambda x, tw, ids, kw=kw: tmoe.moe_experts(
                        x, tw, ids, *experts, MOE_LIMIT, **kw
                    ),
                    sets,
                    active * per_expert,
                )

    def prefill_invariant(n, k):
        """Batch-invariant mode above decode sizes: `fp8_gemm[inv]` (now the TileLang decode
        kernel at every M, 64-token tiles) against the Triton invariant tiles it replaced
        (`pick_config(..., tilelang_decode=False)`), eager, rotating over 2 weight sets."""
        ws_sets = fp8_weights(n, k, 2)
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
    if "cuda" in parts:
        dense_cuda(5120, 8192, (64, 32, 16, 1))
        dense_cuda(2112, 7168, (64, 16, 1))
        dense_cuda(32768, 1280, (64, 16, 1))
    if "dense" in parts:
        dense(5120, 8192, (64, 32, 16, 1))
    if "probes" in parts:
        probes()
    if "dense64" in parts:  # the 64-token rows and the 128-row-tile candidates only
        dense(5120, 8192, (64,), only="n128")
        dense(32768, 1280, (64,), only="n128")
    if "shapes" in parts:
        dense(2112, 7168, (64, 16, 1), only="t64g2")
        dense(32768, 1280, (64, 16, 1), only="t64g2")
    if "prefill" in parts:
        prefill_invariant(5120, 8192)
    if "moe" in parts:
        moe()
    if "msweep" in parts:
        m_sweep(5120, 8192)
        m_sweep(32768, 1280)
        m_sweep(1280, 5120)
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
    """`python tools/bench_decode.py [PART ...]` (on the GPU machine; parts from PARTS, default
    DEFAULT_PARTS): the decode4 rows and their table, JSON under $OUT (timing helpers from
    bench_common)."""
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
    parts = tuple(sys.argv[1:]) or DEFAULT_PARTS
    bad = [p for p in parts if p not in PARTS]
    if bad:
        sys.exit(f"bench_decode: unknown part(s) {bad}; choose from {list(PARTS)}")
    rows = []
    try:
        decode4_rows(rows, parts)
    finally:
        path = os.path.join(os.environ.get("OUT", "."), "bench_decode4.json")
        with open(path, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), copy_gbs=copy_gbs, rows=rows), f)
        print_decode4_table(rows, copy_gbs)


if __name__ == "__main__":
    main()
