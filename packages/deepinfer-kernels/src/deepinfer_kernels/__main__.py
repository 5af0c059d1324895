"""`python -m deepinfer_kernels`: which implementation each op resolves to here, and why.

The device-level choice is shown; a tier with a per-call check (dtype, shape limits, an opt-in
gate) says so, and a call it rejects goes to the next tier. Tiers that can run here and split
their calls among several kernels say how (`Implementation.routing`), one line each."""

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


if __name__ == "__main__":
    main()
