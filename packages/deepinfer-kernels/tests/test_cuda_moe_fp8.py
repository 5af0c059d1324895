"""The cuda tier's FP4 MoE experts at up to 8 tokens on FP8 wgmma (`cuda/moe_decode_fp8.py`).

CPU: the config's checks, the shape and call reasons, and (where NVRTC loads) both kernels
compiled for sm_90a at V4.1's and small dims: no local memory, four register-A e4m3 wgmmas per
stage. GPU (Hopper): against the ref tier (skipped slots, several tokens per expert, real dims),
rows bitwise independent of the rest of the batch, CUDA-graph replay on new routing."""

from __future__ import annotations

import re

import pytest
import torch
from deepinfer_kernels.cuda import module
from deepinfer_kernels.cuda import moe_decode_fp8 as mf
from hypothesis import given, settings
from hypothesis import strategies as st
from sass_checks import unspilled_sass

HAVE_NVRTC = module.nvrtc_reason() is None
needs_nvrtc = pytest.mark.skipif(not HAVE_NVRTC, reason=f"{module.nvrtc_reason()}")
HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
needs_hopper = pytest.mark.skipif(
    not (HOPPER and HAVE_NVRTC), reason="needs a Hopper GPU and NVRTC"
)
C = mf.MoeDecodeFp8Config
V41 = (5120, 2304)  # D, I
CONFIGS = [mf.DEFAULT, C(split1=2, min_blocks=3), C(split1=4, split2=2)]


@settings(max_examples=30, deadline=None)
@given(
    field=st.sampled_from(["split1", "split2", "min_blocks", "stages"]), value=st.integers(-3, 20)
)
def test_config_rejects_bad_values_naming_the_field(field, value):
    allowed = {
        "split1": (1, 2, 4, 8),
        "split2": (1, 2, 4, 8),
        "min_blocks": (1, 2, 3),
        "stages": (0, *range(2, 17)),
    }
    if value in allowed[field]:
        assert getattr(C(**{field: value}), field) == value
    else:
        with pytest.raises(ValueError, match=f"MoeDecodeFp8Config.{field} must be"):
            C(**{field: value})


def test_shape_reasons():
    assert mf.shape_reason(*V41) is None
    assert mf.shape_reason(256, 128) is None
    assert "W1/W3: K=5000" in mf.shape_reason(5000, 2304)
    assert "multiple of 128 x split 4" in mf.shape_reason(5120, 2304, C(split2=4))  # 2304 / 4
    assert "2 stages" in mf.shape_reason(4 * 5120, 2304, C(min_blocks=3))  # an 80 KiB scale table


def _cpu_args(t=2, d=256, i=128, e=4, k=2):
    x = torch.zeros(t, d, dtype=torch.bfloat16)
    ids = torch.zeros(t, k, dtype=torch.int64)
    w = [torch.zeros(e, i, d // 2, dtype=torch.int8), torch.zeros(e, i, d // 32, dtype=torch.uint8)]
    w = [*w, *w, torch.zeros(e, d, i // 2, dtype=torch.int8)]
    w.append(torch.zeros(e, d, i // 32, dtype=torch.uint8))
    return x, ids, tuple(w)


def test_call_reasons_name_the_problem():
    x, ids, ws = _cpu_args()
    assert mf.call_reason(x, ids, ws) == "input on cpu" or "NVRTC" in str(
        mf.call_reason(x, ids, ws)
    )
    big, big_ids, _ = _cpu_args(t=9)
    assert "9 tokens: at most 8" in mf.call_reason(big, big_ids, ws)
    assert "not bfloat16" in mf.call_reason(x.float(), ids, ws)
    bad = (torch.zeros(4, 128, 112, dtype=torch.int8), *ws[1:])
    assert "w1 has shape" in mf.call_reason(x, ids, bad)
    strided = (ws[0], ws[1], ws[2], ws[3], ws[4].transpose(1, 2).contiguous().transpose(1, 2))
    assert "w2 must be a contiguous 1-byte tensor" in mf.call_reason(x, ids, (*strided, ws[5]))
    assert "topk_ids has 1 rows" in mf.call_reason(x, ids[:1], ws)
    with pytest.raises(ValueError, match=r"fp8 decode.*9 tokens"):
        mf.moe_experts(big, torch.zeros(9, 2), big_ids, *ws, 10.0)


@needs_nvrtc
@pytest.mark.parametrize(
    ("dims", "cfg"),
    [*((V41, c) for c in CONFIGS), ((256, 128), mf.DEFAULT), ((1024, 512), C(4, 2))],
)
@pytest.mark.parametrize("kind", [1, 2])
def test_kernels_compile_without_local_memory(kind, dims, cfg, tmp_path):
    """No spills; per stage four `wgmma.m64n8k32` e4m3 with the weights' A operand in
    registers (the expanded FP4) and the tokens from shared memory."""
    cub, log = module.compile_file_and_log(mf.SOURCE, mf.ARCH, mf.defines(kind, *dims, cfg))
    assert "serialized" not in log, log
    sass = unspilled_sass(cub, tmp_path)
    assert len(re.findall(r"QGMMA\.64x8x32\.F32\.E4M3\.E4M3 R\d+, R\d+, gdesc", sass)) == 4


# -- GPU ---------------------------------------------------------------------------------------


@needs_hopper
@pytest.mark.parametrize(
    ("t", "d", "i", "e", "k", "cfg"),
    [
        (1, 256, 128, 16, 4, mf.DEFAULT),
        (2, 512, 256, 8, 6, mf.DEFAULT),  # several tokens per expert
        (5, 512, 256, 32, 6, C(split1=2, min_blocks=3)),
        (8, 1024, 512, 4, 4, C(split1=4, split2=2)),  # every expert holds all 8 tokens
        (1, *V41, 384, 6, mf.DEFAULT),
        (7, *V41, 384, 6, C(split1=2, min_blocks=3)),
    ],
)
def test_close_to_ref(t, d, i, e, k, cfg):
    from deepinfer_kernels.ref import moe as ref_moe
    from gpu_checks import moe_inputs, poison, rel

    args = moe_inputs(t, d, i, e, k, seed=t + e + d, neg=t % 2 == 1)
    want = ref_moe.moe_experts(*args, 10.0)
    poison()
    got = mf.moe_experts(*args, 10.0, config=cfg)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    assert rel(got, want) < 1.5e-2


@needs_hopper
def test_rows_do_not_depend_on_the_batch():
    """A token's output is bitwise the same alone and among others: a wgmma column is one token
    (W1/W3) or one routed row (W2), and K is split by the config only."""
    from gpu_checks import moe_inputs

    x, tw, ids, *ws = moe_inputs(8, 512, 256, 16, 6, seed=3)
    full = mf.moe_experts(x, tw, ids, *ws, 10.0)
    for lo, hi in ((0, 1), (7, 8), (2, 5)):
        assert torch.equal(mf.moe_experts(x[lo:hi], tw[lo:hi], ids[lo:hi], *ws, 10.0), full[lo:hi])


@needs_hopper
def test_cuda_graph_replay():
    from gpu_checks import assert_graph_replays_new_routing

    assert_graph_replays_new_routing(mf.moe_experts, 4, 512, 256, 16, 6)
