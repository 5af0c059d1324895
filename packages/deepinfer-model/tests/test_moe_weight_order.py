"""The MoE layer's expert byte order: fragment order (`quant.fp4_fragment_order`, what the
batch-invariant cuda kernels read fastest) gives the same bits as the checkpoint's order, and
the state dict, `load_state_dict` and the checkpoint loader keep speaking the checkpoint's order."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from deepinfer_kernels import REGISTRY, ops, quant
from deepinfer_model.config import ModelConfig
from deepinfer_model.layers.linear import FP4Weight, use_checkpoint_order_
from deepinfer_model.layers.moe import MoE
from deepinfer_model.loader import CheckpointError, CheckpointReader, load_checkpoint_into
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

DIM = INTER = 128  # fragment order needs multiples of 128
EXPERTS, TOPK = 4, 2


def _config() -> ModelConfig:
    return ModelConfig.tiny(hidden_size=DIM, moe_intermediate_size=INTER)


def _moe(fragment_order: bool | None) -> MoE:
    return MoE(_config(), EXPERTS, TOPK, torch.bfloat16, fragment_order=fragment_order)


def _checkpoint_state(seed: int) -> dict[str, torch.Tensor]:
    """A random state dict of one MoE layer in the checkpoint's formats and byte order."""
    g = torch.Generator().manual_seed(seed)
    state = {}
    for name, t in _moe(False).state_dict().items():
        if name.endswith("weight") and t.dtype == torch.int8:  # FP4 experts
            w, s = quant.quantize_fp4_experts(torch.randn(t.shape[0], t.shape[1] * 2, generator=g))
            state[name], state[name.replace("weight", "scale")] = w, s
        elif t.dtype == torch.float8_e4m3fn:  # shared expert
            w, s = quant.quantize_fp8_blocks(torch.randn(t.shape, generator=g) * 0.1)
            state[name], state[name.replace("weight", "scale")] = w, s
        elif not name.endswith("scale"):
            state[name] = (torch.randn(t.shape, generator=g) * 0.1).to(t.dtype)
    return state


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.uint8)


def _x(seed: int, tokens: int = 5) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 1000)
    return torch.randn(tokens, DIM, generator=g).to(torch.bfloat16)


@settings(max_examples=4, deadline=None)
@given(seed=st.integers(0, 2**16))
def test_fragment_order_gives_the_checkpoint_orders_bits(seed):
    state = _checkpoint_state(seed)
    plain, frag = _moe(False), _moe(True)
    plain.load_state_dict(state)
    frag.load_state_dict(state)
    x = _x(seed)
    assert torch.equal(_bits(frag(x)), _bits(plain(x)))
    # the layer holds fragment order; its state dict is still the checkpoint's
    w1 = state["experts.1.w1.weight"]
    assert torch.equal(frag.experts[1].w1.weight, quant.fp4_fragment_order(w1))
    assert torch.equal(frag.stacked()["w1.weight"][1], quant.fp4_fragment_order(w1))
    for name, t in frag.state_dict().items():
        assert torch.equal(_bits(t), _bits(state[name])), name


@pytest.mark.parametrize("assign", [False, True])
def test_load_state_dict_after_a_forward_takes_checkpoint_order(assign):
    frag, plain = _moe(True), _moe(False)
    frag.load_state_dict(_checkpoint_state(1))
    frag(_x(1))  # stacks built, bytes in fragment order
    state = _checkpoint_state(2)
    frag.load_state_dict({k: v.clone() for k, v in state.items()}, assign=assign)
    plain.load_state_dict(state)
    assert torch.equal(_bits(frag(_x(2))), _bits(plain(_x(2))))


def test_use_checkpoint_order_restores_the_bytes_and_the_layer_reorders_again():
    state = _checkpoint_state(3)
    frag = _moe(True)
    frag.load_state_dict(state)
    out = frag(_x(3))
    use_checkpoint_order_(frag)
    assert all(not m.fragment_order for m in frag.modules() if isinstance(m, FP4Weight))
    assert torch.equal(frag.experts[2].w2.weight, state["experts.2.w2.weight"])
    assert torch.equal(_bits(frag(_x(3))), _bits(out))
    assert frag.experts[2].w2.fragment_order


def test_the_loader_writes_checkpoint_order_into_a_reordered_layer(tmp_path: Path):
    state = _checkpoint_state(4)
    save_file(state, str(tmp_path / "model.safetensors"))
    frag, plain = _moe(True), _moe(False)
    frag.load_state_dict(_checkpoint_state(5))
    frag(_x(4))  # now in fragment order, with stacks
    load_checkpoint_into(frag, CheckpointReader(tmp_path), progress=False)
    plain.load_state_dict(state)
    assert torch.equal(_bits(frag(_x(4))), _bits(plain(_x(4))))


def test_following_the_kernels_keeps_checkpoint_order_on_cpu():
    moe = _moe(None)
    moe.load_state_dict(_checkpoint_state(6))
    with REGISTRY.batch_invariant_mode():
        assert not ops.moe_fragment_order_pays(DIM, INTER, "cpu")
        moe(_x(6))
    assert not moe.experts[0].w1.fragment_order


def test_fragment_order_needs_dims_multiple_of_128():
    with pytest.raises(ValueError, match="multiples of 128, got 64 and 64"):
        MoE(ModelConfig.tiny(), EXPERTS, TOPK, torch.bfloat16, fragment_order=True)


@pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
    reason="needs a Hopper GPU (the cuda tier's batch-invariant kernels)",
)
def test_following_the_kernels_on_hopper_switches_with_the_mode():
    state = _checkpoint_state(7)
    follow, plain = _moe(None).cuda(), _moe(False).cuda()
    follow.load_state_dict(state)
    plain.load_state_dict(state)
    x = _x(7, tokens=1).cuda()
    with REGISTRY.batch_invariant_mode():
        assert ops.moe_fragment_order_pays(DIM, INTER, x.device)
        assert torch.equal(_bits(follow(x)), _bits(plain(x)))
        assert follow.experts[0].w1.fragment_order
    with REGISTRY.batch_invariant_mode(False):
        assert torch.equal(_bits(follow(x)), _bits(plain(x)))
        assert not follow.experts[0].w1.fragment_order


@pytest.mark.parametrize("byte", [128, 129, 255])
def test_the_loader_refuses_fp4_scales_the_gpu_kernels_cannot_expand(tmp_path: Path, byte):
    state = _checkpoint_state(8)
    scale = state["experts.1.w2.scale"].view(torch.uint8).clone()
    scale[3, 2] = byte
    state["experts.1.w2.scale"] = scale.view(torch.float8_e8m0fnu)
    save_file(state, str(tmp_path / "model.safetensors"))
    layer = _moe(False)
    if byte <= 128:  # 2**1: the largest scale expanded exactly
        load_checkpoint_into(layer, CheckpointReader(tmp_path), progress=False)
        return
    with pytest.raises(CheckpointError, match=rf"'experts\.1\.w2\.scale'.*FP4 scale byte {byte}"):
        load_checkpoint_into(layer, CheckpointReader(tmp_path), progress=False)
