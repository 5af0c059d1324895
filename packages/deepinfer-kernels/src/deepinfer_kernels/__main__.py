"""`python -m deepinfer_kernels`: which implementation each op resolves to here, and why; then the
plan of every V4.1 dense FP8 GEMM and routed-experts call on an H200.

The device-level choice is shown; a tier with a per-call check (dtype, shape limits, an opt-in
gate) says so, and a call it rejects goes to the next tier. Tiers that can run here and split
their calls among several kernels say how (`Implementation.routing`), one line each. The plan
tables are computed, not measured: `ops/linear.py` and `ops/moe.py` decide them."""

from __future__ import annotations

import torch

from . import ops  # noqa: F401  (registers every op)
from .registry import REGISTRY


def report() -> str:
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    lines = []
    for dev in devices:
        cap = torch.cuda.get_device_capability() if dev == "cuda" else None
        name = torch.cuda.get_device_name() if dev == "cuda" else "cpu"
        lines.append(f"device {dev} ({name}), batch_invariant={REGISTRY.batch_invariant}")
        for op in REGISTRY.ops():
            chosen = None
            notes = []
            routes = []
            for impl in REGISTRY.implementations(op):
                why = REGISTRY.static_reason(impl, dev, cap)
                if why is None and chosen is None:
                    chosen = impl.tier
                if why is None and impl.routing:
                    routes.append(f"      {impl.tier}: {impl.routing}")
                if why is None and impl.supports is not None:
                    # argument-dependent: dtype/shape limits or an opt-in gate, decided per call
                    why = f"ok if {impl.supports.rpartition(':')[2]}(args) passes"
                notes.append(f"{impl.tier}: {why or 'ok'}")
            lines.append(f"  {op:<24} -> {chosen or 'none':<9} [{'; '.join(notes)}]")
            lines += routes
    return "\n".join(lines)


V41_DENSE = {
    (1280, 5120): "wq_a",
    (32768, 1280): "wq_b",
    (5120, 8192): "wo_b",
    (4608, 5120): "shared W1+W3",
    (5120, 2304): "shared W2",
}
"""V4.1's dense FP8 weights [N, K] whose routes `ops/linear.py` measured (the grouped wo_a, the
compressor and indexer projections take the rule)."""
PLAN_M = (1, 16, 64, 96, 128, 192, 256, 512, 8192)
MOE_T = (1, 16, 64, 256, 1024, 8192)
H200 = ((9, 0), 132)
TIERS = ("cuda", "triton", "ref")


def _short(plan) -> str:
    """A GEMM plan as `kernel:config` in a few characters."""
    from .ops import linear

    cfg = plan.config
    if plan.kernel == "decode":
        digit = next(
            (d for d, c in linear.DECODE_CONFIGS.items() if (cfg.consumers, cfg.min_blocks) == c),
            "fill",
        )
        return f"decode:{digit}"
    if plan.kernel == "prefill":
        cut = f"/{cfg.tail_split}" if cfg.tail_split > 1 else ""
        walk = " persistent" if cfg.persistent else ""
        split = f" k{cfg.k_split}" if cfg.k_split > 1 else ""
        return f"prefill:n{cfg.block_n}{cut}{split}{walk}"
    return plan.kernel


def _moe_name(cfg) -> str:
    from .cuda import moe as cuda_moe

    for name in dir(cuda_moe):
        if name.isupper() and getattr(cuda_moe, name) == cfg:
            return name
        if name.startswith("WGMMA_PREFILL") and cuda_moe.wide_tiles(getattr(cuda_moe, name)) == cfg:
            return f"wide({name})"
    return str(cfg)


def plan_tables() -> str:
    """The plans of V4.1's dense GEMMs and routed experts on an H200 (cuda, triton, ref tiers)."""
    from .ops import linear, moe

    cap, sms = H200
    lines = ["", "plans on an H200 (sm_90, 132 SMs) for V4.1's dense FP8 weights (fp8_linear):"]
    for (n, k), name in V41_DENSE.items():
        lines.append(f"  {name} [{n}, {k}]")
        for m in PLAN_M:
            auto, inv = (
                _short(
                    linear.plan("fp8_linear", m, n, k, torch.bfloat16, bi, cap, sms, TIERS)[0][0]
                )
                for bi in (False, True)
            )
            lines.append(f"    M={m:<6} auto {auto:<28} invariant {inv}")
    lines.append("  routed experts, 384 x top-6, D=5120, I=2304, bf16 (cuda tier; invariant on")
    lines.append("  fragment-order weights, as the model passes them in that mode):")
    for t in MOE_T:
        pick = [moe.cuda_config(bi, bi, t, 6 * t, 384) for bi in (False, True)]
        lines.append(f"    T={t:<6} auto {_moe_name(pick[0]):<28} invariant {_moe_name(pick[1])}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    import argparse

    from .settings import KernelSettings, parse_bool, parse_overrides

    ap = argparse.ArgumentParser(prog="python -m deepinfer_kernels", description=__doc__)
    ap.add_argument("--kernels", default="", help="per-op tier overrides, 'op=tier,...'")
    ap.add_argument("--batch-invariant", default="0", help="0 or 1")
    args = ap.parse_args(argv)
    settings = KernelSettings(
        overrides=parse_overrides(args.kernels, "--kernels"),
        batch_invariant=parse_bool("--batch-invariant", args.batch_invariant),
    )
    with REGISTRY.configured(settings):
        print(report())
    print(plan_tables())


if __name__ == "__main__":
    main()
