"""Independent float64 math for the kernel tests: number formats decoded from their bit layouts,
round-to-nearest-even by search over every finite value, and plain loops. No deepinfer code."""

from __future__ import annotations

import math


def e4m3_values() -> list[tuple[float, int]]:
    """All finite non-negative float8_e4m3fn values as (value, mantissa code), from the bit layout:
    1 sign, 4 exponent (bias 7), 3 mantissa; exponent 0 is subnormal; S.1111.111 is NaN."""
    out = []
    for e in range(16):
        for m in range(8):
            if e == 15 and m == 7:
                continue  # NaN
            v = (m / 8) * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
            out.append((v, e * 8 + m))
    return out


E4M3 = e4m3_values()
E2M1 = [(v, c) for c, v in enumerate((0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0))]


def round_to_grid(x: float, grid: list[tuple[float, int]]) -> float:
    """Nearest grid value to x (grid: non-negative (value, code)), ties to the even code; the sign
    is carried; beyond the largest value, saturate."""
    a = abs(x)
    best_v, best_c, best_d = None, None, None
    for v, c in grid:
        d = abs(a - v)
        if best_d is None or d < best_d or (d == best_d and c % 2 == 0 and best_c % 2 == 1):
            best_v, best_c, best_d = v, c, d
    return -best_v if x < 0 else best_v


def pow2_ceil(r: float) -> float:
    return 2.0 ** math.ceil(math.log2(r))


def quant_group(values: list[float], qmax: float, grid, floor: float) -> list[float]:
    """Dequantised values of one group quantised with a power-of-two scale ceil(amax / qmax)."""
    amax = max(max(abs(v) for v in values), floor)
    s = pow2_ceil(amax / qmax)
    return [round_to_grid(max(-qmax, min(qmax, v / s)), grid) * s for v in values]
