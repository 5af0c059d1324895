"""SWA bounded replay (`ForwardBatch.yoco_floor`, DeepInfer's YOCO prefill truncation): the
producer layers (below the CED decoder start) run on every token exactly as without a floor;
the consumer layers (from the decoder start on) see no window position below the floor, and in
`compact` mode run only the tokens at or after it (`mask`: every token, windows narrowed).
Floor 0 is the exact path; the result does not depend on chunking."""

import itertools

import pytest
import torch
from _attention_oracle import capture, check_attention_layers
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


def _run(model, cache, toks, bounds, floor, slot=0, rows="all", mode="compact"):
    out = []
    for s, e in itertools.pairwise(bounds):
        b = ForwardBatch.build(
            [toks[s:e]], [s], [slot], [[0, 1]], logits_rows=rows if e > floor else []
        )
        b.yoco_floor = torch.tensor([floor])
        b.yoco_truncation = mode
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


@pytest.mark.parametrize("mode", ["compact", "mask"])
@pytest.mark.parametrize("bounds", [[0, 26], [0, 5, 26], [0, 9, 10, 17, 26], list(range(27))])
def test_chunking_does_not_change_the_truncated_result(tiny, bounds, mode):
    cfg, model, spec = tiny
    toks = [(7 * i + 1) % 500 for i in range(26)]
    floor = 9
    one = _run(
        model, KVCache(cfg, spec, 4, 2, dtype=torch.float32), toks, [0, 26], floor, mode=mode
    )
    got = _run(model, KVCache(cfg, spec, 4, 2, dtype=torch.float32), toks, bounds, floor, mode=mode)
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


T, FLOOR = 26, 9  # layer 0's windows reach below 9 on rows 0..15 (window 8)


@pytest.fixture(scope="module")
def exact_kv():
    """The tiny model without KV fake-quantisation (what the float64 oracle computes)."""
    cfg = ModelConfig.tiny()
    model = init_random_(Model(cfg, fake_quant_kv=False), 3)
    model.engram_hasher.set_token_map([i % 300 for i in range(cfg.vocab_size)])
    return cfg, model, CacheSpec.from_config(cfg, block_size=16, dtype=torch.float32)


def _prefill(exact_kv, floor, mode):
    """One-shot prefill of T tokens (logits of rows FLOOR..T-1): (the producer blocks' output
    streams, the cache, the logits)."""
    cfg, model, spec = exact_kv
    toks = [(11 * i + 5) % 500 for i in range(T)]
    cache = KVCache(cfg, spec, 4, 1, dtype=torch.float32)
    batch = ForwardBatch.build([toks], [0], [0], [[0, 1]], logits_rows=list(range(FLOOR, T)))
    if floor is not None:
        batch.yoco_floor = torch.tensor([floor])
        batch.yoco_truncation = mode
    blocks, handles = {}, []
    for i in range(cfg.decoder_start_layer):

        def keep(mod, args, out, i=i):
            blocks[i] = out[0].detach().clone()

        handles.append(model.layers[i].register_forward_hook(keep))
    try:
        logits = model(batch, cache).logits
    finally:
        for h in handles:
            h.remove()
    return blocks, cache, logits


@pytest.mark.parametrize("mode", ["compact", "mask"])
def test_producer_layers_and_compressed_entries_equal_off_bitwise(exact_kv, mode):
    cfg = exact_kv[0]
    off_blocks, off_cache, off_logits = _prefill(exact_kv, None, None)
    blocks, cache, logits = _prefill(exact_kv, FLOOR, mode)
    assert sorted(blocks) == list(range(cfg.decoder_start_layer))
    for i, h in off_blocks.items():
        assert torch.equal(blocks[i], h), f"layer {i}"
        assert torch.equal(cache.swa[i], off_cache.swa[i]), f"layer {i} window ring"
    for src in cfg.kv_source_layer_ids:
        assert torch.equal(cache.compressed_kv[src], off_cache.compressed_kv[src]), src
        assert torch.equal(cache.index_k[src], off_cache.index_k[src]), src
        if src in off_cache.comp_kv:
            assert torch.equal(cache.comp_kv[src], off_cache.comp_kv[src]), src
    assert not torch.allclose(logits, off_logits, **TOL)  # the consumer rows are truncated


@pytest.mark.parametrize("mode", ["compact", "mask"])
def test_consumer_rows_equal_an_independent_truncated_implementation(exact_kv, mode):
    cfg, model, _ = exact_kv
    start, n = cfg.decoder_start_layer, cfg.num_hidden_layers
    cap = capture(model, lambda: _prefill(exact_kv, FLOOR, mode))
    # compact: the consumer layers' rows are the kept ones (the decoder start's compressor
    # still reads every row); mask: every row, its window emptied below the floor
    kept = list(range(FLOOR, T))
    rows = {layer: kept for layer in range(start, n)} if mode == "compact" else None
    floors = dict.fromkeys(range(start, n), FLOOR)
    check_attention_layers(cfg, model, cap, T, rows=rows, floors=floors)


def test_mask_runs_every_row_and_matches_compact_on_the_kept_ones(exact_kv):
    _, compact, _ = _prefill(exact_kv, FLOOR, "compact")
    _, mask, _ = _prefill(exact_kv, FLOOR, "mask")
    for cache_a, cache_b in ((compact, mask),):
        for src, kv in cache_a.compressed_kv.items():
            assert torch.equal(kv, cache_b.compressed_kv[src])
    cfg, model, spec = exact_kv
    toks = [(11 * i + 5) % 500 for i in range(T)]
    batch = ForwardBatch.build([toks], [0], [0], [[0, 1]], logits_rows="all")
    batch.yoco_floor = torch.tensor([FLOOR])
    batch.yoco_truncation = "mask"
    every = model(batch, KVCache(cfg, spec, 4, 1, dtype=torch.float32)).logits
    assert every.shape == (T, cfg.vocab_size)  # rows below the floor have logits too
    _, _, kept = _prefill(exact_kv, FLOOR, "compact")
    torch.testing.assert_close(every[FLOOR:], kept, **TOL)


def test_unknown_truncation_mode_is_refused(tiny):
    cfg, model, spec = tiny
    batch = ForwardBatch.build([list(range(10))], [0], [0], [[0]])
    batch.yoco_floor = torch.tensor([4])
    batch.yoco_truncation = "drop"
    with pytest.raises(ValueError, match=r"yoco_truncation.*compact, mask"):
        model(batch, KVCache(cfg, spec, 4, 2, dtype=torch.float32))
