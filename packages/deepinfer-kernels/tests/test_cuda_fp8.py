"""The mma.sync FP8 decode GEMM (`cuda/fp8_decode.py`, `cuda/fp8_decode.cu`).

CPU: the config's checks, shape reasons, the K split policy, the `supports` reasons, and (where
NVRTC loads) the kernel compiled for sm_90a without local memory. GPU (Hopper): against the ref
tier at decode shapes (every M tile, odd M, V4.1's shapes, with and without the K split across
CTAs, bf16 and fp32 out), every output written, the same bits on a repeated call (the split
partials are summed in a fixed order whichever CTA finishes last), CUDA-graph replay, and
`fp8_linear` through the registry."""

from __future__ import annotations

import re
import subprocess

import pytest
import torch
from deepinfer_kernels.cuda import fp8_decode as fd
from deepinfer_kernels.cuda import module
from deepinfer_kernels.ops.linear import fp8_gemm_cuda_supports, fp8_linear_cuda_supports
from hypothesis import given, settings
from hypothesis import strategies as st
from sass_checks import cuda_tools

HAVE_NVRTC = module.nvrtc_reason() is None
HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
needs_hopper = pytest.mark.skipif(
    not (HOPPER and HAVE_NVRTC), reason="needs a Hopper GPU and NVRTC"
)


@settings(max_examples=30, deadline=None)
@given(
    field=st.sampled_from(["rt", "warps", "depth", "ks", "min_blocks"]), value=st.integers(-2, 70)
)
def test_config_rejects_bad_values_naming_the_field(field, value):
    allowed = {
        "rt": {2, 4},
        "warps": set(range(1, 9)),
        "depth": set(range(0, 5)),
        "ks": set(range(0, 65)),
        "min_blocks": set(range(0, 9)),
    }[field]
    if value in allowed:
        assert getattr(fd.Fp8DecodeConfig(**{field: value}), field) == value
    else:
        with pytest.raises(ValueError, match=f"Fp8DecodeConfig.{field} must be"):
            fd.Fp8DecodeConfig(**{field: value})


def test_shapes_and_token_groups():
    assert [fd.token_groups(m) for m in (1, 8, 9, 16, 17, 33, 64)] == [1, 1, 2, 2, 4, 8, 8]
    assert fd.shape_reason(16, 5120, 8192) is None
    assert "outside" in fd.shape_reason(65, 5120, 8192)
    assert "multiple of 32" in fd.shape_reason(4, 5120, 8200)
    assert "multiple of 64" in fd.shape_reason(4, 96, 256, fd.Fp8DecodeConfig(rt=4))


