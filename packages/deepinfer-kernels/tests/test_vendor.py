"""The `vendor` tier (`vendor/tile_kernels.py`): its capability check and its plumbing on CPU (a
stand-in `tile_kernels` module computing the reference, to check the shapes the adapter passes
and returns), and on a GPU with TileKernels installed the real kernel against the ref tier, bit
for bit."""

from __future__ import annotations

import importlib.util
import sys
import types

import pytest
import torch
from deepinfer_kernels import ops, quant
from deepinfer_kernels.ref import quant as ref_quant
from deepinfer_kernels.registry import REGISTRY
from deepinfer_kernels.vendor import tile_kernels as vtk
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

HAVE_TK = importlib.util.find_spec("tile_kernels") is not None and torch.cuda.is_available()


def _same(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> bool:
    return torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(
        got[1], want[1]
    )


def test_the_registry_declares_the_vendor_tier_behind_the_import():
    impl = next(i for i in REGISTRY.implementations("act_quant_fp8") if i.tier == "vendor")
    assert impl.requires == ("tile_kernels",) and impl.devices == ("cuda",)
    assert ops.act_quant_fp8(torch.zeros(1, 64))[1].shape == (1, 2)  # ref on CPU
    # the adapter imports the library inside its functions, not with the module
    assert "tile_kernels" not in sys.modules or HAVE_TK


def test_quant_reason_names_the_problem():
    x = torch.zeros(4, 64, dtype=torch.bfloat16)
    assert "float16" in vtk.quant_reason(x.half())
    assert "multiple of 64" in vtk.quant_reason(torch.zeros(4, 96))
    assert vtk.quant_reason(x) == "input on cpu"


@pytest.fixture
def stand_in(monkeypatch):
    """A `tile_kernels` whose cast is the reference's (2-D contiguous in, (q, s) out, as the
    library's), recording the shapes it was given, with a settable amax clamp."""
    seen = []
    clamp = {"value": quant.ACT_AMAX_FLOOR}

    def per_token_cast(x, fmt, num_per_channels, round_sf=False):
        assert (fmt, num_per_channels, round_sf, x.dim()) == ("e4m3", 32, True, 2)
        assert x.is_contiguous()
        seen.append(tuple(x.shape))
        return ref_quant.act_quant_fp8(x)

    root = types.ModuleType("tile_kernels")
    root.get_amax_clamp_for_quant = lambda fmt, e4m3_sf: clamp["value"]
    sub = types.ModuleType("tile_kernels.quant")
    sub.per_token_cast = per_token_cast
    root.quant = sub
    monkeypatch.setitem(sys.modules, "tile_kernels", root)
    monkeypatch.setitem(sys.modules, "tile_kernels.quant", sub)
    vtk.import_reason.cache_clear()
    yield seen, clamp
    vtk.import_reason.cache_clear()


# the stand-in only records shapes: sharing it across examples is safe
@settings(
    max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    lead=st.lists(st.integers(1, 3), min_size=1, max_size=3),
    groups=st.integers(1, 4),
    strided=st.booleans(),
)
def test_adapter_flattens_rows_and_restores_shapes(stand_in, lead, groups, strided):
    seen, _ = stand_in
    x = torch.randn(*lead, 64 * groups * (2 if strided else 1)).bfloat16()
    if strided:  # rows with a gap after them: the adapter passes a contiguous copy
        x = x[..., : 64 * groups]
    q, s = vtk.act_quant_fp8(x)
    assert q.shape == x.shape and s.shape == (*lead, 2 * groups)
    assert _same((q, s), ref_quant.act_quant_fp8(x))
    assert seen[-1] == (x.numel() // x.shape[-1], 64 * groups)


def test_a_changed_library_clamp_is_refused(stand_in):
    _, clamp = stand_in
    x = types.SimpleNamespace(dtype=torch.bfloat16, shape=(2, 64), device=torch.device("cuda"))
    assert vtk.quant_reason(x) is None
    clamp["value"] = 1e-6
    assert "amax clamp is 1e-06" in vtk.quant_reason(x)


def test_a_library_that_does_not_import_is_declined(monkeypatch):
    """Installed but broken (a missing dependency): the tier declines with the error."""
    monkeypatch.setitem(sys.modules, "tile_kernels", None)  # `import tile_kernels` raises
    vtk.import_reason.cache_clear()
    try:
        x = types.SimpleNamespace(dtype=torch.bfloat16, shape=(2, 64), device=torch.device("cuda"))
        assert vtk.quant_reason(x).startswith("tile_kernels does not import: ModuleNotFoundError")
    finally:
        vtk.import_reason.cache_clear()


needs_tk = pytest.mark.skipif(not HAVE_TK, reason="needs a CUDA GPU and tile_kernels installed")


@needs_tk
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 64), (7, 5120), (300, 2304), (3, 4, 1280), (8192, 5120)])
def test_tile_kernels_act_quant_matches_ref_bitwise(dtype, shape):
    g = torch.Generator(device="cuda").manual_seed(7)
    x = (torch.randn(shape, device="cuda", generator=g) * 4).to(dtype)
    x.view(-1)[:32] = 0.0  # a zero group: the amax floor
    x.view(-1)[32:64] *= 1e-7  # a group under the floor
    assert _same(vtk.act_quant_fp8(x), ref_quant.act_quant_fp8(x))


@needs_tk
def test_registry_picks_the_vendor_tier_where_it_can():
    x = torch.randn(5, 256, device="cuda").bfloat16()
    assert REGISTRY.resolve("act_quant_fp8", x).tier == "vendor"
    assert REGISTRY.resolve("act_quant_fp8", x[:, :96]).tier != "vendor"  # K not a multiple of 64
    assert _same(ops.act_quant_fp8(x), ref_quant.act_quant_fp8(x))
