"""Shared V4/V4.1 math against transformers' DeepseekV4 classes (dev dependency): YaRN
frequencies, the mHC coefficients and collapse, sink attention, sqrt-softplus routing."""

import types

import pytest
import torch

pytest.importorskip("transformers.models.deepseek_v4")

from deepinfer_kernels import ops
from deepinfer_model.config import ModelConfig
from deepinfer_model.layers.moe import Gate
from deepinfer_model.layers.rope import layer_inv_freq
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf
from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config


def _hf_config(**kw):
    rope = {
        "main": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.125},
        "compress": {
            "rope_type": "yarn",
            "rope_theta": 160000.0,
            "factor": 16.0,
            "original_max_position_embeddings": 65536,
            "beta_fast": 32,
            "beta_slow": 1,
            "attention_factor": 1.0,  # V4/V4.1 apply no YaRN mscale
            "partial_rotary_factor": 0.125,
        },
    }
    base = dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        head_dim=512,
        q_lora_rank=64,
        n_routed_experts=8,
        num_experts_per_tok=3,
        moe_intermediate_size=64,
        o_groups=2,
        o_lora_rank=32,
        index_n_heads=2,
        index_head_dim=32,
        vocab_size=128,
        rope_parameters=rope,
        max_position_embeddings=1048576,
        rms_norm_eps=1e-20,
    )
    base.update(kw)
    return DeepseekV4Config(**base)


def test_rope_frequencies_equal_transformers():
    rot = hf.DeepseekV4RotaryEmbedding(_hf_config())
    cfg = ModelConfig()
    assert torch.equal(rot.compress_inv_freq, layer_inv_freq(cfg, 2))
    assert torch.equal(rot.main_inv_freq, layer_inv_freq(cfg, 0))


def test_mhc_coefficients_and_collapse_equal_transformers():
    hcfg = _hf_config()
    hc = hf.DeepseekV4HyperConnection(hcfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        hc.fn.copy_(torch.randn(24, 256, generator=g) * 0.1)
        hc.base.copy_(torch.randn(24, generator=g))
        hc.scale.copy_(torch.rand(3, generator=g) + 0.5)
    h = torch.randn(2, 5, 4, 64, generator=g)
    post_ref, comb_ref, collapsed_ref = hc(h)
    flat = h.view(10, 4, 64)
    mixes = ops.hc_mixes(flat, hc.fn.detach(), 1e-20)
    pre, post, comb = ops.hc_split_sinkhorn(mixes, hc.scale.detach(), hc.base.detach(), 4, 20, 1e-6)
    torch.testing.assert_close(post, post_ref.reshape(10, 4), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(comb, comb_ref.reshape(10, 4, 4), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(
        ops.hc_pre(flat, pre), collapsed_ref.reshape(10, 64), rtol=1e-5, atol=1e-5
    )


def test_sink_attention_equals_transformers_eager():
    g = torch.Generator().manual_seed(1)
    h, s, d, window = 4, 9, 16, 4
    q = torch.randn(1, h, s, d, generator=g)
    kv = torch.randn(1, 1, s, d, generator=g)
    sinks = torch.randn(h, generator=g)
    # causal sliding window as an additive mask
    i, j = torch.arange(s).unsqueeze(1), torch.arange(s).unsqueeze(0)
    allowed = (j <= i) & (j > i - window)
    mask = torch.where(allowed, 0.0, float("-inf")).view(1, 1, s, s)
    module = types.SimpleNamespace(sinks=sinks, num_key_value_groups=h, training=False)
    ref, _ = hf.eager_attention_forward(module, q, kv, kv, mask, d**-0.5)
    idx = torch.where(allowed, j.expand(s, s), -1)
    got = ops.sparse_sink_attention(q[0].transpose(0, 1), kv[0, 0], idx, sinks, d**-0.5)
    torch.testing.assert_close(got, ref[0], rtol=1e-5, atol=1e-6)


def test_sqrtsoftplus_router_equals_transformers():
    hcfg = _hf_config(scoring_func="sqrtsoftplus", routed_scaling_factor=1.5)
    router = hf.DeepseekV4TopKRouter(hcfg)
    g = torch.Generator().manual_seed(2)
    w, bias = torch.randn(8, 64, generator=g), torch.randn(8, generator=g) * 0.1
    with torch.no_grad():
        router.weight.copy_(w)
        router.e_score_correction_bias.copy_(bias)
    x = torch.randn(6, 64, generator=g)
    _, w_ref, id_ref = router(x)
    gate = Gate(ModelConfig.tiny(), 8, 3, torch.float32)
    gate.weight.copy_(w)
    gate.bias.copy_(bias)
    w_got, id_got = gate(x)
    order_ref, order_got = id_ref.argsort(-1), id_got.argsort(-1)
    assert torch.equal(id_ref.gather(1, order_ref), id_got.gather(1, order_got))
    torch.testing.assert_close(
        w_got.gather(1, order_got), w_ref.gather(1, order_ref), rtol=1e-5, atol=1e-6
    )
