"""Activation quantisation op: FP8 e4m3 per 32 channels with power-of-two (UE8M0) scales
(`act_quant_fp8`), whose outputs feed `ops.fp8_gemm`.

KV fake-quantisation ops (quantise then dequantise, same dtype): `fake_quant_fp8_ue8m0` (window
KV), `fake_quant_fp4_ue8m0` (index keys and queries), `fake_quant_fp4_e4m3_scale` (compressed
KV); their `ref` tier is `deepinfer_kernels.quant`, which defines the numerics, and the triton
tier reproduces it bit for bit in one launch.

Tiers: `vendor` (TileKernels, where installed: the same bits), `triton` (the default on a GPU and
the portable one), `ref` (`deepinfer_kernels.quant`)."""

from __future__ import annotations

import torch

from ..quant import FP8_BLOCK
from ..registry import REGISTRY, Implementation
from ._checks import FLOAT_DTYPES, need, need_dtype

REGISTRY.declare(
    "act_quant_fp8", "x [..., K] -> (x_fp8 [..., K] e4m3, scale [..., K/32] fp32 powers of two)"
)
REGISTRY.register(
    Implementation("act_quant_fp8", "ref", "deepinfer_kernels.ref.quant:act_quant_fp8")
)
REGISTRY.register(
    Implementation(
        "act_quant_fp8",
        "triton",
        "deepinfer_kernels.triton.quant:act_quant_fp8",
        devices=("cuda",),
        min_capability=(9, 0),
        requires=("triton",),
        supports="deepinfer_kernels.ops._checks:cuda_input_reason",
    )
)


REGISTRY.register(
    Implementation(
        "act_quant_fp8",
        "vendor",
        "deepinfer_kernels.vendor.tile_kernels:act_quant_fp8",
        devices=("cuda",),
        min_capability=(9, 0),
        requires=("tile_kernels",),
        supports="deepinfer_kernels.vendor.tile_kernels:quant_reason",
    )
)


_FAKE_QUANT_OPS = {
    "fake_quant_fp8_ue8m0": "x [..., K], block (32) -> x.dtype, FP8 e4m3 per block, UE8M0 scales",
    "fake_quant_fp4_ue8m0": "x [..., K], block (32) -> x.dtype, FP4 e2m1 per block, UE8M0 scales",
    "fake_quant_fp4_e4m3_scale": "x [..., K], block (16) -> x.dtype, FP4 e2m1, e4m3 scale",
}
for _op, _doc in _FAKE_QUANT_OPS.items():
    REGISTRY.declare(_op, _doc)
    REGISTRY.register(Implementation(_op, "ref", f"deepinfer_kernels.quant:{_op}"))
    REGISTRY.register(
        Implementation(
            _op,
            "triton",
            f"deepinfer_kernels.triton.fake_quant:{_op}",
            devices=("cuda",),
            min_capability=(9, 0),
            requires=("triton",),
            supports="deepinfer_kernels.ops.quant:triton_fake_quant_reason",
        )
    )

_TRITON_MAX_BLOCK = 1024  # one program holds at least one whole group


def triton_fake_quant_reason(x: torch.Tensor, block: int, **_: object) -> str | None:
    """Why the triton fake-quant tier cannot run this call, or None: it needs CUDA input and a
    power-of-two block (a tile of whole groups) up to 1024."""
    if x.device.type != "cuda":
        return f"input on {x.device.type}"
    if block & (block - 1) or block > _TRITON_MAX_BLOCK:
        return f"block {block} is not a power of two <= {_TRITON_MAX_BLOCK}"
    return None


def _check_fake_quant(x: torch.Tensor, block: int, op: str) -> None:
    need(
        isinstance(block, int) and block > 0,
        f"{op}: block must be a positive int, got {block!r}",
    )
    need_dtype(x, "x", *FLOAT_DTYPES)
    need(
        x.dim() >= 1 and x.shape[-1] % block == 0,
        f"{op}: x's last dimension must be a multiple of block={block}, got shape {tuple(x.shape)}",
    )


def fake_quant_fp8_ue8m0(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """FP8 e4m3 quantise-dequantise per `block` values with power-of-two (UE8M0) scales
    ``2**ceil(log2(max(amax, 1e-4) / 448))`` (window KV). x [..., K] -> [..., K] x.dtype."""
    _check_fake_quant(x, block, "fake_quant_fp8_ue8m0")
    return REGISTRY.call("fake_quant_fp8_ue8m0", x, block)


def fake_quant_fp4_ue8m0(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """FP4 e2m1 quantise-dequantise per `block` values with power-of-two scales
    ``2**ceil(log2(amax / 6))`` (index keys and queries). x [..., K] -> [..., K] x.dtype."""
    _check_fake_quant(x, block, "fake_quant_fp4_ue8m0")
    return REGISTRY.call("fake_quant_fp4_ue8m0", x, block)


def fake_quant_fp4_e4m3_scale(x: torch.Tensor, block: int = 16) -> torch.Tensor:
    """FP4 e2m1 quantise-dequantise per `block` values with an e4m3 scale
    ``e4m3(max(amax, 6 * 2**-9) / 6)`` (compressed KV). x [..., K] -> [..., K] x.dtype."""
    _check_fake_quant(x, block, "fake_quant_fp4_e4m3_scale")
    return REGISTRY.call("fake_quant_fp4_e4m3_scale", x, block)


def _check_k(x: torch.Tensor, name: str) -> None:
    need_dtype(x, name, *FLOAT_DTYPES)
    need(
        x.dim() >= 1 and x.shape[-1] % FP8_BLOCK == 0,
        f"{name}: last dimension must be a multiple of {FP8_BLOCK}, got shape {tuple(x.shape)}",
    )


def act_quant_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] (K % 32 == 0) -> (x_fp8 [..., K] float8_e4m3fn, scale [..., K/32] fp32).

    ``scale = 2**ceil(log2(max(amax, 1e-4) / 448))`` per 32 channels; ``x ~= x_fp8 * scale``.
    """
    _check_k(x, "x")
    return REGISTRY.call("act_quant_fp8", x)
