"""YOCO compact prefill (`ForwardBatch.yoco_floor`): decoder layers after the CED split run
only from the floor on. Floor 0 is the exact path; the result does not depend on chunking."""

import itertools

import pytest
import torch
from deepinfer_model.batch import ForwardBatch
from deepinfer_model.cache import CacheSpec, KVCache
from deepinfer_model.config import ModelConfig
from deepinfer_model.model import Model, init_random_

TOL = dict(rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def tiny():
    cfg = ModelConfig.tiny()
    model = init_random_(Model(cfg), 0)
    model.engram_hasher.set_token_map([i % 300 for i in range(cfg.vocab_size)])
    return cfg, model, CacheSpec.from_config(cfg, block_size=16, dtype=torch.float32)


def _run(model, cache, toks, bounds, floor, slot=0, rows="all"):
    out = []
    for s, e in itertools.pairwise(bounds):
        b = ForwardBatch.build(
            [toks[s:e]], [s], [slot], [[0, 1]], logits_rows=rows if e > floor else []
        )
        b.yoco_floor = torch.tensor([floor])
        if e > floor and rows == "all":
            b.logits_indices = torch.arange(max(s, floor) - s, e - s)
        out.append(model(b, cache).logits)
    return torch.cat(out)


def test_floor_zero_is_the_exact_path(tiny):
    cfg, model, spec = tiny
    toks = list(range(3, 23))
    exact = model(
        ForwardBatch.build([toks], [0], [0], [[0, 1]], logits_rows="all"),
        KVCache(cfg, spec, 4, 2, dtype=torch.float32),
    ).logits
    yoco = _run(model, KVCache(cfg, spec, 4, 2, dtype=torch.float32), toks, [0, 20], 0)
    torch.testing.assert_close(yoco, exact, **TOL)


@pytest.mark.parametrize("bounds", [[0, 26], [0, 5, 26], [0, 9, 10, 17, 26], list(range(27))])
def test_chunking_does_not_change_the_compact_result(tiny, bounds):
    cfg, model, spec = tiny
    toks = [(7 * i + 1) % 500 for i in range(26)]
    floor = 9
    one = _run(model, KVCache(cfg, spec, 4, 2, dtype=torch.float32), toks, [0, 26], floor)
    got = _run(model, KVCache(cfg, spec, 4, 2, dtype=torch.float32), toks, bounds, floor)
    assert one.shape == (26 - floor, cfg.vocab_size)
    torch.testing.assert_close(got, one, **TOL)
    exact = model(
        ForwardBatch.build([toks], [0], [0], [[0, 1]], logits_rows="all"),
        KVCache(cfg, spec, 4, 2, dtype=torch.float32),
    ).logits
    assert not torch.allclose(one, exact[floor:], **TOL)  # approximate by design


def test_mixed_batch_with_and_without_floor(tiny):
    cfg, model, spec = tiny
    a, b = [(5 * i + 2) % 500 for i in range(20)], [(3 * i + 4) % 500 for i in range(11)]
    ref_a = _run(model, KVCache(cfg, spec, 4, 2, dtype=torch.float32), a, [0, 20], 12)
    ref_b = model(
        ForwardBatch.build([b], [0], [0], [[0]], logits_rows="all"),
        KVCache(cfg, spec, 4, 2, dtype=torch.float32),
    ).logits
    batch = ForwardBatch.build(
        [a, b], [0, 0], [1, 0], [[2, 3], [0]], logits_rows=[*range(12, 20), *range(20, 31)]
    )
    batch.yoco_floor = torch.tensor([12, 0])
    both = model(batch, KVCache(cfg, spec, 4, 2, dtype=torch.float32)).logits
    torch.testing.assert_close(both[:8], ref_a, **TOL)
    torch.testing.assert_close(both[8:], ref_b, **TOL)


def test_logits_below_the_floor_are_refused(tiny):
    cfg, model, spec = tiny
    batch = ForwardBatch.build([list(range(10))], [0], [0], [[0]], logits_rows="all")
    batch.yoco_floor = torch.tensor([4])
    with pytest.raises(ValueError, match="yoco_floor"):
        model(batch, KVCache(cfg, spec, 4, 2, dtype=torch.float32))
