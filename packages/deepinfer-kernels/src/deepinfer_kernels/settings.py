"""The kernel package's settings: what the registry needs to pick implementations.

The package never reads the environment: a caller passes `KernelSettings` in (the engine builds
them from its config, which reads `DEEPINFER_KERNELS` and `DEEPINFER_BATCH_INVARIANT`) and runs
its ops inside `REGISTRY.configured(settings)`.

overrides: per-op tier overrides, e.g. ``parse_overrides("fp8_gemm=ref,moe_experts=triton")``.
batch_invariant: every op's result for a row is independent of the other rows in the call (no
tile or split choice that depends on the number of rows).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

TIERS: tuple[str, ...] = ("vendor", "cuda", "tilelang", "triton", "npu", "ref")
"""Implementation tiers in default order of preference (the first that can run a call wins):
vendor adapters where importable, the hand-written CUDA kernels, TileLang (the attention side),
Triton (the portable GPU tier), torch_npu, and the torch reference."""

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


def parse_bool(name: str, value: Any) -> bool:
    """A boolean from an env value or an argument: a bool, 0 / 1, or one of 1/true/yes/on and
    0/false/no/off (any case; an empty env value is false). Anything else is an error naming
    `name`. The engine's config parses its flags with this too, so both read
    DEEPINFER_BATCH_INVARIANT the same way."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        v = value.strip().lower()
        if v in _TRUE:
            return True
        if v in _FALSE:
            return False
    raise ValueError(
        f"{name}={value!r} is not a boolean: expected one of {', '.join(_TRUE + _FALSE[:-1])}"
    )


def parse_overrides(value: str, name: str = "DEEPINFER_KERNELS") -> dict[str, str]:
    """Parse ``"op=tier,op=tier"`` into a dict; errors name `name`. Op names are checked by
    the registry when the settings are installed (`OpRegistry.check`)."""
    overrides: dict[str, str] = {}
    for item in value.split(","):
        item = item.strip()
        if not item:
            continue
        op, sep, tier = item.partition("=")
        op, tier = op.strip(), tier.strip()
        if not sep or not op or not tier:
            raise ValueError(f"{name}: {item!r} is not of the form op=tier")
        if tier not in TIERS:
            raise ValueError(
                f"{name}: tier {tier!r} for op {op!r} is not one of {', '.join(TIERS)}"
            )
        overrides[op] = tier
    return overrides


@dataclass(frozen=True)
class KernelSettings:
    """What the registry needs to pick implementations."""

    overrides: Mapping[str, str] = field(default_factory=dict)
    batch_invariant: bool = False
