"""Benchmark the deepinfer-kernels ops on this GPU as the package runs them; print one table.

Every row calls an op's public function (`deepinfer_kernels.ops`), so it times the kernel the
registry and the op modules pick for that call, in auto mode (`[auto]`) and, where the op's
dispatch reads the flag, in batch-invariant mode (`[inv]`; the mode is set once around the
timing, graphs captured in it, as an engine sets it). Beside it, a torch baseline timed in the
same run:
- act_quant_fp8 (no mode of its own): the ref tier (torch ops).
- hc_mixes, hc_split_sinkhorn, hc_pre, hc_post, rms_norm, rope at T = 1 / 64 / 4096 (V4.1's
  widths; one input set per shape, so the small-T rows measure launch cost, not HBM): the ref
  tier. Only hc_mixes reads the mode (auto mode sends T > 128 to ref).
- fp8_gemm, fp8_linear: dequantise the FP8 weight to bf16 + a bf16 torch.matmul (`xtorch`); the
  matmul alone on a weight dequantised beforehand (`xmm`). `fp8_gemm[triton]`: the portable GPU
  tier (`ops.linear.run_on`), which GPUs without the cuda tier run.
- moe_experts (one V4.1 MoE layer: 384 random FP4 experts, top-6): a torch loop over the active
  experts, each dequantising its FP4 weights to bf16 for bf16 matmuls with the same clamped
  SwiGLU. `[inv frag]`: batch-invariant mode on fragment-order weights, as the model keeps them
  in that mode. moe_gate: the same math in torch ops.

Columns: median ms; TFLOP/s; GB/s over the fewest bytes the op must move (each input read once,
each output written once; the active experts' bytes for MoE); percent of the FP8 ceiling
(DeepGEMM's rate on the H200) and of the copy bandwidth measured at the start of the run; the
speed-ups over the baselines. `timing` says how a row was timed:
- eager: triton.testing.do_bench, rotating over argument sets (> 256 MiB of weights for the
  GEMMs, 8 routed batches for MoE at T <= 256) so the L2 cache does not serve them;
- graph: one CUDA graph per argument set, replays rotating (the engine's decode, no host
  launches);
- chain16 / chain8: one CUDA graph of 16 GEMM calls on 16 distinct weights (> L2), or 8 MoE calls
  on 8 routings, ms per call (a decode step is one graph over all layers);
- wall: host wall clock per call over 100 calls then one synchronize (what a Python decode loop
  pays when the host's launches outrun the GPU).

Usage (GPU machine): python tools/bench_kernels.py [--quick] [--only PARTS] [--moe-tokens T ...]
PARTS: a comma list of quant, small, gemm, decode (the dense GEMM at M <= 64 in graphs), moe;
default all. `--quick`: fewer shapes. The routing tables are re-measured by
`bench_prefill.py --routes` (dense) and `bench_moe.py` (MoE). JSON of the rows in $OUT.
"""

from __future__ import annotations

import argparse
import math

import harness
import torch
import torch.nn.functional as F
from harness import Col, Rotating, bench_graphs, bench_ms, chain_graph_ms, wall_ms

PARTS = ("quant", "small", "gemm", "decode", "moe")
MODES = (("auto", False), ("inv", True))

