"""DEEPINFER_BATCH_INVARIANT=1: logits are bitwise independent of batching, chunking and the
prefill/decode split, with the reference's KV fake-quantisation on."""

import pytest
import torch
from deepinfer_kernels import REGISTRY
from deepinfer_model.batch import ForwardBatch
from deepinfer_model.cache import CacheSpec, KVCache
from deepinfer_model.config import ModelConfig
from deepinfer_model.model import Model, init_random_


@pytest.fixture
def batch_invariant():
    with REGISTRY.batch_invariant_mode():
        yield


def test_bitwise_prefill_decode_chunks_and_batches(batch_invariant):
    cfg = ModelConfig.tiny()
    model = init_random_(Model(cfg, fake_quant_kv=True), 0)
    model.engram_hasher.set_token_map([i % 300 for i in range(cfg.vocab_size)])
    spec = CacheSpec.from_config(cfg, block_size=16, dtype=torch.float32)

    def cache():
        return KVCache(cfg, spec, num_blocks=16, num_slots=3, dtype=torch.float32)

    a = torch.randint(0, 500, (25,), generator=torch.Generator().manual_seed(40)).tolist()
    b = torch.randint(0, 500, (9,), generator=torch.Generator().manual_seed(41)).tolist()
    one = model(ForwardBatch.build([a], [0], [0], [[0, 1]], logits_rows="all"), cache()).logits
    c = cache()
    dec = torch.cat(
        [model(ForwardBatch.build([[t]], [i], [1], [[5, 2]]), c).logits for i, t in enumerate(a)]
    )
    assert torch.equal(dec, one)
    c = cache()
    mixed = model(
        ForwardBatch.build([b, a[:11]], [0, 0], [0, 2], [[9], [3, 4]], logits_rows="all"), c
    ).logits
    rest = model(ForwardBatch.build([a[11:]], [11], [2], [[3, 4]], logits_rows="all"), c).logits
    assert torch.equal(torch.cat([mixed[9:], rest]), one)
    alone_b = model(ForwardBatch.build([b], [0], [0], [[0]], logits_rows="all"), cache()).logits
    assert torch.equal(mixed[:9], alone_b)


def test_bitwise_dspark_drafts(batch_invariant):
    from deepinfer_model.dspark import dspark_step

    cfg = ModelConfig.tiny()
    model = init_random_(Model(cfg), 2)
    spec = CacheSpec.from_config(cfg, block_size=16, dtype=torch.float32)

    def cache():
        return KVCache(cfg, spec, num_blocks=4, num_slots=3, dtype=torch.float32)

    g = torch.Generator().manual_seed(0)
    ha, hb = torch.randn(11, 192, generator=g), torch.randn(4, 192, generator=g)
    alone = dspark_step(
        model, ForwardBatch.build([[1] * 11], [0], [0], [[0]]), ha, cache(), torch.tensor([5])
    )
    c = cache()
    dspark_step(
        model,
        ForwardBatch.build([[1] * 6, [1] * 4], [0, 0], [1, 2], [[0], [1]]),
        torch.cat([ha[:6], hb]),
        c,
    )
    both = dspark_step(
        model,
        ForwardBatch.build([[1] * 5, [1]], [6, 4], [1, 2], [[0], [1]]),
        torch.cat([ha[6:], torch.randn(1, 192, generator=g)]),
        c,
        torch.tensor([5, 7]),
    )
    assert torch.equal(both.logits[0], alone.logits[0])
    assert torch.equal(both.confidence[0], alone.confidence[0])
