"""Every attention layer of the tiny model against a plain float64 re-implementation of the
V4.1 semantics (`_attention_oracle`), computed from the layer inputs the model actually saw.

Covers window-only layers, the ratio-2 and ratio-1 kv sources (compressor, RoPE at j*r, index
keys), reuse layers, the candidate source and the re-index layer, and the FP8 cast of the
context before the grouped `wo_a`.
"""

import torch
from _attention_oracle import capture, check_attention_layers
from deepinfer_model.batch import ForwardBatch
from deepinfer_model.cache import CacheSpec, KVCache
from deepinfer_model.config import ModelConfig
from deepinfer_model.model import Model, init_random_


def test_every_attention_layer_matches_float64_semantics():
    cfg = ModelConfig.tiny()
    model = init_random_(Model(cfg, fake_quant_kv=False), 4)
    model.engram_hasher.set_token_map([i % 300 for i in range(cfg.vocab_size)])
    t = 23
    toks = torch.randint(0, 500, (t,), generator=torch.Generator().manual_seed(7)).tolist()
    spec = CacheSpec.from_config(cfg, block_size=16, dtype=torch.float32)
    cap = capture(
        model,
        lambda: model(
            ForwardBatch.build([toks], [0], [0], [[0, 1]]),
            KVCache(cfg, spec, 4, 1, dtype=torch.float32),
        ),
    )
    chosen = check_attention_layers(cfg, model, cap, t)
    # the selections really select (visible > index_topk happens in this sequence)
    assert max(len(c) for c in chosen[2].values()) == cfg.index_topk
    assert any(len(c) < (tok + 1) // 2 for tok, c in chosen[2].items())
