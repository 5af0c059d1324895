"""Benchmark the per-token small ops, ref tier vs triton tier, on this GPU; print one table.

Ops at V4.1-Flash shapes (hidden 5120, hc 4, 64 heads, rope dim 64 as the tail of a 512 head):
hc_mixes, hc_split_sinkhorn (20 iterations), hc_pre, hc_post, rms_norm, rope. For T = 1, 64, 4096:
- `gpu us`: median of triton.testing.do_bench (CUDA events around back-to-back calls, so a call
  whose host launches outrun the GPU shows its launch gaps too);
- `wall us`: host wall clock per call over 100 calls then one synchronize (what a Python decode
  loop pays: max of host launch time and GPU time);
- `kern`: kernels launched by one call (torch.profiler);
- `rel err`: ||triton - ref|| / ||ref|| on the same random inputs.
The triton tier is called through the registry (`deepinfer_kernels.ops`), the ref tier directly;
the run uses batch-invariant settings so that the registry keeps hc_mixes on triton at every T
(outside that mode it sends T > 128 to ref; no other op here reads the flag).
Inputs are one random set per shape (they fit in L2 at small T: the small-T rows measure launch
cost, not HBM).

Usage (GPU machine): python tools/bench_small_ops.py [--quick]
"""

from __future__ import annotations

import argparse
import time

import torch
from deepinfer_kernels import REGISTRY, ops
from deepinfer_kernels.ref import mhc as ref_mhc
from deepinfer_kernels.ref import norm as ref_norm
from deepinfer_kernels.ref import rope as ref_rope

D, HC, MIX, HEADS, HEAD_DIM, RD = 5120, 4, 24, 64, 512, 64
# calls per layer in one decode step (two mHC sites; norms: attn, ffn, q_lora, kv; rope: q, kv,
# the inverse on the attention output): the per-layer column is an estimate from these
PER_LAYER = {
    "hc_mixes": 2,
    "hc_split_sinkhorn": 2,
    "hc_pre": 2,
    "hc_post": 2,
    "rms_norm": 4,
    "rope": 3,
}


def _cases(t: int):
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
    return [
        ("hc_mixes", ref_mhc.hc_mixes, ops.hc_mixes, (h, fn, 1e-20)),
        (
            "hc_split_sinkhorn",
            ref_mhc.hc_split_sinkhorn,
            ops.hc_split_sinkhorn,
            (mixes, scale, base, HC, 20, 1e-6),
        ),
        ("hc_pre", ref_mhc.hc_pre, ops.hc_pre, (h, pre)),
        ("hc_post", ref_mhc.hc_post, ops.hc_post, (y, h, post, comb)),
        ("rms_norm", ref_norm.rms_norm, ops.rms_norm, (y, w, 1e-20)),
        ("rope", ref_rope.rope, ops.rope, (q, pos, inv_freq, False)),
    ]


def _rel(a, b) -> float:
    if isinstance(a, tuple):
        return max(_rel(x, y) for x, y in zip(a, b, strict=True))
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _wall_us(fn, args, n: int = 100) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn(*args)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


def _kernels(fn, args) -> int:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn(*args)
        torch.cuda.synchronize()
    return sum(
        1
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA and "Memset" not in e.name
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="T = 1, 64 only, shorter timing")
    a = ap.parse_args()
    tokens = (1, 64) if a.quick else (1, 64, 4096)
    with REGISTRY.batch_invariant_mode():
        run(tokens, a)


def run(tokens, a) -> None:
    import triton.testing

    rep = 25 if a.quick else 50
    rows = []
    kern_ref: dict[str, int] = {}
    kern_tri: dict[str, int] = {}
    for t in tokens:
        for name, ref_fn, tri_fn, args in _cases(t):
            out_t, out_r = tri_fn(*args), ref_fn(*args)  # compile / warm
            err = _rel(out_t, out_r)
            r_ms = triton.testing.do_bench(
                lambda f=ref_fn, a=args: f(*a), rep=rep, return_mode="median"
            )
            t_ms = triton.testing.do_bench(
                lambda f=tri_fn, a=args: f(*a), rep=rep, return_mode="median"
            )
            rw, tw = _wall_us(ref_fn, args), _wall_us(tri_fn, args)
            try:
                kr, kt = _kernels(ref_fn, args), _kernels(tri_fn, args)
            except Exception as e:  # the profiler is optional: the timing table still prints
                print(f"profiler failed: {e!r}")
                kr = kt = -1
            if t == 64:
                kern_ref[name], kern_tri[name] = kr, kt
            rows.append((name, t, r_ms * 1e3, t_ms * 1e3, rw, tw, kr, kt, err))
    print(
        f"\n{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}"
    )
    hdr = (
        f"{'op':<18}{'T':>5} {'ref gpu us':>11}{'tri gpu us':>11}{'x':>6} "
        f"{'ref wall':>9}{'tri wall':>9}{'x':>6} {'kern r/t':>9} {'rel err':>9}"
    )
    print(hdr)
    print("-" * len(hdr))
    for name, t, r, tt, rw, tw, kr, kt, err in rows:
        print(
            f"{name:<18}{t:>5} {r:>11.1f}{tt:>11.1f}{r / tt:>6.1f} "
            f"{rw:>9.1f}{tw:>9.1f}{rw / tw:>6.1f} {f'{kr}/{kt}':>9} {err:>9.1e}"
        )
    if kern_ref:
        per_r = sum(PER_LAYER[k] * v for k, v in kern_ref.items())
        per_t = sum(PER_LAYER[k] * v for k, v in kern_tri.items())
        print(
            f"kernels per layer for these ops (T=64, calls/layer {PER_LAYER}): {per_r} -> {per_t}"
        )


if __name__ == "__main__":
    main()
