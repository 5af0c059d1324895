"""The triton tier of the KV fake-quantisers (`triton/fake_quant.py`) against `quant.py`
(which defines the numerics), bit for bit: grids of every e4m3 / e2m1 value, their midpoints
(ties) and the floats either side of them, zeros of both signs, tiny and subnormal values, the
+-6 / +-448 boundaries, saturating e4m3 scales, and hypothesis data over shapes, dtypes and
magnitudes.

Without CUDA the kernels run under TRITON_INTERPRET=1 on CPU (set before they are defined); with
CUDA they run compiled. Every output is exact in its dtype, so the interpreter's fp32 -> bf16
truncation does not matter here.
"""

from __future__ import annotations

import pytest
import torch
from deepinfer_kernels import ops, quant
from hypothesis import given, settings
from hypothesis import strategies as st
from triton_tier import DEV, triton_module

fq = triton_module("fake_quant")

OPS = {  # op name -> default block
    "fake_quant_fp8_ue8m0": 32,
    "fake_quant_fp4_ue8m0": 32,
    "fake_quant_fp4_e4m3_scale": 16,
}
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def _assert_bitwise(name: str, x: torch.Tensor, block: int) -> None:
    """The triton kernel on DEV against quant.py on the CPU, bit for bit."""
    x = x.cpu()
    want = getattr(quant, name)(x, block)
    got = getattr(fq, name)(x.to(DEV), block).cpu()
    assert got.dtype == x.dtype and got.shape == x.shape
    iv = _INT_VIEW[x.dtype]
    diff = want.view(iv) != got.view(iv)
    if diff.any():
        raise AssertionError(
            f"{name} block={block} {x.dtype}: {int(diff.sum())} values differ, e.g. "
            f"x={x[diff][:4].tolist()} want={want[diff][:4].tolist()} got={got[diff][:4].tolist()}"
        )


def _grid_probe(grid: list[float]) -> torch.Tensor:
    """Every grid value, each midpoint between neighbours (ties), and the fp32 values just above
    and below each midpoint, both signs; fp32 [n]."""
    g = torch.tensor(sorted(set(grid)), dtype=torch.float32)
    mid = (g[1:] + g[:-1]) / 2
    up = torch.nextafter(mid, torch.tensor(float("inf")))
    down = torch.nextafter(mid, torch.tensor(float("-inf")))
    v = torch.cat([g, mid, up, down])
    return torch.cat([v, -v])


