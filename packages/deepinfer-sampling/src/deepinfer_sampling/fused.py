"""Elementwise chains of the Sampler's hot path, fused into one CUDA kernel each.

On a GPU a sampler call is bound by kernel launches, not bandwidth: its tensors past top-k are
tiny. Each op here replaces a chain of 3-30 small torch kernels by one kernel, compiled at first
use by torch's jiterator (NVRTC; no triton). Every op has a plain-torch twin with the same
arithmetic; the twin runs on CPU, and on CUDA when the fused kernel cannot be built or, checked
once on first use, does not reproduce the twin bit for bit. Rounding-sensitive steps use
explicit round-to-nearest intrinsics so that no multiply-add gets contracted into an FMA.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch

from .rng import _TWO_POW_MINUS_52, BITS52_CUDA_STATEMENTS, _bits52_torch

__all__ = ["gumbel_score", "kept_weight", "penalize", "top_p_mask"]


class FusedElementwise:
    """One elementwise op: a jiterator kernel on CUDA (validated against `twin`), else `twin`."""

    def __init__(
        self,
        source: str,
        twin: Callable[..., torch.Tensor],
        probe: Callable[[torch.device], tuple[torch.Tensor, ...]],
    ) -> None:
        self.source = source
        self.twin = twin
        self.probe = probe
        self._kernel: Callable[..., torch.Tensor] | None = None
        self._failed = False

    def __call__(self, *args: torch.Tensor) -> torch.Tensor:
        if not args[0].is_cuda or self._failed:
            return self.twin(*args)
        if self._kernel is None:
            self._build(args[0].device)
            if self._kernel is None:
                return self.twin(*args)
        return self._kernel(*args)

    @property
    def status(self) -> str:
        """'fused', 'torch' (build or check failed) or 'unbuilt'."""
        return "fused" if self._kernel is not None else ("torch" if self._failed else "unbuilt")

    def _build(self, device: torch.device) -> None:
        try:
            from torch.cuda import jiterator

            kernel = jiterator._create_jit_fn(self.source)
            probe = self.probe(device)
            got, want = kernel(*probe), self.twin(*probe)
            if got.dtype != want.dtype or not torch.equal(got, want):
                raise RuntimeError("fused kernel does not match its torch twin bit for bit")
            self._kernel = kernel
        except Exception as e:  # any failure: keep the torch twin, say so once
            warnings.warn(
                f"deepinfer_sampling: fused CUDA kernel unavailable ({e!r}); using torch ops",
                stacklevel=4,
            )
            self._failed = True


def _probe_generator(device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(1234)


# --- penalties: where(old > 0, old / rep, old * rep) - sub, float32 ---------------------------


def _penalize_twin(old: torch.Tensor, rep: torch.Tensor, sub: torch.Tensor) -> torch.Tensor:
    return torch.where(old > 0, old / rep, old * rep) - sub


def _penalize_probe(device: torch.device) -> tuple[torch.Tensor, ...]:
    g = _probe_generator(device)
    old = torch.randn(8, 64, generator=g, device=device) * 5
    old[0, :4] = float("-inf")
    rep = torch.rand(8, 64, generator=g, device=device) + 0.5
    sub = torch.rand(8, 64, generator=g, device=device)
    return old, rep, sub


penalize = FusedElementwise(
    """
template <typename T> T penalize(T old, T rep, T sub) {
    T scaled = old > T(0) ? __fdiv_rn(old, rep) : __fmul_rn(old, rep);
    return __fsub_rn(scaled, sub);
}
""",
    _penalize_twin,
    _penalize_probe,
)


# --- min-p weight: exp(v - v_max) where v >= v_max + log(min_p), else 0 (float64) ---------------


def _kept_weight_twin(
    values: torch.Tensor, first: torch.Tensor, temperature: torch.Tensor, log_min_p: torch.Tensor
) -> torch.Tensor:
    v = values.to(torch.float64) / temperature
    v_max = first.to(torch.float64) / temperature
    return torch.where(v >= v_max + log_min_p, torch.exp(v - v_max), 0.0)


def _kept_weight_probe(device: torch.device) -> tuple[torch.Tensor, ...]:
    g = _probe_generator(device)
    values = torch.randn(8, 64, generator=g, device=device) * 4
    values[1, 5:9] = float("-inf")
    first = values.max(dim=1, keepdim=True).values
    temperature = torch.rand(8, 1, generator=g, device=device, dtype=torch.float64) + 0.2
    log_min_p = torch.log(torch.rand(8, 1, generator=g, device=device, dtype=torch.float64))
    log_min_p[0] = float("-inf")
    return values, first, temperature, log_min_p


kept_weight = FusedElementwise(
    """