GEMM_SHAPES = [
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
QUICK_GEMM_M = (1, 64, 256, 8192)
DECODE_SHAPES = {
    (5120, 8192): (1, 16, 32, 64),
    (2112, 7168): (1, 16, 64),
    (32768, 1280): (1, 16, 64),
}
"""[N, K] -> M of the decode part: wo_b and wq_b of V4.1, and a narrow weight (V3's wq_a)."""
QUICK_DECODE_SHAPES = {(5120, 8192): (1, 64), (32768, 1280): (1, 64)}
CHAIN_L = 16
"""GEMM calls per chained graph: 16 distinct weights (672 MB at 5120x8192, > L2)."""

# V4.1's widths for the small ops: hidden, residual streams, mHC mixes ((2 + hc) * hc), heads,
# head dim, rope dim (the tail of each head)
D, HC, MIX, HEADS, HEAD_DIM, RD = 5120, 4, 24, 64, 512, 64


def _row(
    op: str,
    shape: str,
    timing: str,
    ms: float,
    flops: float = 0.0,
    nbytes: float = 0.0,
    torch_ms: float | None = None,
    mm_ms: float | None = None,
) -> dict:
    """One row of the table: what ran, how it was timed, and what it moved and computed."""
    return dict(
        op=op, shape=shape, timing=timing, ms=ms, flops=flops, bytes=nbytes, torch_ms=torch_ms,
        mm_ms=mm_ms,
    )  # fmt: skip


def _nbytes(obj) -> int:
    """Bytes of the tensors in obj (a tensor, or a tuple / list of them)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (tuple, list)):
        return sum(_nbytes(o) for o in obj)
    return 0


# ---- act_quant_fp8 ----------------------------------------------------------------------------


def quant_rows(rows: list[dict]) -> None:
    """`ops.act_quant_fp8` (the registry's tier: TileKernels' where installed, else Triton) at a
    prefill and a decode size, against the ref tier."""
    from deepinfer_kernels import ops
    from deepinfer_kernels.ref import quant as ref_quant

    for m in (8192, 64):
        x = torch.randn(m, 5120, device="cuda").bfloat16()
        nbytes = x.numel() * 2 + x.numel() + x.numel() // 8
        torch_ms = bench_ms(lambda x=x: ref_quant.act_quant_fp8(x))
        ms = bench_ms(lambda x=x: ops.act_quant_fp8(x))
        rows.append(_row("act_quant_fp8", f"{m}x5120 bf16", "eager", ms, 0.0, nbytes, torch_ms))


# ---- small per-token ops ----------------------------------------------------------------------


def _small_cases(t: int) -> list[tuple]:
    """(name, ref function, op, args, reads the mode) at T tokens."""
    from deepinfer_kernels import ops
    from deepinfer_kernels.ref import mhc as ref_mhc
    from deepinfer_kernels.ref import norm as ref_norm
    from deepinfer_kernels.ref import rope as ref_rope

    g = torch.Generator(device="cuda").manual_seed(t)

    def rn(*s, dtype=torch.float32, scale=1.0):
        return (torch.randn(*s, generator=g, device="cuda") * scale).to(dtype)

    h = rn(t, HC, D, dtype=torch.bfloat16)
    fn = rn(MIX, HC * D, scale=0.02)
    mixes = rn(t, MIX, scale=2.0)
    scale, base = torch.rand(3, device="cuda") + 0.5, rn(MIX)
    pre, post = torch.rand(t, HC, device="cuda"), 2 * torch.rand(t, HC, device="cuda")
    comb = torch.rand(t, HC, HC, device="cuda") / HC
    y = rn(t, D, dtype=torch.bfloat16)
    w = (1 + 0.1 * rn(D)).to(torch.bfloat16)
    q = rn(t, HEADS, HEAD_DIM, dtype=torch.bfloat16)[..., -RD:]
    pos = torch.randint(0, 1 << 16, (t,), device="cuda")
    inv_freq = 10000.0 ** -(torch.arange(0, RD, 2, device="cuda").float() / RD)
    sinkhorn = (mixes, scale, base, HC, 20, 1e-6)
    return [
        ("hc_mixes", ref_mhc.hc_mixes, ops.hc_mixes, (h, fn, 1e-20), True),
        ("hc_split_sinkhorn", ref_mhc.hc_split_sinkhorn, ops.hc_split_sinkhorn, sinkhorn, False),
        ("hc_pre", ref_mhc.hc_pre, ops.hc_pre, (h, pre), False),
        ("hc_post", ref_mhc.hc_post, ops.hc_post, (y, h, post, comb), False),
        ("rms_norm", ref_norm.rms_norm, ops.rms_norm, (y, w, 1e-20), False),
        ("rope", ref_rope.rope, ops.rope, (q, pos, inv_freq, False), False),
    ]


def small_rows(rows: list[dict], quick: bool) -> None:
    """The per-token small ops at T = 1 / 64 / 4096 (--quick: 1 / 64), eager and, at T <= 64,
    by the host's wall clock; each against the ref tier timed the same way."""
    from deepinfer_kernels import REGISTRY

    rep = 25 if quick else 50
    for t in (1, 64) if quick else (1, 64, 4096):
        for name, ref_fn, op_fn, args, reads_mode in _small_cases(t):
            out = ref_fn(*args)
            nbytes = _nbytes(args) + _nbytes(out)
            shape = f"T={t}"
            torch_ms = bench_ms(lambda f=ref_fn, a=args: f(*a), rep_ms=rep)
            torch_wall = wall_ms(lambda f=ref_fn, a=args: f(*a), 100) if t <= 64 else None
            for mode, inv in MODES if reads_mode else MODES[:1]:
                with REGISTRY.batch_invariant_mode(inv):
                    op_fn(*args)  # compile / warm
                    ms = bench_ms(lambda f=op_fn, a=args: f(*a), rep_ms=rep)
                    wall = wall_ms(lambda f=op_fn, a=args: f(*a), 100) if t <= 64 else None
                op = f"{name}[{mode}]"
                rows.append(_row(op, shape, "eager", ms, 0.0, nbytes, torch_ms))
                if wall is not None:
                    rows.append(_row(op, shape, "wall", wall, 0.0, nbytes, torch_wall))


# ---- dense FP8 GEMM ---------------------------------------------------------------------------


def torch_baselines(sets) -> tuple[float, float]:
    """The torch baselines of an FP8 GEMM over rotating (x, xq, xs, w, ws) sets, ms: dequantise
    the weight to bf16 + bf16 matmul, and the matmul alone on weights dequantised beforehand."""
    from deepinfer_kernels import quant

    def dequant_matmul(x, xq, xs, w, ws):
        return x @ quant.dequantize_fp8_blocks(w, ws, torch.bfloat16).t()

    w_bf16 = [quant.dequantize_fp8_blocks(s[3], s[4], torch.bfloat16) for s in sets]
    t_torch = bench_ms(Rotating(dequant_matmul, sets))
    pairs = [(s[0], wd) for s, wd in zip(sets, w_bf16, strict=True)]
    t_mm = bench_ms(Rotating(lambda x, wd: x @ wd.t(), pairs))
    return t_torch, t_mm


def gemm_bytes(m: int, n: int, k: int) -> int:
    """The weight and its scales, the FP8 activations and their scales, the bf16 output."""
    return harness.fp8_weight_bytes(n, k) + m * k + m * k // 8 + 2 * m * n


def gemm_rows(rows: list[dict], quick: bool) -> None:
    """`ops.fp8_gemm` in both modes, the triton tier's plan (auto mode), and `ops.fp8_linear`
    (activation quantisation included) in both modes at M > 256, eager."""
    from deepinfer_kernels import REGISTRY, ops, quant

    shapes = [s for s in GEMM_SHAPES if s[0] in QUICK_GEMM_M] if quick else GEMM_SHAPES
    for m, n, k in shapes:
        copies = max(1, min(4, (256 << 20) // (n * k)))  # > 256 MiB of weights in rotation
        sets = []
        for w, ws in harness.fp8_weights(n, k, copies):
            x = torch.randn(m, k, device="cuda").bfloat16()
            xq, xs = quant.act_quant_fp8(x)
            sets.append((x, xq, xs, w, ws))
        flops, nbytes, shape = 2.0 * m * n * k, gemm_bytes(m, n, k), f"{m}x{n}x{k}"
        t_torch, t_mm = torch_baselines(sets)
        runs = [  # (row name, batch-invariant, fn of a set, bytes beyond the FP8 GEMM's)
            (f"fp8_gemm[{mode}]", inv, lambda x, xq, xs, w, ws: ops.fp8_gemm(xq, xs, w, ws), 0)
            for mode, inv in MODES
        ]
        runs.append(("fp8_gemm[triton]", False, triton_gemm, 0))
        if m > 256:  # the bf16 activations read instead of the FP8 ones: m * k more bytes
            runs += [
                (
                    f"fp8_linear[{mode}]",
                    inv,
                    lambda x, xq, xs, w, ws: ops.fp8_linear(x, w, ws),
                    m * k,
                )
                for mode, inv in MODES
            ]
        for op, inv, fn, extra in runs:
            with REGISTRY.batch_invariant_mode(inv):
                ms = bench_ms(Rotating(fn, sets))
            rows.append(_row(op, shape, "eager", ms, flops, nbytes + extra, t_torch, t_mm))


def triton_gemm(x, xq, xs, w, ws):
    """The triton tier's plan of this `fp8_gemm` call, whatever tier the registry would pick."""
    from deepinfer_kernels.ops import linear

    return linear.run_on("triton", "fp8_gemm", xq, xs, w, ws, torch.bfloat16)


def decode_rows(rows: list[dict], quick: bool) -> None:
    """`ops.fp8_gemm` at decode sizes in both modes as CUDA graphs: one graph per weight set
    rotating over 4 sets (`graph`), and one graph of CHAIN_L calls on CHAIN_L distinct weights
    (`chain16`)."""
    from deepinfer_kernels import REGISTRY, ops, quant

    for (n, k), ms_list in (QUICK_DECODE_SHAPES if quick else DECODE_SHAPES).items():
        weights = harness.fp8_weights(n, k, CHAIN_L)
        for m in ms_list:
            sets = []
            for w, ws in weights:
                xq, xs = quant.act_quant_fp8(torch.randn(m, k, device="cuda").bfloat16())
                sets.append((xq, xs, w, ws))
            flops, nbytes, shape = 2.0 * m * n * k, gemm_bytes(m, n, k), f"{m}x{n}x{k}"
            for mode, inv in MODES:
                op = f"fp8_gemm[{mode}]"
                with REGISTRY.batch_invariant_mode(inv):
                    graph = bench_graphs(ops.fp8_gemm, sets[:4])
                    chain = chain_graph_ms(ops.fp8_gemm, sets)
                rows.append(_row(op, shape, "graph", graph, flops, nbytes))
                rows.append(_row(op, shape, f"chain{CHAIN_L}", chain, flops, nbytes))


# ---- MoE --------------------------------------------------------------------------------------


def _torch_gate(x, wg, bias, k, route_scale):
    s = torch.sqrt(F.softplus(x.float() @ wg.float().t()))
    ids = (s + bias).topk(k, dim=-1).indices
    w = s.gather(-1, ids)
    return w / (w.sum(-1, keepdim=True) + 1e-20) * route_scale, ids


def moe_rows(rows: list[dict], quick: bool, tokens_list) -> None:
    """`ops.moe_experts` in auto mode, batch-invariant mode, and batch-invariant mode on
    fragment-order weights (`inv frag`): at T <= 256 as graphs (one per routing, rotating over 8;
    and one graph of 8 calls on the 8 routings) and eager, above eager on one routing; against
    the torch loop (--quick: only at T <= 256). Then `ops.moe_gate` in both modes."""
    from deepinfer_kernels import REGISTRY, ops, quant

    d, i, e, k = harness.MOE_D, harness.MOE_I, harness.MOE_E, harness.MOE_K
    limit = harness.MOE_LIMIT
    g = torch.Generator(device="cuda").manual_seed(0)
    experts, per_expert_bytes = harness.moe_layer(g)
    w1, s1, w3, s3, w2, s2 = experts
    runs = {  # row name: (batch-invariant, weights, fragment order)
        "auto": (False, experts, False),
        "inv": (True, experts, False),
        "inv frag": (True, harness.fragment_experts(experts), True),
    }
    for t in tokens_list:
        sets = harness.moe_routings(t, 8 if t <= 256 else 1, g)
        nbytes = harness.active_experts(sets) * per_expert_bytes + 2 * t * d * 2 + t * k * 12
        flops = 6.0 * t * k * d * i
        shape = f"T={t} E={e} k={k} D={d} I={i}"

        def base(x, tw, ids):
            y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
            for ex in torch.unique(ids).tolist():
                r, c = torch.nonzero(ids == ex, as_tuple=True)
                a = quant.dequantize_fp4(w1[ex], s1[ex], torch.bfloat16)
                b = quant.dequantize_fp4(w3[ex], s3[ex], torch.bfloat16)
                o = quant.dequantize_fp4(w2[ex], s2[ex], torch.bfloat16)
                xe = x[r]
                gte = (xe @ a.t()).float().clamp(max=limit)
                up = (xe @ b.t()).float().clamp(-limit, limit)
                h = (F.silu(gte) * up * tw[r, c, None]).bfloat16()
                y.index_add_(0, r, (h @ o.t()).float())
            return y.bfloat16()

        t_torch = None
        if t <= 256 or not quick:
            t_torch = bench_ms(Rotating(base, sets), rep_ms=50 if t > 256 else 100)
        for name, (inv, ws, frag) in runs.items():

            def fn(x, tw, ids, ws=ws, frag=frag):
                return ops.moe_experts(x, tw, ids, *ws, limit, fragment_order=frag)

            op = f"moe_experts[{name}]"
            with REGISTRY.batch_invariant_mode(inv):
                if t <= 256:
                    graph, chain = bench_graphs(fn, sets), chain_graph_ms(fn, sets)
                    rows.append(_row(op, shape, "graph", graph, flops, nbytes, t_torch))
                    rows.append(_row(op, shape, f"chain{len(sets)}", chain, flops, nbytes, t_torch))
                eager = bench_ms(Rotating(fn, sets))
            rows.append(_row(op, shape, "eager", eager, flops, nbytes, t_torch))
    wg = (torch.randn(e, d, device="cuda", generator=g) * 0.02).bfloat16()
    bias = torch.randn(e, device="cuda", generator=g) * 0.1
    for t in (64, 8192):
        x = torch.randn(t, d, device="cuda", generator=g).bfloat16()
        torch_ms = bench_ms(lambda x=x: _torch_gate(x, wg, bias, k, 1.5))
        nbytes = e * d * 2 + t * d * 2 + t * k * 12
        for mode, inv in MODES:
            with REGISTRY.batch_invariant_mode(inv):
                ms = bench_ms(lambda x=x: ops.moe_gate(x, wg, bias, k, 1.5))
            rows.append(_row(f"moe_gate[{mode}]", f"T={t} E={e} D={d}", "eager", ms,
                             2.0 * t * e * d, nbytes, torch_ms))  # fmt: skip


# ---- the table --------------------------------------------------------------------------------


def make_table(ceilings: dict) -> harness.Table:
    def tflops(r):
        return r["flops"] / r["ms"] / 1e9 if r["flops"] else None

    def gbs(r):
        return r["bytes"] / r["ms"] / 1e6 if r["bytes"] else None

    def pct_fp8(r):
        return 100 * tflops(r) / harness.FP8_CEILING_TFLOPS

    def pct_bw(r):
        return 100 * gbs(r) / ceilings["copy_gbs"]

    return harness.Table(
        "bench_kernels",
        [
            Col("op", "op"),
            Col("shape", "shape"),
            Col("timing", "timing"),
            Col("ms", "ms", ".4f"),
            Col("TFLOP/s", tflops, ".1f"),
            Col("GB/s", gbs, ".0f"),
            Col("%fp8", pct_fp8, ".1f"),
            Col("%bw", pct_bw, ".1f"),
            Col("xtorch", lambda r: r["torch_ms"] / r["ms"], ".2f"),
            Col("xmm", lambda r: r["mm_ms"] / r["ms"], ".2f"),
        ],
    )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="fewer shapes and token counts")
    ap.add_argument("--only", default=",".join(PARTS), help=f"comma list of {', '.join(PARTS)}")
    ap.add_argument(
        "--moe-tokens",
        nargs="+",
        type=int,
        default=[1, 16, 64, 256, 8192],
        help="T of the moe_experts rows (graphs up to 256)",
    )
    args = ap.parse_args()
    parts = [p.strip() for p in args.only.split(",") if p.strip()]
    bad = [p for p in parts if p not in PARTS]
    if bad:
        ap.error(f"--only: unknown part(s) {bad}; parts are {', '.join(PARTS)}")
    if not torch.cuda.is_available():
        raise SystemExit("bench_kernels: needs a CUDA GPU")
    torch.backends.cuda.matmul.allow_tf32 = False
    ceilings = {"copy_gbs": math.nan}
    table = make_table(ceilings)
    q = args.quick
    measure_part = {
        "quant": lambda rows: quant_rows(rows),
        "small": lambda rows: small_rows(rows, q),
        "gemm": lambda rows: gemm_rows(rows, q),
        "decode": lambda rows: decode_rows(rows, q),
        "moe": lambda rows: moe_rows(rows, q, args.moe_tokens),
    }

    def measure(rows: list[dict]) -> None:
        ceilings["copy_gbs"] = harness.measure_copy_gbs()
        table.meta.update(copy_gbs=ceilings["copy_gbs"], fp8_tflops=harness.FP8_CEILING_TFLOPS)
        table.title = (
            f"bench_kernels: {harness.device_name()}, torch {torch.__version__}; copy ceiling "
            f"{ceilings['copy_gbs']:.0f} GB/s (measured), FP8 ceiling "
            f"{harness.FP8_CEILING_TFLOPS:.0f} TFLOP/s (DeepGEMM on the H200)"
        )
        print(f"copy ceiling {ceilings['copy_gbs']:.0f} GB/s", flush=True)
        for part in PARTS:  # in this order whatever the order of --only
            if part not in parts:
                continue
            before = len(rows)
            measure_part[part](rows)
            print(f"# {part}: {len(rows) - before} rows", flush=True)

    harness.run(table, measure)


if __name__ == "__main__":
    main()
