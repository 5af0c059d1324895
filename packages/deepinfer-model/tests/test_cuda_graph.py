"""DecodeGraphs: the piecewise decode path equals the model's own forward.

On CPU the pieces run eagerly on the padded static buffers (`capture=False`): that checks the
cut at the attention cores, the padding and the static-buffer plumbing. On CUDA the same test
records and replays real CUDA graphs (skipped without a GPU).
"""

import pytest
import torch
from deepinfer_model.batch import ForwardBatch, HostBatchInfo
from deepinfer_model.cache import CacheSpec, KVCache
from deepinfer_model.config import ModelConfig
from deepinfer_model.cuda_graph import DecodeGraphs, bucket_sizes
from deepinfer_model.model import Model, init_random_
from hypothesis import given
from hypothesis import strategies as st


def _model(device: str) -> tuple[ModelConfig, Model, CacheSpec]:
    cfg = ModelConfig.tiny()
    model = init_random_(Model(cfg, fake_quant_kv=False), 0).to(device)
    model.engram_hasher.set_token_map([i % 300 for i in range(cfg.vocab_size)])
    return cfg, model, CacheSpec.from_config(cfg, block_size=16, dtype=torch.float32)


@pytest.fixture(scope="module")
def tiny():
    return _model("cpu")


def _batch(seqs, ctx, slots, pages, device) -> ForwardBatch:
    b = ForwardBatch.build(seqs, ctx, slots, pages, device=device)
    if b.host is None:  # CPU: give it the mirror the engine always gives
        b.host = HostBatchInfo.of(b)
    return b


def _decode_both(cfg, model, spec, device, graphs, lens, steps):
    """Prefill len(lens) prompts into two identical caches, then decode `steps` greedy steps:
    the model's forward on one cache, `graphs` on the other. Returns both logit lists."""
    caches = [
        KVCache(cfg, spec, num_blocks=32, num_slots=len(lens), device=device, dtype=torch.float32)
        for _ in range(2)
    ]
    g = torch.Generator().manual_seed(sum(lens))
    prompts = [torch.randint(0, 500, (n,), generator=g).tolist() for n in lens]
    pages = [[3 * i, 3 * i + 1, 3 * i + 2] for i in range(len(lens))]
    slots = list(range(len(lens)))
    for cache in caches:
        model(_batch(prompts, [0] * len(lens), slots, pages, device), cache)
    ctx = list(lens)
    last = [p[-1] for p in prompts]
    ref, got = [], []
    for _ in range(steps):
        batch = _batch([[t] for t in last], ctx, slots, pages, device)
        assert graphs.unsupported(batch) is None
        a = model(batch, caches[0]).logits
        b = graphs.forward(_batch([[t] for t in last], ctx, slots, pages, device), caches[1])
        ref.append(a)
        got.append(b.logits)
        last = a.argmax(-1).tolist()
        ctx = [c + 1 for c in ctx]
    return ref, got


@pytest.mark.parametrize("lens", [[5], [9, 3, 17]])  # 3 sequences run in the bucket of 4
def test_pieces_equal_forward_cpu(tiny, lens):
    cfg, model, spec = tiny
    graphs = DecodeGraphs(model, max_batch=8, capture=False)
    ref, got = _decode_both(cfg, model, spec, "cpu", graphs, lens, steps=4)
    for a, b in zip(ref, got, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
        assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_unsupported_batches_say_why(tiny):
    cfg, model, spec = tiny
    graphs = DecodeGraphs(model, max_batch=2, capture=False)
    prefill = _batch([[1, 2]], [0], [0], [[0]], "cpu")
    assert "pure decode" in graphs.unsupported(prefill)
    hidden = _batch([[1]], [4], [0], [[0]], "cpu")
    hidden.return_hidden = True
    assert "hidden" in graphs.unsupported(hidden)
    big = _batch([[1]] * 3, [4] * 3, [0, 1, 2], [[0], [1], [2]], "cpu")
    assert "largest captured batch 2" in graphs.unsupported(big)
    bare = ForwardBatch.build([[1]], [4], [0], [[0]])
    assert "host mirror" in graphs.unsupported(bare)
    below = _batch([[1]], [4], [0], [[0]], "cpu").with_yoco_floor([9])
    below.host = HostBatchInfo.of(below)
    assert "YOCO floor" in graphs.unsupported(below)
    above = _batch([[1]], [40], [0], [[0, 1, 2]], "cpu").with_yoco_floor([9])
    above.host = HostBatchInfo.of(above)
    assert graphs.unsupported(above) is None
    # at position 12 the window (8) reaches position 5, below the floor: the decoder layers'
    # windows must stop there, which the graphed step (one context for every layer) cannot do
    near = _batch([[1]], [12], [0], [[0]], "cpu").with_yoco_floor([9])
    near.host = HostBatchInfo.of(near)
    assert "window reaches below its YOCO floor" in graphs.unsupported(near)
    start = _batch([[1]], [3], [0], [[0]], "cpu").with_yoco_floor([0])
    start.host = HostBatchInfo.of(start)
    assert graphs.unsupported(start) is None
    cache = KVCache(cfg, spec, num_blocks=4, num_slots=3, dtype=torch.float32)
    with pytest.raises(ValueError, match="pure decode"):
        graphs.forward(prefill, cache)


def test_capture_needs_cuda(tiny):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ValueError, match="capture"):
        DecodeGraphs(tiny[1], max_batch=4, capture=True)


@given(st.integers(1, 700))
def test_bucket_sizes_cover_every_batch(max_batch):
    sizes = bucket_sizes(max_batch)
    assert sizes == sorted(set(sizes)) and sizes[-1] == max_batch and sizes[0] == 1
    for n in range(1, max_batch + 1):
        pad = next(s for s in sizes if s >= n)
        assert pad - n < max(n, 16)  # at most 2x below 16 rows, under 16 rows of padding above


def test_bucket_sizes_reject_zero():
    with pytest.raises(ValueError, match="max_batch"):
        bucket_sizes(0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("lens", [[5], [9, 3, 17], [4, 6, 8, 10]])
def test_graphs_equal_forward_cuda(lens):
    cfg, model, spec = _model("cuda")
    graphs = DecodeGraphs(model, max_batch=8)
    assert graphs.capture
    ref, got = _decode_both(cfg, model, spec, "cuda", graphs, lens, steps=4)
    for a, b in zip(ref, got, strict=True):
        if len(lens) in graphs.sizes:  # same row count: the same kernels on the same shapes
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
        assert torch.equal(a.argmax(-1), b.argmax(-1))
    assert sorted(graphs.buckets) == [next(s for s in graphs.sizes if s >= len(lens))]
