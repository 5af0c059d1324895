"""The cuda tier's FP4 MoE experts (`cuda/moe.py`, run by `ops.moe.cuda_moe_experts`): the
mma.sync kernels (`moe_mma.cu`) and the wgmma kernels (`moe_wgmma.cu`).

CPU: the configs' checks, the plan's reasons, and (where NVRTC loads) the kernels compiled for
sm_90a at V4.1's and small dims: no local memory, and with triton's cuobjdump the mma.sync K loop's
instruction count per weight word. GPU (Hopper): against the ref tier (with skipped slots, experts
with more tokens than a tile, odd T, real dims), every output written, rows bitwise independent of
the rest of the batch, the wgmma rows bitwise those of the Triton tier's prefill tiles, CUDA-graph
replay on new routing, and the registry's choice."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
import torch
from deepinfer_kernels.cuda import module
from deepinfer_kernels.cuda import moe as md
from deepinfer_kernels.ops import moe as moe_ops
from deepinfer_kernels.ops.moe import cuda_moe_experts, triton_moe_experts
from hypothesis import given, settings
from hypothesis import strategies as st
from sass_checks import cubin_report, unspilled_sass

HAVE_NVRTC = module.nvrtc_reason() is None
needs_nvrtc = pytest.mark.skipif(not HAVE_NVRTC, reason=f"{module.nvrtc_reason()}")
HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
needs_hopper = pytest.mark.skipif(
    not (HOPPER and HAVE_NVRTC), reason="needs a Hopper GPU and NVRTC"
)

V41 = (5120, 2304)  # D, I


def cuda_reason(*args, batch_invariant=False, fragment_order=False):
    """Why the cuda tier would pass over this call on an H200 (None: it plans it; NVRTC missing
    on this machine aside)."""
    x, _, ids, w1, s1, w3, s3, w2, s2, _ = args
    scale_dtypes = (s1.dtype, s3.dtype, s2.dtype)
    aligned = md.aligned(w1, s1, w3, s3, w2, s2)
    _, passed = moe_ops.plan(
        x.shape[0], ids.shape[1], w1.shape[0], x.shape[1], w1.shape[1], x.dtype, scale_dtypes,
        aligned, batch_invariant, fragment_order, (9, 0), ("cuda",),
    )  # fmt: skip
    why = passed[0].removeprefix("cuda: ") if passed else None
    return None if why is not None and why.startswith("NVRTC not found") else why


# -- config and supports ---------------------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(
    field=st.sampled_from(
        ["rt1", "rt2", "split1", "split2", "min_blocks1", "min_blocks2", "tile_tokens", "depth"]
    ),
    value=st.integers(-3, 40),
)
def test_config_rejects_bad_values_naming_the_field(field, value):
    allowed = {
        "rt1": {2, 4},
        "rt2": {1, 2, 4},
        "tile_tokens": {8, 16},
        "depth": {1, 2},
    }.get(field, set(range(1, 9)))
    if value in allowed:
        assert getattr(md.MoeDecodeCudaConfig(**{field: value}), field) == value
    else:
        with pytest.raises(ValueError, match=f"MoeDecodeCudaConfig.{field} must be"):
            md.MoeDecodeCudaConfig(**{field: value})


@settings(max_examples=30, deadline=None)
@given(
    field=st.sampled_from(
        [
            "tile_tokens",
            "depth1",
            "depth2",
            "min_blocks1",
            "min_blocks2",
            "warpgroups1",
            "warpgroups2",
            "row_sets2",
            "x_stages",
        ]
    ),
    value=st.integers(-3, 200),
)
def test_wgmma_config_rejects_bad_values_naming_the_field(field, value):
    allowed = {
        "tile_tokens": {8, 16, 32, 64, 128, 160},
        "warpgroups1": {1, 2, 4},
        "warpgroups2": {1, 2, 4},
        "row_sets2": {1, 2},
        "x_stages": {0, 3, 4, 5, 6, 7, 8},
    }
    if value in allowed.get(field, set(range(1, 9))):
        assert getattr(md.MoeDecodeWgmmaConfig(**{field: value}), field) == value
    else:
        with pytest.raises(ValueError, match=f"MoeDecodeWgmmaConfig.{field} must be"):
            md.MoeDecodeWgmmaConfig(**{field: value})


def test_tma_config_fields():
    assert md.MoeDecodeCudaConfig(tma=True, depth=8).depth == 8
    with pytest.raises(ValueError, match=r"MoeDecodeCudaConfig\.depth must be 1\.\.8 \(tma\)"):
        md.MoeDecodeCudaConfig(depth=3)
    with pytest.raises(ValueError, match=r"MoeDecodeCudaConfig\.tma must be a bool"):
        md.MoeDecodeCudaConfig(tma=1)
    # 16 token rows of W1/W3's K = 5120 per warp and 8 stages do not fit one CTA
    assert "TMA w13 kernel needs" in md.shape_reason(*V41, replace(md.TMA, tile_tokens=16, depth=8))
    assert md.shape_reason(*V41, md.TMA) is None


def test_tensor_map_arguments_are_checked_before_the_driver():
    with pytest.raises(ValueError, match="must be multiples of 16"):
        module.tensor_map_2d(0x1000, 8, 40, 64, 32)
    with pytest.raises(ValueError, match="at most 256 x 256"):
        module.tensor_map_2d(0x1000, 8, 64, 64, 512)


def test_programmatic_launch_structs_match_the_driver_abi():
    """cuLaunchKernelEx's CUlaunchConfig and CUlaunchAttribute (cuda.h) as ctypes lays them out:
    7 unsigned ints, the stream at 32, the attribute array at 40, its count at 48; an attribute
    is an id, 4 bytes of padding and a 64-byte value."""
    import ctypes

    cfg, attr = module._LaunchConfig, module._LaunchAttribute
    assert ctypes.sizeof(attr) == 72 and attr.value.offset == 8
    assert (cfg.stream.offset, cfg.attrs.offset, cfg.num_attrs.offset) == (32, 40, 48)
    assert ctypes.sizeof(cfg) == 56


def test_fragment_weights_must_be_a_bool():
    assert md.MoeDecodeWgmmaConfig(fragment_weights=True).fragment_weights is True
    with pytest.raises(ValueError, match=r"MoeDecodeWgmmaConfig\.fragment_weights must be a bool"):
        md.MoeDecodeWgmmaConfig(fragment_weights=1)


FRAGMENT = md.WGMMA_FRAGMENT
# the twelfth session's prefill kernels: the activations copied by every thread (cp.async), not
# the TMA; weights a step ahead, tails two; no wgmma group in flight while the next expands
_COPY = dict(x_tma=False, w_tma=False, depth1=1, depth2=1, tail_depth=2, wgmma_groups=1)
COPY_PREFILL = replace(md.WGMMA_PREFILL, **_COPY)
COPY_PREFILL_FRAGMENT = replace(md.WGMMA_PREFILL_FRAGMENT, **_COPY)
# the fourteenth session's prefill kernels: the weights loaded by every thread 2 K steps ahead,
# one wgmma group in flight
_REGISTER_WEIGHTS = dict(w_tma=False, wgmma_groups=2)
REG_PREFILL = replace(md.WGMMA_PREFILL, **_REGISTER_WEIGHTS)
REG_PREFILL_EXCHANGE = replace(md.WGMMA_PREFILL_EXCHANGE, **_REGISTER_WEIGHTS)
REG_PREFILL_FRAGMENT = replace(md.WGMMA_PREFILL_FRAGMENT, **_REGISTER_WEIGHTS)
# every default wgmma config, and the register-weight and copied-ring prefill kernels
WGMMA_CONFIGS = [
    md.WGMMA_DEFAULT,
    FRAGMENT,
    md.WGMMA_PREFILL,
    md.WGMMA_PREFILL_FRAGMENT,
    md.WGMMA_PREFILL_EXCHANGE,
    md.wide_tiles(md.WGMMA_PREFILL),
    md.wide_tiles(md.WGMMA_PREFILL_FRAGMENT),
    md.wide_tiles(md.WGMMA_PREFILL_EXCHANGE),
    REG_PREFILL,
    REG_PREFILL_EXCHANGE,
    COPY_PREFILL,
    COPY_PREFILL_FRAGMENT,
]


def test_shape_reasons():
    assert md.shape_reason(*V41) is None
    assert "multiples of 32" in md.shape_reason(5120, 2300)
    assert "rt2=4" in md.shape_reason(96, 64)  # D = 96 is not a multiple of 64
    assert md.shape_reason(96, 64, md.MoeDecodeCudaConfig(rt2=2)) is None


def pick(bi, fo, tokens, aligned=True, per_expert=0.0, experts=384):
    """`ops.moe.cuda_config` for `tokens` tokens routed to `per_expert` pairs per expert (0: a
    decode-sized 6 pairs per token)."""
    pairs = round(per_expert * experts) if per_expert else 6 * tokens
    return moe_ops.cuda_config(bi, fo, tokens, pairs, experts, aligned)


def test_default_kernels_by_mode_and_size():
    tile8 = moe_ops.CUDA_TILE8_TOKENS
    assert pick(False, False, 1) == md.TMA
    assert pick(False, False, tile8) == md.TMA
    assert pick(False, False, tile8 + 1) == md.TMA_TILE16
    assert pick(False, False, 1, aligned=False) == md.REGISTER
    # the same sums: the splits decide the bits
    for cfg in (md.TMA, md.TMA_TILE16):
        assert (cfg.split1, cfg.split2) == (md.REGISTER.split1, md.REGISTER.split2)
    assert pick(True, False, 1) == md.WGMMA_DEFAULT
    assert pick(True, True, 1) == md.WGMMA_FRAGMENT
    assert pick(True, True, 8192, per_expert=100) == md.WGMMA_PREFILL_FRAGMENT
    assert pick(True, False, 8192, per_expert=100) == md.WGMMA_PREFILL_EXCHANGE
    # 160-token tiles where an expert's pairs (mean + 2 sd of uniform routing) take fewer tiles
    for per_expert, wide in ((32, False), (96, False), (128, True), (192, False), (256, True)):
        assert moe_ops.wide_tiles_pay(per_expert) == wide
        for inv, frag, cfg in (
            (False, False, md.WGMMA_PREFILL),
            (True, False, md.WGMMA_PREFILL_EXCHANGE),
            (True, True, md.WGMMA_PREFILL_FRAGMENT),
        ):
            got = pick(inv, frag, 8192, per_expert=per_expert)
            assert got == (md.wide_tiles(cfg) if wide else cfg)
    assert md.wide_tiles(md.WGMMA_PREFILL).tile_tokens == md.WIDE_TILE_TOKENS == 160
    assert pick(False, False, 8192, per_expert=100) == md.WGMMA_PREFILL

    def prefill(bi, pairs):  # the prefill kernels: 128- or 160-token wgmma tiles
        return moe_ops.cuda_config(bi, False, pairs // 6, pairs, 384).tile_tokens >= 128

    # batch-invariant mode switches above 8 pairs per expert; auto mode keeps the TMA decode
    # kernels up to 16
    assert prefill(True, 8 * 384 + 1) and not prefill(True, 8 * 384)
    assert not prefill(False, 16 * 384)
    assert prefill(False, 16 * 384 + 1)


def _cpu_call(t=4, d=64, i=64, e=8, k=2, dtype=torch.bfloat16):
    x = torch.zeros(t, d, dtype=dtype)
    ids = torch.zeros(t, k, dtype=torch.int64)
    w = torch.zeros(e, i, d // 2, dtype=torch.int8)
    s = torch.zeros(e, i, d // 32, dtype=torch.float8_e8m0fnu)
    w2 = torch.zeros(e, d, i // 2, dtype=torch.int8)
    s2 = torch.zeros(e, d, i // 32, dtype=torch.float8_e8m0fnu)
    return x, ids.float(), ids, w, s, w, s, w2, s2, 10.0


def test_supports_reasons():
    args = _cpu_call()
    # batch-invariant mode runs the wgmma kernels: dims must be multiples of 128
    assert "multiples of 128" in cuda_reason(*args, batch_invariant=True)
    assert cuda_reason(*_cpu_call(d=128, i=128), batch_invariant=True) is None
    assert "bfloat16" in cuda_reason(*_cpu_call(dtype=torch.float32))
    prefill = _cpu_call(t=200, d=256, i=128, e=8, k=2)  # 50 pairs per expert
    # batch-invariant mode: WGMMA_PREFILL_EXCHANGE; auto mode: WGMMA_PREFILL
    assert cuda_reason(*prefill, batch_invariant=True) is None
    assert cuda_reason(*prefill) is None
    few = _cpu_call(t=40, d=256, i=128, e=8, k=2)  # 10 pairs per expert: the TMA kernels
    assert cuda_reason(*few) is None
    assert cuda_reason(*few, batch_invariant=True) is None
    assert "multiples of 128" in cuda_reason(*_cpu_call(t=200, e=8, k=2))
    # prefill-sized routing on fragment-order weights: the wgmma prefill kernels (W2: 256 rows
    # per CTA)
    inv = dict(batch_invariant=True, fragment_order=True)
    assert cuda_reason(*prefill, **inv) is None
    narrow = _cpu_call(t=40, d=128, i=128, e=8, k=2)
    assert "D=128 must be a multiple of 256" in cuda_reason(*narrow, **inv)
    why = cuda_reason(*narrow, batch_invariant=True)
    assert "D=128 must be a multiple of 256" in why
    assert cuda_reason(*args) is None
    x, tw, ids, w1, s1, w3, s3, w2, s2, limit = args
    assert "s3 is torch.float32" in cuda_reason(x, tw, ids, w1, s1, w3, s3.float(), w2, s2, limit)
    assert "multiples of 32" in cuda_reason(*_cpu_call(d=48))


def test_unaligned_weights_take_the_register_kernels():
    x, tw, ids, w1, s1, w3, s3, w2, s2, limit = _cpu_call(t=2)
    odd = torch.zeros(w3.numel() + 1, dtype=torch.int8)[1:].view(w3.shape)
    assert not md.aligned(w1, odd) and md.aligned(w1, s1)
    why = md.call_reason(x, {"w1": w1, "w3": odd}, {"s1": s1}, md.TMA)
    assert why == "w3 is not 16-byte aligned (the TMA kernels copy it in bulk)"
    # by default the register kernels, which do not need it, take such weights
    assert cuda_reason(x, tw, ids, w1, s1, odd, s3, w2, s2, limit) is None


def test_direct_call_with_bad_arguments_is_a_value_error():
    """A direct call (not through the registry) refuses what it cannot run, before any launch."""
    with pytest.raises(ValueError, match="cuda moe_experts: input on cpu"):
        cuda_moe_experts(*_cpu_call())
    with pytest.raises(ValueError, match=r"x is torch\.float32"):
        cuda_moe_experts(*_cpu_call(dtype=torch.float32))
    with pytest.raises(ValueError, match=r"the mma\.sync kernels .* read the checkpoint's order"):
        cuda_moe_experts(*_cpu_call(), fragment_order=True)
    with pytest.raises(ValueError, match=r"config\.fragment_weights=False but fragment_order=True"):
        cuda_moe_experts(
            *_cpu_call(), batch_invariant=True, config=md.WGMMA_DEFAULT, fragment_order=True
        )
    with pytest.raises(ValueError, match="config must be a MoeDecodeWgmmaConfig"):
        cuda_moe_experts(*_cpu_call(), batch_invariant=True, config=md.REGISTER)


def test_fragment_order_reasons():
    """Fragment-order weights: only batch-invariant mode's wgmma kernels read them here (the
    registry then falls through to the Triton tier)."""
    args = _cpu_call(d=128, i=128)
    assert "mma.sync" in cuda_reason(*args, fragment_order=True)
    inv = dict(batch_invariant=True, fragment_order=True)
    assert cuda_reason(*args, **inv) is None


def test_missing_nvrtc_is_a_reason_not_a_crash(monkeypatch):
    """Without an NVRTC for torch's CUDA version the tier reports why (once searched) and a
    compile raises OSError naming the places tried."""
    monkeypatch.setattr(torch.version, "cuda", "99.0")
    module._find_nvrtc.cache_clear()
    try:
        why = module.nvrtc_reason()
        assert why is not None and "libnvrtc.so.99" in why
        with pytest.raises(OSError, match="NVRTC not found"):
            module.compile_cubin("", "empty.cu", "sm_90a", {})
    finally:
        module._find_nvrtc.cache_clear()


# -- compiled kernels (CPU) --------------------------------------------------------------------


def test_k_permutation_gives_each_lane_its_own_group():
    """Within each 128-value step the permuted order is a permutation, and the 4 values of lane t
    in every k16 step (slots 2t, 2t+1, 2t+8, 2t+9) come from its own 32-value group t, 4
    consecutive values per step in natural order."""
    perm = md.k_permutation(384)
    assert sorted(perm.tolist()) == list(range(384))
    assert torch.equal(perm[128:256] - 128, perm[:128])
    for t in range(4):
        mine = [
            perm[16 * s + j].item()
            for s in range(8)
            for j in (2 * t, 2 * t + 1, 2 * t + 8, 2 * t + 9)
        ]
        assert mine == list(range(32 * t, 32 * t + 32))
    # where W1/W3 (`h_column` in moe_decode_wgmma.cu) put value v of a step for W2 to read it
    for v in range(128):
        slot = 16 * ((v >> 2) & 7) + 8 * ((v >> 1) & 1) + 2 * (v >> 5) + (v & 1)
        assert perm[slot] == v


def test_x_tma_needs_a_ring_of_32_token_boxes():
    with pytest.raises(ValueError, match="x_tma must be a bool, and False without x_stages"):
        md.MoeDecodeWgmmaConfig(x_tma=True)  # decode tiles: all of K, no ring
    with pytest.raises(ValueError, match="x_tma must be"):
        md.MoeDecodeWgmmaConfig(x_tma=True, x_stages=4, tile_tokens=16)
    with pytest.raises(ValueError, match="x_tma must be"):
        md.MoeDecodeWgmmaConfig(x_tma=1, x_stages=4, tile_tokens=32)
    # the swizzled stages start on 1024 bytes: 1 KiB more than the copied ring
    assert md._wgmma_shared_bytes("w13", 5120, REG_PREFILL) == (
        md._wgmma_shared_bytes("w13", 5120, COPY_PREFILL) + 1024
    )


def test_wgmma_groups_in_flight_are_1_to_3():
    assert replace(md.WGMMA_PREFILL, wgmma_groups=3).wgmma_groups == 3
    for bad in (0, 4):
        with pytest.raises(ValueError, match="wgmma_groups must be 1, 2 or 3"):
            replace(md.WGMMA_PREFILL, wgmma_groups=bad)
    # every int knob refuses floats and bools (they would reach the compile-time constants)
    for field, bad in (("wgmma_groups", 2.0), ("depth1", True), ("tile_tokens", 128.0)):
        with pytest.raises(ValueError, match=f"{field} must be an int"):
            replace(md.WGMMA_PREFILL, **{field: bad})
    with pytest.raises(ValueError, match=r"MoeDecodeCudaConfig\.depth must be an int"):
        md.MoeDecodeCudaConfig(depth=2.0)


def test_w_tma_takes_the_weights_through_the_activation_ring():
    with pytest.raises(ValueError, match="w_tma must be a bool, and False without x_tma"):
        replace(COPY_PREFILL, w_tma=True)
    with pytest.raises(ValueError, match="w_tma must be"):
        replace(md.WGMMA_PREFILL, w_tma=1)
    # per stage 64 bytes of each weight row of the CTA: W1/W3 128 rows of each, W2 256 rows
    for kind, k in (("w13", 5120), ("w2", 2304)):
        grown = md._wgmma_shared_bytes(kind, k, md.WGMMA_PREFILL) - md._wgmma_shared_bytes(
            kind, k, REG_PREFILL
        )
        assert grown == 4 * 256 * 64
    # 160-token tiles in 4 stages do not fit with the weights, in 3 they do
    wide = md.wide_tiles(md.WGMMA_PREFILL_EXCHANGE)
    assert (wide.x_stages, wide.w_tma, wide.wgmma_groups) == (3, True, 2)
    assert "over" in md.shape_reason(*V41, replace(wide, x_stages=4))
    assert md.shape_reason(*V41, wide) is None


def test_permuted_k_is_for_auto_mode_on_the_checkpoint_order():
    with pytest.raises(ValueError, match="permuted_k must be a bool, and False with fragment"):
        md.MoeDecodeWgmmaConfig(permuted_k=True, fragment_weights=True)
    why = md.order_reason(True, md.WGMMA_PREFILL, False)
    assert "permuted_k sums K in another order" in why


@needs_nvrtc
@pytest.mark.parametrize("cfg", WGMMA_CONFIGS)
@pytest.mark.parametrize("kind", ["w13", "w2"])
def test_wgmma_kernels_compile_without_local_memory(kind, cfg, tmp_path):
    """The wgmma kernels compile for sm_90a (NVRTC on CPU) at V4.1's dims; with cuobjdump: no
    spills, and the mma is wgmma (HGMMA) with A from registers, one per variant of N (from
    64-token tiles: the tokens rounded up to 32). On fragment-order weights no 16-byte
    shared-memory store is left (the byte exchange's; the amax and W3-sum exchanges and the
    tile's row table store words), nor with K permuted."""
    sass = cubin_report("-sass", md.cubin(kind, *V41, cfg), tmp_path)
    # the copied ring's W1/W3 on the checkpoint's order spills one register: a store and a load
    # per two K steps
    spills = 2 if (cfg, kind) == (COPY_PREFILL, "w13") else 0
    # the byte exchange with the weights in registers spills 16 bytes in both kernels
    spills = 8 if cfg == REG_PREFILL_EXCHANGE else spills
    assert len(re.findall(r"\b(LDL|STL)\b", sass)) <= spills, "the kernel spills to local memory"
    gmma = set(re.findall(r"HGMMA\.64x(\d+)x16\.F32\.BF16 R\d+, R\d+, gdesc", sass))
    n = cfg.tile_tokens
    assert gmma == ({str(v) for v in range(32, n + 1, 32)} if n >= 64 else {str(n)})
    # ptxas keeps wgmma_groups - 1 groups in flight while the next one's weights expand (PTX's
    # `wait_group 1` compiles to a wait for every group: the next group reuses the registers)
    waits = set(re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, (0x\d)", sass))
    assert waits == {"0x0", f"0x{cfg.wgmma_groups - 1}"}
    assert "HMMA" not in sass.replace("HGMMA", "")
    stores = re.findall(r"\bSTS(\.\w+)*", sass)
    if cfg.fragment_weights or cfg.permuted_k:
        assert not any(".128" in s for s in stores)
    else:
        assert any(".128" in s for s in stores)  # the scratch's 16-byte stores


@needs_nvrtc
@pytest.mark.parametrize("cfg", WGMMA_CONFIGS)
@pytest.mark.parametrize("kind", ["w13", "w2"])
def test_wgmma_kernels_keep_their_wgmmas_in_flight(kind, cfg):
    """ptxas does not serialize the wgmmas (its C751x remarks in NVRTC's log, such as C7515: an
    instruction other than a wgmma defines an accumulator inside the pipeline; C7511: too few
    registers), decode configs and prefill configs with their tail variants alike."""
    _, log = module.compile_file_and_log(md.WGMMA_SOURCE, md.ARCH, md.defines(kind, *V41, cfg))
    assert "instructions are serialized" not in log, log


@needs_nvrtc
@pytest.mark.parametrize("cfg", WGMMA_CONFIGS)
def test_wgmma_kernels_compile_at_the_smallest_dims_they_take(cfg):
    """Every small (D, I) that shape_reason lets through compiles, down to one K step: with W1
    and W3 on separate warpgroups the dynamic shared memory then holds W3's sums, not the
    activations."""
    dims = [(d, i) for d in (128, 256) for i in (128, 256) if md.shape_reason(d, i, cfg) is None]
    assert dims
    for d, i in dims:
        for kind in ("w13", "w2"):
            assert len(md.cubin(kind, d, i, cfg)) > 1000


@needs_nvrtc
@pytest.mark.parametrize(
    "cfg",
    [
        md.WGMMA_DEFAULT,
        md.MoeDecodeWgmmaConfig(tile_tokens=16, warpgroups1=1, warpgroups2=2),
        FRAGMENT,
        md.WGMMA_PREFILL_FRAGMENT,
        md.WGMMA_PREFILL,
        COPY_PREFILL,
        md.MoeDecodeWgmmaConfig(
            tile_tokens=64,
            min_blocks1=1,
            depth1=2,
            depth2=2,
            warpgroups2=2,
            row_sets2=2,
            x_stages=3,
        ),
    ],
)
def test_wgmma_shared_memory_model_matches_the_cubins(cfg, tmp_path):
    """shape_reason's shared-memory check counts what the compiled kernels declare."""
    for kind in ("w13", "w2"):
        usage = cubin_report("-res-usage", md.cubin(kind, *V41, cfg), tmp_path)
        declared = int(re.search(r"SHARED:(\d+)", usage).group(1))
        assert declared == md._wgmma_static_bytes(kind, cfg)


@needs_nvrtc
@pytest.mark.parametrize("dims", [V41, (256, 128)])
@pytest.mark.parametrize("kind", ["w13", "w2"])
def test_kernels_compile_without_local_memory(kind, dims, tmp_path):
    """Both kernels compile for sm_90a (NVRTC on CPU); with cuobjdump: no spills (no local loads
    or stores) and the K loop within 24 instructions per weight word and mma (the FP4 expansion
    is 19: 3 to split a word, then per bf16 pair PRMT, IMAD, LOP3, HMUL2)."""
    cub = md.cubin(kind, *dims, md.REGISTER)
    assert len(cub) > 1000
    sass = unspilled_sass(cub, tmp_path)
    lines = re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)
    loops = [
        (int(a, 16), int(m.group(1), 16))
        for a, ins in lines
        if (m := re.search(r"BRA (0x[0-9a-f]+)", ins)) and int(m.group(1), 16) < int(a, 16)
    ]
    if dims != V41:
        return  # small K: the compiler may unroll the whole K loop
    end, start = max(loops, key=lambda p: p[0] - p[1])  # the K loop: the longest backward jump
    body = [ins for a, ins in lines if start <= int(a, 16) <= end]
    mmas = sum("HMMA" in ins for ins in body)
    assert mmas > 0
    assert len(body) / mmas <= 24.0, f"{len(body)} instructions for {mmas} mma in the K loop"


# -- GPU ---------------------------------------------------------------------------------------


def _inputs(*args, **kw):
    from gpu_checks import moe_inputs

    return moe_inputs(*args, **kw)


@needs_hopper
@pytest.mark.parametrize(
    ("t", "d", "i", "e", "k", "cfg"),
    [
        (1, 256, 128, 16, 4, md.REGISTER),
        (5, 512, 256, 32, 6, md.REGISTER),
        (37, 256, 96, 32, 6, md.REGISTER),  # experts with more rows than a tile; odd T, odd I/32
        (37, 256, 96, 32, 6, md.MoeDecodeCudaConfig(tile_tokens=16, split1=3, rt2=2)),
        (16, 512, 256, 8, 4, md.MoeDecodeCudaConfig(rt1=4, split1=1, split2=5, rt2=1)),
        (9, 512, 256, 16, 6, md.MoeDecodeCudaConfig(depth=2, min_blocks1=2, split2=3)),
        (1, *V41, 384, 6, md.REGISTER),
        (16, *V41, 384, 6, md.REGISTER),
        (1, 256, 128, 16, 4, md.WGMMA_DEFAULT),
        (37, 256, 128, 32, 6, md.MoeDecodeWgmmaConfig(tile_tokens=16, depth1=2, depth2=7)),
        (16, *V41, 384, 6, md.WGMMA_DEFAULT),
    ],
)
def test_close_to_ref(t, d, i, e, k, cfg):
    from deepinfer_kernels.ref import moe as ref_moe
    from gpu_checks import poison, rel

    args = _inputs(t, d, i, e, k, seed=t + e + d, neg=t % 2 == 1)
    want = ref_moe.moe_experts(*args, 10.0)
    poison()
    got = cuda_moe_experts(*args, 10.0, config=cfg)
    assert got.dtype == torch.bfloat16
    assert rel(got, want) < 1.5e-2


@needs_hopper
def test_rows_do_not_depend_on_the_batch():
    """A token's output is bitwise the same alone and in any batch: each mma column is one token,
    K is split by shape only, and the combine sums a token's rows in expert order (whether the
    TMA, the 16-token-tile or the register kernels run it)."""
    x, tw, ids, *ws = _inputs(300, 512, 256, 64, 6, seed=7)
    full = cuda_moe_experts(x, tw, ids, *ws, 10.0)  # 16-token tiles
    # the decode kernels' choice at 300 tokens (decode-sized routing): 16-token tiles
    assert moe_ops.cuda_config(False, False, 300, ids.numel(), 384) == md.TMA_TILE16
    for lo, hi in ((0, 1), (299, 300), (5, 21), (9, 13)):
        assert torch.equal(
            cuda_moe_experts(x[lo:hi], tw[lo:hi], ids[lo:hi], *ws, 10.0), full[lo:hi]
        )
    part = cuda_moe_experts(x[:48], tw[:48], ids[:48], *ws, 10.0, config=md.REGISTER)
    assert torch.equal(part, full[:48])


@needs_hopper
@pytest.mark.parametrize(("t", "d", "i", "e", "k"), [(37, 512, 256, 32, 6), (16, *V41, 384, 6)])
def test_wgmma_rows_are_the_triton_prefill_tiles_bits(t, d, i, e, k):
    """Batch-invariant mode: every routed row bitwise equals the Triton tier's prefill tiles (and
    its decode wgmma tiles), whatever the tile size or load depth, alone or in a batch."""
    from deepinfer_kernels.triton import moe as tmoe

    x, tw, ids, *ws = _inputs(t, d, i, e, k, seed=3 + t)
    got = cuda_moe_experts(x, tw, ids, *ws, 10.0, batch_invariant=True)
    prefill = triton_moe_experts(x, tw, ids, *ws, 10.0, config=tmoe.PREFILL)
    assert torch.equal(got, prefill)
    assert torch.equal(got, triton_moe_experts(x, tw, ids, *ws, 10.0, batch_invariant=True))
    other = md.MoeDecodeWgmmaConfig(
        tile_tokens=16, depth1=1, depth2=8, min_blocks1=2, warpgroups1=2, warpgroups2=2
    )
    assert torch.equal(
        cuda_moe_experts(x, tw, ids, *ws, 10.0, batch_invariant=True, config=other), got
    )
    for lo, hi in ((0, 1), (t - 1, t), (3, 11)):
        alone = cuda_moe_experts(x[lo:hi], tw[lo:hi], ids[lo:hi], *ws, 10.0, batch_invariant=True)
        assert torch.equal(alone, got[lo:hi])


@needs_hopper
@pytest.mark.parametrize(("t", "d", "i", "e", "k"), [(300, 512, 256, 16, 6), (1000, *V41, 384, 6)])
def test_wgmma_prefill_tiles_give_the_triton_prefill_bits(t, d, i, e, k):
    """Prefill tiles (up to 128 tokens; tail tiles on narrower wgmmas) streamed through a ring
    of K steps (copied by every thread, or by the TMA from the routed rows in tile order), on 1,
    2 or 4 warpgroups (W1/W3 split over warpgroup pairs), W2 with 1 or 2 row sets, either byte
    order: every routed row bitwise the Triton tier's prefill tiles."""
    from deepinfer_kernels.quant import fp4_fragment_order as f
    from deepinfer_kernels.triton import moe as tmoe

    x, tw, ids, w1, s1, w3, s3, w2, s2 = _inputs(t, d, i, e, k, seed=9 + t)
    want = triton_moe_experts(x, tw, ids, w1, s1, w3, s3, w2, s2, 10.0, config=tmoe.PREFILL)
    frag = (f(w1), s1, f(w3), s3, f(w2), s2)
    assert torch.equal(
        cuda_moe_experts(x, tw, ids, *frag, 10.0, batch_invariant=True, fragment_order=True), want
    )
    ws = (w1, s1, w3, s3, w2, s2)
    assert torch.equal(cuda_moe_experts(x, tw, ids, *ws, 10.0, batch_invariant=True), want)
    ring = dict(min_blocks1=1, min_blocks2=1, depth1=1, depth2=1)
    for cfg in (
        md.MoeDecodeWgmmaConfig(tile_tokens=128, warpgroups1=2, warpgroups2=2, row_sets2=2,
                                x_stages=4, **ring),
        md.MoeDecodeWgmmaConfig(tile_tokens=64, warpgroups1=4, warpgroups2=1, row_sets2=2,
                                x_stages=3, **ring),
        md.MoeDecodeWgmmaConfig(tile_tokens=32, warpgroups1=1, warpgroups2=4, x_stages=5, **ring),
        md.WGMMA_PREFILL_EXCHANGE,
        replace(md.WGMMA_PREFILL_EXCHANGE, wgmma_groups=1),
        md.wide_tiles(md.WGMMA_PREFILL_EXCHANGE),
        REG_PREFILL_EXCHANGE,
        md.MoeDecodeWgmmaConfig(tile_tokens=64, warpgroups1=4, warpgroups2=2, row_sets2=2,
                                x_stages=3, x_tma=True, **ring),
        md.MoeDecodeWgmmaConfig(tile_tokens=32, warpgroups1=1, warpgroups2=1, x_stages=5,
                                x_tma=True, **ring),
    ):  # fmt: skip
        assert torch.equal(
            cuda_moe_experts(x, tw, ids, w1, s1, w3, s3, w2, s2, 10.0, config=cfg), want
        )
    for cfg in (
        md.WGMMA_PREFILL_FRAGMENT,
        COPY_PREFILL_FRAGMENT,
        md.wide_tiles(md.WGMMA_PREFILL_FRAGMENT),
        REG_PREFILL_FRAGMENT,
    ):
        got = cuda_moe_experts(x, tw, ids, *frag, 10.0, config=cfg, fragment_order=True)
        assert torch.equal(got, want)


@needs_hopper
@pytest.mark.parametrize(("t", "d", "i", "e", "k"), [(300, 512, 256, 16, 6), (1200, *V41, 384, 6)])
def test_permuted_k_prefill_is_close_to_ref_and_batch_independent(t, d, i, e, k):
    """Auto mode's prefill kernels (K permuted, checkpoint order): close to the reference, and a
    token's rows bitwise the same in any prefill-sized batch (the sum order depends on K only)."""
    from deepinfer_kernels.ref import moe as ref_moe
    from gpu_checks import rel

    x, tw, ids, *ws = _inputs(t, d, i, e, k, seed=13 + t, neg=True)
    got = cuda_moe_experts(x, tw, ids, *ws, 10.0)
    cfg = moe_ops.cuda_config(False, False, t, ids.numel(), e)
    assert cfg in (md.WGMMA_PREFILL, md.wide_tiles(md.WGMMA_PREFILL))
    assert rel(got, ref_moe.moe_experts(x, tw, ids, *ws, 10.0)) < 1.5e-2
    for lo, hi in ((0, t // 2), (t // 3, t)):
        part = cuda_moe_experts(x[lo:hi], tw[lo:hi], ids[lo:hi], *ws, 10.0, config=md.WGMMA_PREFILL)
        assert torch.equal(part, got[lo:hi])
    # the activations copied by every thread instead of the TMA, 160-token tiles, the weights
    # by registers, one group in flight: the same sums
    for cfg in (
        COPY_PREFILL,
        md.wide_tiles(md.WGMMA_PREFILL),
        REG_PREFILL,
        replace(md.WGMMA_PREFILL, wgmma_groups=1),
    ):
        assert torch.equal(cuda_moe_experts(x, tw, ids, *ws, 10.0, config=cfg), got)


@needs_hopper
@pytest.mark.parametrize(
    ("t", "d", "i", "e", "k"), [(37, 512, 256, 32, 6), (16, *V41, 384, 6), (3, 128, 128, 4, 2)]
)
def test_fragment_order_weights_give_the_same_bits(t, d, i, e, k):
    """Every kernel that reads `fp4_fragment_order` weights sums the same products in the same
    order as on the checkpoint's order: bitwise the same rows (the wgmma kernels for two
    schedules, Triton's prefill and decode tiles)."""
    from deepinfer_kernels.quant import fp4_fragment_order as f
    from deepinfer_kernels.triton import moe as tmoe

    x, tw, ids, w1, s1, w3, s3, w2, s2 = _inputs(t, d, i, e, k, seed=5 + t)
    ws = (w1, s1, w3, s3, w2, s2)
    frag = (f(w1), s1, f(w3), s3, f(w2), s2)
    want = cuda_moe_experts(x, tw, ids, *ws, 10.0, batch_invariant=True)
    inv = dict(batch_invariant=True, fragment_order=True)
    for cfg in (FRAGMENT, replace(md.WGMMA_DEFAULT, fragment_weights=True, tile_tokens=16)):
        assert torch.equal(cuda_moe_experts(x, tw, ids, *frag, 10.0, config=cfg, **inv), want)
    for cfg in (tmoe.PREFILL, tmoe.DECODE_WGMMA, tmoe.DECODE):
        on_frag = replace(cfg, fragment_weights=True)
        got = triton_moe_experts(x, tw, ids, *frag, 10.0, config=on_frag, fragment_order=True)
        assert torch.equal(got, triton_moe_experts(x, tw, ids, *ws, 10.0, config=cfg))
    # the invariant chain across tiers: Triton's prefill tiles on fragment order, the wgmma rows
    prefill = triton_moe_experts(x, tw, ids, *frag, 10.0, config=tmoe.PREFILL_FRAGMENT, **inv)
    assert torch.equal(prefill, want)


@needs_hopper
@pytest.mark.parametrize("fragment_order", [False, True])
def test_ops_rows_do_not_change_across_the_decode_prefill_switch(fragment_order):
    """Batch-invariant mode through the registry: the whole batch is prefill-sized (this tier's
    prefill kernels), its slices decode-sized (this tier's wgmma decode kernels); every row is
    bitwise the same, and the same on fragment-order weights as on the checkpoint's order."""
    from deepinfer_kernels import REGISTRY, ops
    from deepinfer_kernels.quant import fp4_fragment_order as f

    x, tw, ids, w1, s1, w3, s3, w2, s2 = _inputs(200, 512, 256, 16, 6, seed=21)
    ws = (f(w1), s1, f(w3), s3, f(w2), s2) if fragment_order else (w1, s1, w3, s3, w2, s2)
    order = dict(fragment_order=fragment_order)
    with REGISTRY.batch_invariant_mode():
        inv = dict(batch_invariant=True, **order)
        assert REGISTRY.resolve("moe_experts", x, tw, ids, *ws, 10.0, **inv).tier == "cuda"
        full = ops.moe_experts(x, tw, ids, *ws, 10.0, **order)
        checkpoint = ops.moe_experts(x, tw, ids, w1, s1, w3, s3, w2, s2, 10.0)
        assert torch.equal(full, checkpoint)
        for lo, hi in ((0, 1), (57, 58), (199, 200), (3, 24)):
            part = (x[lo:hi], tw[lo:hi], ids[lo:hi], *ws, 10.0)
            assert REGISTRY.resolve("moe_experts", *part, **inv).tier == "cuda"
            assert torch.equal(ops.moe_experts(*part, **order), full[lo:hi])


@needs_hopper
def test_fragment_order_pays_in_invariant_mode_here():
    from deepinfer_kernels import REGISTRY, ops

    with REGISTRY.batch_invariant_mode():
        assert ops.moe_fragment_order_pays(*V41, "cuda")
        assert not ops.moe_fragment_order_pays(5120, 2304 + 32, "cuda")  # I not a multiple of 128
    with REGISTRY.batch_invariant_mode(False):
        assert not ops.moe_fragment_order_pays(*V41, "cuda")


@needs_hopper
@pytest.mark.parametrize(
    ("t", "d", "i", "e", "k", "cfg"),
    [
        (1, *V41, 384, 6, md.TMA),
        (4, *V41, 384, 6, md.TMA),
        (2, *V41, 384, 6, replace(md.TMA, depth=5)),
        (1, 256, 128, 16, 4, md.TMA),
        (3, 512, 256, 8, 6, replace(md.TMA, depth=1)),
        (37, 256, 96, 32, 6, replace(md.TMA, tile_tokens=16, split1=3, rt2=2, depth=3)),
        (16, 512, 256, 8, 4, replace(md.TMA, rt1=4, split1=1, split2=5, rt2=1)),
        (9, 512, 256, 16, 6, replace(md.TMA, split2=3, depth=8)),
    ],
)
def test_tma_kernels_give_the_register_kernels_bits(t, d, i, e, k, cfg):
    """The TMA-fed K loop sums the same products in the same order as the register loop with
    the same splits (partial steps, uneven K shares, boxes past a row's end, 16-token tiles,
    1 to 8 stages)."""
    args = _inputs(t, d, i, e, k, seed=40 + t, neg=t % 2 == 1)
    register = replace(cfg, tma=False, depth=1)
    want = cuda_moe_experts(*args, 10.0, config=register)
    assert torch.equal(cuda_moe_experts(*args, 10.0, config=cfg), want)


@needs_hopper
def test_cuda_graph_replay_on_new_routing():
    from gpu_checks import assert_graph_replays_new_routing

    assert_graph_replays_new_routing(cuda_moe_experts, 8, 512, 256, 32, 6)
    assert_graph_replays_new_routing(cuda_moe_experts, 4, 512, 256, 32, 6)


@needs_hopper
def test_registry_routes_decode_sizes_here():
    """Decode-sized bf16 calls run this tier in both modes (batch-invariant: the wgmma kernels,
    bitwise the Triton tier's invariant rows); prefill-sized ones run this tier's wgmma prefill
    kernels in both modes."""
    from deepinfer_kernels import REGISTRY, ops

    x, tw, ids, *ws = _inputs(4, 256, 128, 8, 2, seed=31)
    assert REGISTRY.resolve("moe_experts", x, tw, ids, *ws, 10.0).tier == "cuda"
    assert torch.equal(
        ops.moe_experts(x, tw, ids, *ws, 10.0), cuda_moe_experts(x, tw, ids, *ws, 10.0)
    )
    inv = REGISTRY.resolve("moe_experts", x, tw, ids, *ws, 10.0, batch_invariant=True)
    assert inv.tier == "cuda"
    with REGISTRY.batch_invariant_mode():
        got = ops.moe_experts(x, tw, ids, *ws, 10.0)
    assert torch.equal(got, triton_moe_experts(x, tw, ids, *ws, 10.0, batch_invariant=True))
    xp, twp, idsp, *_ = _inputs(200, 256, 128, 8, 2, seed=32)
    assert REGISTRY.resolve("moe_experts", xp, twp, idsp, *ws, 10.0).tier == "cuda"
    inv = REGISTRY.resolve("moe_experts", xp, twp, idsp, *ws, 10.0, batch_invariant=True)
    assert inv.tier == "cuda"
