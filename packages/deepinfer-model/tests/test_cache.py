"""CacheSpec sizes against the reference's KV budget (§5) and KVCache bookkeeping."""

import pytest
import torch
from deepinfer_model.cache import CacheSpec, KVCache
from deepinfer_model.config import ModelConfig


def test_bf16_cache_bytes_match_the_reference_budget():
    cfg = ModelConfig()
    spec = CacheSpec.from_config(cfg, block_size=64, dtype=torch.bfloat16)
    # bf16 caches: (512 + 128) * 2 B per entry, 2.5 entries per token -> 3,200 B/token (§5)
    assert spec.bytes_per_block == 64 * 3200
    ring = (128 + 8) * 512 * 2 * 43  # every layer and DSpark stage
    comp = 3 * (2 + 8) * 512 * 4 * 2  # ratio-2 sources: fp32 kv + gate logits
    eng = (3 + 8) * 8
    assert spec.bytes_per_slot == ring + comp + eng


def test_block_size_must_be_a_multiple_of_every_ratio():
    with pytest.raises(ValueError, match="block_size"):
        CacheSpec.from_config(ModelConfig.tiny(), block_size=15)


def test_pools_and_reset_slot():
    cfg = ModelConfig.tiny()
    spec = CacheSpec.from_config(cfg, block_size=16, dtype=torch.float32)
    cache = KVCache(cfg, spec, num_blocks=3, num_slots=2)
    assert cache.compressed_kv[2].shape == (3, 8, cfg.head_dim)
    assert cache.index_k[4].shape == (3, 16, cfg.index_head_dim)
    assert set(cache.comp_kv) == {2} and len(cache.swa) == cfg.num_layers_total
    for t in (*cache.swa, cache.comp_kv[2], cache.engram_history):
        t.fill_(1)
    cache.reset_slot(1)
    assert bool((cache.swa[0][1] == 0).all()) and bool((cache.swa[0][0] == 1).all())
    assert bool(torch.isinf(cache.comp_score[2][1]).all())
    with pytest.raises(ValueError, match="slot"):
        cache.reset_slot(2)
    with pytest.raises(ValueError, match="num_slots"):
        KVCache(cfg, spec, num_blocks=1, num_slots=0)
