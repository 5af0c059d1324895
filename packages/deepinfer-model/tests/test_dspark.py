"""DSpark stages: ring seeding is step-independent, batching is invisible, the window bounds
what a draft sees, the block sees itself both ways, and the Markov head chains the drafts."""

import pytest
import torch
from deepinfer_model.batch import ForwardBatch
from deepinfer_model.cache import CacheSpec, KVCache
from deepinfer_model.config import ModelConfig
from deepinfer_model.dspark import dspark_step
from deepinfer_model.model import Model, init_random_

TOL = dict(rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def tiny():
    cfg = ModelConfig.tiny()
    model = init_random_(Model(cfg), 2)
    model.engram_hasher.set_token_map([i % 300 for i in range(cfg.vocab_size)])
    spec = CacheSpec.from_config(cfg, block_size=16, dtype=torch.float32)
    return cfg, model, spec


def _cache(cfg, spec):
    return KVCache(cfg, spec, num_blocks=16, num_slots=3, dtype=torch.float32)


def _hidden(cfg, n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, cfg.hidden_size * len(cfg.dspark_target_layer_ids), generator=g)


def _batch(seqs, ctx, slots):
    return ForwardBatch.build(seqs, ctx, slots, [[0]] * len(seqs))


def test_seed_in_one_step_or_many_gives_the_same_draft(tiny):
    cfg, model, spec = tiny
    hid = _hidden(cfg, 14, 0)
    c1 = _cache(cfg, spec)
    d1 = dspark_step(model, _batch([[1] * 14], [0], [0]), hid, c1, draft_ids=torch.tensor([7]))
    c2 = _cache(cfg, spec)
    assert dspark_step(model, _batch([[1] * 10], [0], [1]), hid[:10], c2) is None
    for i in range(10, 13):
        dspark_step(model, _batch([[1]], [i], [1]), hid[i : i + 1], c2)
    d2 = dspark_step(model, _batch([[1]], [13], [1]), hid[13:], c2, draft_ids=torch.tensor([7]))
    assert d1.tokens.shape == (1, cfg.dspark_block_size)
    torch.testing.assert_close(d2.logits, d1.logits, **TOL)
    torch.testing.assert_close(d2.confidence, d1.confidence, **TOL)
    assert torch.equal(d1.tokens, d2.tokens)


def test_two_sequences_in_one_step_equal_each_alone(tiny):
    cfg, model, spec = tiny
    ha, hb = _hidden(cfg, 11, 1), _hidden(cfg, 3, 2)
    alone_a = dspark_step(
        model, _batch([[1] * 11], [0], [0]), ha, _cache(cfg, spec), torch.tensor([5])
    )
    alone_b = dspark_step(
        model, _batch([[1] * 3], [0], [0]), hb, _cache(cfg, spec), torch.tensor([9])
    )
    both = dspark_step(
        model,
        _batch([[1] * 11, [1] * 3], [0, 0], [2, 1]),
        torch.cat([ha, hb]),
        _cache(cfg, spec),
        torch.tensor([5, 9]),
    )
    torch.testing.assert_close(both.logits[0], alone_a.logits[0], **TOL)
    torch.testing.assert_close(both.logits[1], alone_b.logits[0], **TOL)


def test_hidden_outside_the_window_is_not_seen(tiny):
    cfg, model, spec = tiny
    n, w = 20, cfg.sliding_window
    hid = _hidden(cfg, n, 3)
    base = dspark_step(
        model, _batch([[1] * n], [0], [0]), hid, _cache(cfg, spec), torch.tensor([4])
    )
    old = hid.clone()
    old[: n - w] = 0.0  # rows older than the window
    same = dspark_step(
        model, _batch([[1] * n], [0], [0]), old, _cache(cfg, spec), torch.tensor([4])
    )
    torch.testing.assert_close(same.logits, base.logits, **TOL)
    new = hid.clone()
    new[n - w] += 1.0  # the oldest row inside the window
    diff = dspark_step(
        model, _batch([[1] * n], [0], [0]), new, _cache(cfg, spec), torch.tensor([4])
    )
    assert not torch.allclose(diff.logits, base.logits)


def test_block_attends_both_ways_and_markov_chain(tiny):
    cfg, model, spec = tiny
    hid = _hidden(cfg, 6, 4)
    seen = []

    def sample(lg):  # fixed picks, so we can check the Markov bias is added for each step
        tok = torch.full((lg.shape[0],), 100 + len(seen))
        seen.append(lg.clone())
        return tok

    d = dspark_step(
        model, _batch([[1] * 6], [0], [0]), hid, _cache(cfg, spec), torch.tensor([42]), sample
    )
    assert d.tokens.tolist() == [[100 + i for i in range(cfg.dspark_block_size)]]
    top = model.mtp[-1]
    prev = [42] + [100 + i for i in range(cfg.dspark_block_size - 1)]
    base = d.logits[0] - torch.stack([top.markov_head(torch.tensor([p]))[0][0] for p in prev])
    # the same block with different Markov inputs has the same base logits
    d2 = dspark_step(model, _batch([[1] * 6], [0], [0]), hid, _cache(cfg, spec), torch.tensor([42]))
    prev2 = [42, *d2.tokens[0, :-1].tolist()]
    base2 = d2.logits[0] - torch.stack([top.markov_head(torch.tensor([p]))[0][0] for p in prev2])
    torch.testing.assert_close(base2, base, **TOL)
    for i, lg in enumerate(seen):
        torch.testing.assert_close(lg[0], d.logits[0, i])
    # the block attends both ways: changing the last block row changes the first row's output
    from deepinfer_model.dspark import DraftContext

    attn = model.mtp[0].attn
    blk = cfg.dspark_block_size
    dctx = DraftContext(
        positions=torch.arange(6, 6 + blk),
        seq_of=torch.zeros(blk, dtype=torch.int64),
        last=torch.tensor([5]),
        slots=torch.tensor([0]),
        block=blk,
    )
    cache = _cache(cfg, spec)
    dspark_step(model, _batch([[1] * 6], [0], [0]), hid, cache)
    x = torch.randn(blk, cfg.hidden_size, generator=torch.Generator().manual_seed(9))
    y1 = attn(x, dctx, cache)
    x2 = x.clone()
    x2[-1] += 1.0
    y2 = attn(x2, dctx, cache)
    assert not torch.allclose(y1[0], y2[0])
    assert d.confidence.shape == (1, cfg.dspark_block_size)


def test_bad_hidden_shape_is_rejected(tiny):
    cfg, model, spec = tiny
    with pytest.raises(ValueError, match="hidden"):
        dspark_step(model, _batch([[1] * 3], [0], [0]), torch.zeros(3, 5), _cache(cfg, spec))


def test_drafting_after_a_verify_uses_only_accepted_rows(tiny):
    cfg, model, spec = tiny
    hid = _hidden(cfg, 12, 6)
    ref = dspark_step(
        model, _batch([[1] * 10], [0], [0]), hid[:10], _cache(cfg, spec), torch.tensor([3])
    )
    cache = _cache(cfg, spec)
    dspark_step(model, _batch([[1] * 7], [0], [0]), hid[:7], cache)
    junk = hid[7:12].clone()
    junk[3:] = 5.0  # the last two rows are rejected drafts
    got = dspark_step(
        model,
        _batch([[1] * 5], [7], [0]),
        junk,
        cache,
        torch.tensor([3]),
        last_positions=torch.tensor([9]),
    )
    torch.testing.assert_close(got.logits, ref.logits, **TOL)
    with pytest.raises(ValueError, match="last_positions"):
        dspark_step(
            model,
            _batch([[1] * 2], [12], [0]),
            hid[:2],
            cache,
            torch.tensor([3]),
            last_positions=torch.tensor([20]),
        )