template <typename T> T kept_weight(T values, T first, T temperature, T log_min_p) {
    T v = values / temperature;
    T v_max = first / temperature;
    return v >= v_max + log_min_p ? exp(v - v_max) : T(0);
}
""",
    _kept_weight_twin,
    _kept_weight_probe,
)


# --- Gumbel score: values / T - log(-log u), u = counter uniform of (keys, column) ------------


def _gumbel_score_twin(
    k0: torch.Tensor,
    k1: torch.Tensor,
    k2: torch.Tensor,
    k3: torch.Tensor,
    cols: torch.Tensor,
    values: torch.Tensor,
    temperature: torch.Tensor,
) -> torch.Tensor:
    bits = _bits52_torch(torch.stack((k0, k1, k2, k3)), cols)
    u = (bits.to(torch.float64) + 0.5) * _TWO_POW_MINUS_52
    return values.to(torch.float64) / temperature - torch.log(-torch.log(u))


def _gumbel_score_probe(device: torch.device) -> tuple[torch.Tensor, ...]:
    g = _probe_generator(device)
    keys = torch.randint(0, 1 << 32, (4, 8, 1), generator=g, device=device, dtype=torch.int64)
    cols = torch.randint(0, 1 << 31, (8, 64), generator=g, device=device, dtype=torch.int64)
    values = torch.randn(8, 64, generator=g, device=device) * 4
    temperature = torch.rand(8, 1, generator=g, device=device, dtype=torch.float64) + 0.2
    return keys[0], keys[1], keys[2], keys[3], cols, values, temperature


gumbel_score = FusedElementwise(
    f"""
template <typename T>
T gumbel_score(T k0, T k1, T k2, T k3, T col, T values, T temperature) {{{BITS52_CUDA_STATEMENTS}
    T u = ((T)((hi << 20) | (lo >> 12)) + T(0.5)) * T({_TWO_POW_MINUS_52!r});
    return values / temperature - log(-log(u));
}}
""",
    _gumbel_score_twin,
    _gumbel_score_probe,
)


# --- top-p mask: keep score where the token is kept by min-p and its mass-before < threshold ---


def _top_p_mask_twin(
    score: torch.Tensor, weight: torch.Tensor, cumulative: torch.Tensor, threshold: torch.Tensor
) -> torch.Tensor:
    keep = (weight > 0) & (cumulative - weight < threshold)
    return torch.where(keep, score, float("-inf"))


def _top_p_mask_probe(device: torch.device) -> tuple[torch.Tensor, ...]:
    g = _probe_generator(device)
    score = torch.randn(8, 64, generator=g, device=device, dtype=torch.float64)
    weight = torch.rand(8, 64, generator=g, device=device, dtype=torch.float64)
    weight[:, ::7] = 0.0
    cumulative = torch.cumsum(weight, dim=1)
    threshold = torch.rand(8, 1, generator=g, device=device, dtype=torch.float64) * 30
    return score, weight, cumulative, threshold


top_p_mask = FusedElementwise(
    """
template <typename T> T top_p_mask(T score, T weight, T cumulative, T threshold) {
    const T neg_inf = -__longlong_as_double(0x7ff0000000000000LL);
    return (weight > T(0) && cumulative - weight < threshold) ? score : neg_inf;
}
""",
    _top_p_mask_twin,
    _top_p_mask_probe,
)
