"""The released V4.1-Flash parameter shapes and dtypes (reference §4, from the safetensors
headers), checked on layers of each kind built on the meta device (no memory)."""

import torch
from deepinfer_model.config import ModelConfig
from deepinfer_model.dspark import DSparkStage
from deepinfer_model.layers.block import Block

F8, E8, I8, F32 = torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.int8, torch.float32
BF16 = torch.bfloat16


def _params(mod):
    return {k: (tuple(v.shape), v.dtype) for k, v in mod.state_dict().items()}


def test_backbone_layers_match_the_checkpoint_table():
    cfg = ModelConfig()
    p2 = _params(Block(cfg, 2, BF16, "meta"))  # ratio-2 kv source + indexer owner
    expect = {
        "attn.wq_a.weight": ((1280, 5120), F8),
        "attn.wq_a.scale": ((40, 160), E8),
        "attn.q_norm.weight": ((1280,), BF16),
        "attn.wq_b.weight": ((32768, 1280), F8),
        "attn.wkv.weight": ((512, 5120), F8),
        "attn.kv_norm.weight": ((512,), BF16),
        "attn.wo_a.weight": ((8192, 4096), F8),
        "attn.wo_b.weight": ((5120, 8192), F8),
        "attn.attn_sink": ((64,), F32),
        "attn.compressor.wkv.weight": ((512, 5120), F32),  # BF16 on disk, fp32 math
        "attn.compressor.wgate.weight": ((512, 5120), F32),
        "attn.compressor.norm.weight": ((512,), BF16),
        "attn.indexer.wk.weight": ((128, 512), BF16),
        "attn.indexer.k_norm.weight": ((128,), BF16),
        "attn.indexer.wq_b.weight": ((4096, 1280), F8),
        "attn.indexer.weights_proj.weight": ((32, 5120), BF16),
        "ffn.gate.weight": ((384, 5120), BF16),
        "ffn.gate.bias": ((384,), F32),
        "ffn.gate.bias_vl": ((384,), F32),
        "ffn.experts.0.w1.weight": ((2304, 2560), I8),
        "ffn.experts.0.w1.scale": ((2304, 160), E8),
        "ffn.experts.383.w2.weight": ((5120, 1152), I8),
        "ffn.experts.383.w2.scale": ((5120, 72), E8),
        "ffn.shared_experts.w1.weight": ((2304, 5120), F8),
        "ffn.shared_experts.w2.weight": ((5120, 2304), F8),
        "hc_attn_fn": ((24, 20480), F32),
        "hc_attn_base": ((24,), F32),
        "hc_attn_scale": ((3,), F32),
        "attn_norm.weight": ((5120,), BF16),
    }
    for name, want in expect.items():
        assert p2[name] == want, (name, p2[name], want)
    p20 = _params(Block(cfg, 20, BF16, "meta"))
    assert p20["attn.compressor.wkv.weight"] == ((512, 5120), BF16)  # ratio 1: plain bf16
    assert "attn.compressor.wgate.weight" not in p20
    p24 = _params(Block(cfg, 24, BF16, "meta"))  # re-index: own queries, no keys, no compressor
    assert "attn.indexer.wq_b.weight" in p24 and "attn.indexer.wk.weight" not in p24
    assert not any(k.startswith("attn.compressor") for k in p24)
    p25 = _params(Block(cfg, 25, BF16, "meta"))  # reuse
    assert not any(k.startswith(("attn.compressor", "attn.indexer")) for k in p25)


def test_engram_layer_matches_the_checkpoint_table():
    cfg = ModelConfig()
    p1 = _params(Block(cfg, 1, BF16, "meta"))
    assert p1["engram.embed.weight"] == ((384006168, 256), F8)
    assert p1["engram.embed.scale"] == ((384006168, 8), E8)
    assert p1["engram.wkv.weight"] == ((25600, 6144), F8)
    assert p1["engram.q_weight"] == ((4, 5120), BF16)
    assert _params(Block(cfg, 14, BF16, "meta"))["engram.embed.weight"] == ((384016682, 256), F8)


def test_dspark_stages_match_the_checkpoint_table():
    cfg = ModelConfig()
    s0 = _params(DSparkStage(cfg, 0, BF16, "meta"))
    assert s0["main_proj.weight"] == ((5120, 15360), F8)
    assert s0["main_norm.weight"] == ((5120,), BF16)
    assert s0["ffn.gate.weight"] == ((128, 5120), BF16)
    assert "ffn.experts.127.w3.weight" in s0 and "ffn.experts.128.w3.weight" not in s0
    assert not any(k.startswith(("attn.compressor", "attn.indexer", "engram")) for k in s0)
    s2 = _params(DSparkStage(cfg, 2, BF16, "meta"))
    assert s2["markov_head.embed.weight"] == ((129280, 256), BF16)
    # BF16 on disk; held in fp32 as the reference does (the loader casts)
    assert s2["markov_head.head.weight"] == ((129280, 256), F32)
    assert s2["confidence_head.proj.weight"] == ((1, 5376), F32)
    assert s2["norm.weight"] == ((5120,), BF16)
    assert "main_proj.weight" not in s2
