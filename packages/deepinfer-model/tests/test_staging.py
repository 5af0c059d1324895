"""HostStaging: a step's host-built index tensors reach the device in one copy at the end of
`Model.prepare`. On CPU a staging object on the CPU runs the same path (views of the staging
buffer, filled only when the block ends): the logits equal those of plain uploads, bit for bit,
for prefill, chunked prefill and decode, in the model's forward and the decode pieces, also when
the buffer is too small and some uploads fall back to plain ones."""

import pytest
import torch
from deepinfer_model.batch import ForwardBatch, HostBatchInfo
from deepinfer_model.cache import CacheSpec, KVCache
from deepinfer_model.config import ModelConfig
from deepinfer_model.cuda_graph import DecodeGraphs
from deepinfer_model.model import Model, init_random_
from deepinfer_model.staging import HostStaging
from deepinfer_model.step_context import StepContext


@pytest.fixture(scope="module")
def tiny():
    cfg = ModelConfig.tiny()
    model = init_random_(Model(cfg), 0)
    model.engram_hasher.set_token_map([i % 300 for i in range(cfg.vocab_size)])
    return cfg, model


def _batch(seqs, ctx, pages):
    b = ForwardBatch.build(seqs, ctx, list(range(len(seqs))), pages)
    b.host = HostBatchInfo.of(b)
    return b


def _run(cfg, model, staging, graphs: bool):
    """Two prompt chunks of 3 sequences, then 5 greedy decode steps; all logits."""
    model.staging = staging
    spec = CacheSpec.from_config(cfg, block_size=16, dtype=torch.float32)
    cache = KVCache(cfg, spec, num_blocks=16, num_slots=3, dtype=torch.float32)
    g = torch.Generator().manual_seed(3)
    lens = [11, 4, 19]
    prompts = [torch.randint(0, 500, (n,), generator=g).tolist() for n in lens]
    pages = [[3 * i, 3 * i + 1, 3 * i + 2] for i in range(3)]
    out = [model(_batch([p[:3] for p in prompts], [0, 0, 0], pages), cache).logits]
    out.append(model(_batch([p[3:] for p in prompts], [3, 3, 3], pages), cache).logits)
    pieces = DecodeGraphs(model, max_batch=4, capture=False) if graphs else None
    ctx, last = list(lens), out[-1].argmax(-1).tolist()
    for _ in range(5):
        batch = _batch([[t] for t in last], ctx, pages)
        logits = (pieces.forward(batch, cache) if graphs else model(batch, cache)).logits
        out.append(logits)
        last, ctx = logits.argmax(-1).tolist(), [c + 1 for c in ctx]
    model.staging = None
    return out


@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("capacity", [1 << 16, 40])
def test_staged_uploads_give_the_same_logits(tiny, graphs, capacity):
    cfg, model = tiny
    plain = _run(cfg, model, None, graphs)
    staging = HostStaging(torch.device("cpu"), capacity=capacity, depth=2)
    for _, dev in staging.pairs:
        dev.fill_(1 << 40)  # an index read before the copy would fail loudly
    staged = _run(cfg, model, staging, graphs)
    for a, b in zip(plain, staged, strict=True):
        assert torch.equal(a, b)
    assert staging.next == 7 % 2  # one staged block per forward (7 forwards)


def test_staged_views_are_filled_when_the_block_ends():
    ctx = StepContext.from_batch(_batch([[1, 2, 3]], [0], [[0]]))
    staging = HostStaging(torch.device("cpu"), capacity=64, depth=1)
    with ctx.staged(staging):
        up = ctx.upload(torch.arange(5, dtype=torch.int64) + 7)
        plain = ctx.upload(torch.zeros(100, dtype=torch.int64))  # too large: a plain upload
        assert plain.data_ptr() != staging.pairs[0][1].data_ptr()
    assert up.tolist() == [7, 8, 9, 10, 11]
    assert up.data_ptr() == staging.pairs[0][1].data_ptr()