@settings(max_examples=60, deadline=None)
@given(
    m=st.integers(1, 64),
    n=st.sampled_from([64, 2112, 5120, 7168, 32768]),
    k=st.sampled_from([256, 1280, 7168, 8192]),
    sms=st.sampled_from([78, 132]),
)
def test_k_split_fills_one_wave_and_keeps_warps_busy(m, n, k, sms):
    cfg = fd.DEFAULT
    ks = fd.pick_ks(m, n, k, cfg, sms)
    row_blocks = n // (16 * cfg.rt)
    depth = fd.schedule(m, cfg)[0]
    assert ks >= 1
    assert ks == 1 or row_blocks * ks <= 4 * sms  # one wave at 4 CTAs per SM
    assert ks == 1 or (k // 32) // (ks * cfg.warps) >= depth + 1


def _cpu_args(m=4, n=128, k=256):
    x = torch.zeros(m, k, dtype=torch.float8_e4m3fn)
    xs = torch.ones(m, k // 32)
    w = torch.zeros(n, k, dtype=torch.float8_e4m3fn)
    ws = torch.ones(n // 32, k // 32, dtype=torch.float8_e8m0fnu)
    return x, xs, w, ws


def test_supports_reasons():
    x, xs, w, ws = _cpu_args()
    assert "batch-invariant" in fp8_gemm_cuda_supports(x, xs, w, ws, batch_invariant=True)
    assert "out_dtype" in fp8_gemm_cuda_supports(x, xs, w, ws, torch.float16)
    assert "not routed" in fp8_gemm_cuda_supports(*_cpu_args(m=fd.ROUTED_MAX_M + 1))
    assert "float8_e8m0fnu" in fp8_gemm_cuda_supports(x, xs, w, ws.float())
    assert fp8_gemm_cuda_supports(x, xs, w, ws) == "input on cpu"
    assert fp8_linear_cuda_supports(torch.zeros(2, 3, 256), w, ws) == "input on cpu"


@pytest.mark.skipif(not HAVE_NVRTC, reason=f"{module.nvrtc_reason()}")
@pytest.mark.parametrize("m_groups", [1, 2, 4, 8])
@pytest.mark.parametrize("ks", [1, 3])
def test_kernel_compiles_without_local_memory(m_groups, ks, tmp_path):
    cub = fd.cubin(m_groups, 5120, 8192, ks, False, fd.DEFAULT)
    tools = cuda_tools()
    if tools is None:
        pytest.skip("no cuobjdump here (it ships with triton)")
    path = tmp_path / "k.cubin"
    path.write_bytes(cub)
    sass = subprocess.run(
        [tools[1], "-sass", str(path)], capture_output=True, text=True, check=True
    ).stdout
    assert "HMMA" in sass
    assert not re.search(r"\b(LDL|STL)\b", sass), "the kernel spills to local memory"


# -- GPU ---------------------------------------------------------------------------------------


def _gemm_inputs(m, n, k, seed):
    from gpu_checks import gemm_inputs

    return gemm_inputs(m, n, k, seed)


@needs_hopper
@pytest.mark.parametrize(
    ("m", "n", "k"),
    [(1, 5120, 8192), (3, 64, 256), (8, 2112, 7168), (16, 5120, 8192), (13, 32768, 1280),
     (17, 512, 1280), (33, 4096, 1024), (64, 5120, 8192)],
)  # fmt: skip
@pytest.mark.parametrize("out", [torch.bfloat16, torch.float32])
def test_close_to_ref(m, n, k, out):
    from deepinfer_kernels.ref import linear as ref_linear
    from gpu_checks import poison, rel

    args = _gemm_inputs(m, n, k, seed=m + n)
    want = ref_linear.fp8_gemm(*args, torch.float32)
    poison()
    got = fd.fp8_gemm(*args, out)
    assert got.dtype == out and got.shape == (m, n)
    assert rel(got, want) < (1e-4 if out == torch.float32 else 5e-3)


@needs_hopper
@pytest.mark.parametrize("ks", [1, 2, 5])
def test_k_split_is_deterministic_and_close(ks):
    from deepinfer_kernels.ref import linear as ref_linear
    from gpu_checks import rel

    args = _gemm_inputs(9, 1024, 4096, seed=3)
    cfg = fd.Fp8DecodeConfig(ks=ks)
    first = fd.fp8_gemm(*args, torch.float32, config=cfg)
    for _ in range(3):  # the counters were left at zero: the next calls sum the same way
        assert torch.equal(fd.fp8_gemm(*args, torch.float32, config=cfg), first)
    assert rel(first, ref_linear.fp8_gemm(*args, torch.float32)) < 1e-4


@needs_hopper
def test_graph_replay():
    xq, xs, w, ws = _gemm_inputs(16, 5120, 8192, seed=4)
    fd.fp8_gemm(xq, xs, w, ws)  # compile, load and allocate the workspace outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fd.fp8_gemm(xq, xs, w, ws)
    for seed in (5, 6):
        xq2, xs2, *_ = _gemm_inputs(16, 5120, 8192, seed=seed)
        xq.copy_(xq2)
        xs.copy_(xs2)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, fd.fp8_gemm(xq, xs, w, ws))


@needs_hopper
def test_fp8_linear_through_the_registry():
    from deepinfer_kernels import REGISTRY, ops, quant
    from deepinfer_kernels.ref import linear as ref_linear
    from gpu_checks import rel

    g = torch.Generator(device="cuda").manual_seed(7)
    w, ws = quant.quantize_fp8_blocks(torch.randn(2112, 7168, device="cuda", generator=g) * 0.02)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        x = torch.randn(2, 3, 7168, device="cuda", generator=g).to(dtype)
        assert REGISTRY.resolve("fp8_linear", x, w, ws).tier == "cuda"
        got = ops.fp8_linear(x, w, ws)
        assert got.dtype == dtype and got.shape == (2, 3, 2112)
        assert rel(got, ref_linear.fp8_linear(x, w, ws)) < 5e-3
    inv = REGISTRY.resolve("fp8_linear", x, w, ws, batch_invariant=True)
    assert inv.tier != "cuda"