def _groups_with_amax(values: torch.Tensor, amax: float, block: int) -> torch.Tensor:
    """Lay `values` out in groups of `block` whose first element is `amax`, padding with zeros
    (so every group's scale is the one `amax` gives). fp32 [groups, block]."""
    per = block - 1
    n = -(-values.numel() // per)
    body = torch.zeros(n * per)
    body[: values.numel()] = values
    body = body.view(n, per)
    return torch.cat([torch.full((n, 1), amax), body], dim=1)


def _e4m3_grid() -> list[float]:
    sub = [m * 2.0**-9 for m in range(8)]
    normal = [(1 + m / 8) * 2.0**e for e in range(-6, 9) for m in range(8)]
    return [v for v in sub + normal if v <= 448.0]


E2M1_GRID = list(quant.FP4_VALUES)
_TORCH_E4M3_SATURATES = torch.tensor([1e4]).to(torch.float8_e4m3fn).float().item() == 448.0


def test_fp8_ue8m0_every_e4m3_value_tie_and_neighbour():
    # amax 448 * s makes the scale s exactly; then x / s runs over the probe
    s = quant.pow2_ceil(torch.tensor([448.0]) * (1.0 / 448.0)).item()
    probe = _grid_probe(_e4m3_grid())
    probe = probe[probe.abs() <= 448.0]
    tiny = torch.tensor([2.0**-10, 2.0**-11, 3 * 2.0**-11, 1e-30, -(2.0**-10), -(3 * 2.0**-11)])
    x = _groups_with_amax(torch.cat([probe, tiny]), 448.0, 32) * s
    x[0, 1:4] = torch.tensor([0.0, -0.0, -0.0])
    for dtype in (torch.float32,):  # the probe is exact only in fp32
        _assert_bitwise("fake_quant_fp8_ue8m0", x.to(dtype), 32)
    assert x.shape[0] > 10


@pytest.mark.parametrize("name", ["fake_quant_fp4_ue8m0", "fake_quant_fp4_e4m3_scale"])
def test_fp4_every_e2m1_value_tie_and_neighbour(name):
    block = OPS[name]
    probe = _grid_probe(E2M1_GRID)
    probe = probe[probe.abs() <= 6.0]
    if name == "fake_quant_fp4_ue8m0":
        s = quant.pow2_ceil(torch.tensor([6.0]) * (1.0 / 6.0)).item()
        scales = [s, s * 2.0**-20, s * 2.0**30]
    else:
        # amax = 6 * s with s an e4m3 value: amax / 6 = s exactly, and q * s is exact in fp32
        scales = [1.0, 0.875, 2.0**-9, 3 * 2.0**-9, 1.125 * 2.0**-6, 448.0, 0.3125]
    for s in scales:
        x = _groups_with_amax(probe, 6.0, block) * s
        x[0, 1:3] = torch.tensor([-0.0, 0.0])
        _assert_bitwise(name, x, block)
        _assert_bitwise(name, -x, block)


def test_e4m3_scale_ties_subnormals_and_saturation():
    # amax / 6 lands on e4m3 midpoints (ties), on subnormal e4m3 values, below the 2**-9 floor,
    # and above 448 (the scale saturates at 448, as torch's conversion does)
    grid = _e4m3_grid()
    probe = _grid_probe(grid)
    r = torch.cat([probe[probe > 0], torch.tensor([2.0**-12, 2.0**-10])])
    if _TORCH_E4M3_SATURATES:  # the kernel saturates; older torch may give NaN instead
        r = torch.cat([r, torch.tensor([449.0, 480.0, 1e4])])
    amax = r * 6.0
    gen = torch.Generator().manual_seed(3)
    body = torch.rand(r.numel(), 15, generator=gen) * 2 - 1
    x = torch.cat([amax[:, None], body * amax[:, None]], dim=1)
    _assert_bitwise("fake_quant_fp4_e4m3_scale", x, 16)
    _assert_bitwise("fake_quant_fp4_e4m3_scale", x[:, torch.randperm(16, generator=gen)], 16)


def test_zeros_and_signed_zeros():
    for name, block in OPS.items():
        for dtype in DTYPES:
            x = torch.zeros(3, 4 * block, dtype=dtype)
            x[1] = -0.0
            x[2, ::2] = -0.0
            _assert_bitwise(name, x, block)


@st.composite
def _inputs(draw):
    name = draw(st.sampled_from(sorted(OPS)))
    block = draw(st.sampled_from([OPS[name], 16, 32, 64]))
    dtype = draw(st.sampled_from(DTYPES))
    lead = draw(st.sampled_from([(1,), (3,), (2, 5), (7,)]))
    groups = draw(st.integers(1, 5))
    seed = draw(st.integers(0, 2**31 - 1))
    spread = draw(st.sampled_from([0.0, 2.0, 8.0]))
    gen = torch.Generator().manual_seed(seed)
    shape = (*lead, groups * block)
    x = torch.randn(shape, generator=gen)
    # per-group magnitudes spanning many binades; some groups tiny or all zero
    mag = torch.exp(spread * torch.randn((*lead, groups, 1), generator=gen))
    x = (x.view(*lead, groups, block) * mag).view(shape)
    kind = draw(st.sampled_from(["plain", "zeros", "tiny", "boundary"]))
    if kind == "zeros":
        x.view(-1, block)[::2] = 0.0
    elif kind == "tiny":
        x = x * 1e-30 if dtype == torch.float32 else x * 1e-6
    elif kind == "boundary":
        # exact multiples of small powers of two: many quantised values land on ties
        x = torch.round(x * 4) / 4
    x = x.to(dtype)
    if dtype != torch.float32:
        x = torch.where(torch.isfinite(x), x, torch.zeros_like(x))
    return name, block, x


@settings(max_examples=40, deadline=None)
@given(_inputs())
def test_random_inputs_bitwise(case):
    name, block, x = case
    _assert_bitwise(name, x, block)


def test_non_contiguous_input():
    x = torch.randn(64, 6).t()  # [6, 64], transposed
    y = torch.randn(8, 128)[:, ::2]  # [8, 64], stride 2
    assert not x.is_contiguous() and not y.is_contiguous()
    for name, block in OPS.items():
        _assert_bitwise(name, y, block)
        _assert_bitwise(name, x, block)


def test_op_validation_and_cpu_dispatch():
    x = torch.randn(4, 48)
    with pytest.raises(ValueError, match="multiple of block=32"):
        ops.fake_quant_fp8_ue8m0(x)
    with pytest.raises(ValueError, match="block must be a positive int"):
        ops.fake_quant_fp4_ue8m0(x, 0)
    with pytest.raises(ValueError, match="x must have dtype"):
        ops.fake_quant_fp4_e4m3_scale(torch.zeros(2, 16, dtype=torch.int32))
    from deepinfer_kernels.ops.quant import triton_fake_quant_reason

    assert triton_fake_quant_reason(x, 32) == "input on cpu"
    if DEV == "cuda":
        assert "power of two" in triton_fake_quant_reason(x.cuda(), 24)
        assert triton_fake_quant_reason(x.cuda(), 16) is None
    # CPU tensors run the ref tier (quant.py) through the registry
    z = torch.randn(3, 64)
    for name, block in OPS.items():
        assert torch.equal(getattr(ops, name)(z, block), getattr(quant, name)(z, block))
