"""The forward never reads the device: run on the `meta` device (shapes only), where any
data-dependent host read (`.item()`, `.tolist()`, `int(t)`, `nonzero`, boolean-mask indexing) —
exactly what would be a device->host sync on CUDA — raises. The batch carries its CPU mirror
(`ForwardBatch.host`), as the engine's runner always gives it.

Kernel ops run their `ref` tier on meta tensors, except the routed experts: the ref tier's id
check reads the ids on CPU only (it is skipped on CUDA, where the triton tier runs), so a
shape-only stand-in replaces it here.
"""

import pytest
import torch
from deepinfer_kernels import REGISTRY, ops
from deepinfer_model.batch import ForwardBatch
from deepinfer_model.cache import CacheSpec, KVCache
from deepinfer_model.config import ModelConfig
from deepinfer_model.dspark import dspark_step
from deepinfer_model.model import Model

META = torch.device("meta")


@pytest.fixture()
def meta_model(monkeypatch):
    candidates = REGISTRY._candidates
    monkeypatch.setattr(
        REGISTRY,
        "_candidates",
        lambda op, device: candidates(op, torch.device("cpu") if device.type == "meta" else device),
    )
    monkeypatch.setattr(ops, "moe_experts", lambda x, *args, **kwargs: torch.empty_like(x))
    cfg = ModelConfig.tiny()
    model = Model(cfg, device=META)
    model.engram_hasher.token_map = torch.empty(cfg.vocab_size, dtype=torch.int64, device=META)
    spec = CacheSpec.from_config(cfg, block_size=16, dtype=torch.float32)
    cache = KVCache(cfg, spec, num_blocks=16, num_slots=4, device=META, dtype=torch.float32)
    return cfg, model, cache


def _batch(seqs, ctx, logits_rows="last", return_hidden=False):
    tables = [[4 * i, 4 * i + 1, 4 * i + 2, 4 * i + 3] for i in range(len(seqs))]
    return ForwardBatch.build(
        seqs,
        ctx,
        list(range(len(seqs))),
        tables,
        logits_rows=logits_rows,
        return_hidden=return_hidden,
        device=META,
    )


@pytest.mark.parametrize(
    "seqs,ctx",
    [
        ([[1] * 9, [2] * 3, [3]], [0, 4, 17]),  # prefill, chunk and decode in one batch
        ([[1], [2], [3], [4]], [3, 17, 40, 8]),  # decode of unequal contexts (batched top-k)
        ([[1, 2], [3, 4], [5]], [21, 6, 30]),  # verify rows and a decode
    ],
)
def test_forward_reads_nothing_back(meta_model, seqs, ctx):
    cfg, model, cache = meta_model
    out = model(_batch(seqs, ctx, logits_rows="all", return_hidden=True), cache)
    assert out.logits.shape == (sum(map(len, seqs)), cfg.vocab_size)
    assert out.logits.device == META


def test_yoco_compact_reads_nothing_back(meta_model):
    cfg, model, cache = meta_model
    batch = _batch([[1] * 12, [2] * 2], [0, 30]).with_yoco_floor([8, 20])
    assert model(batch, cache).logits.shape == (2, cfg.vocab_size)


def test_dspark_step_reads_nothing_back(meta_model):
    cfg, model, cache = meta_model
    batch = _batch([[1] * 5, [2]], [0, 9], return_hidden=True)
    out = model(batch, cache)
    draft = dspark_step(
        model, batch, out.hidden, cache, torch.zeros(2, dtype=torch.int64, device=META)
    )
    assert draft.tokens.shape == (2, cfg.dspark_block_size)


def test_without_the_host_mirror_the_forward_must_read_back(meta_model):
    """The check above can fail: a batch without `host` reads its metadata from the device."""
    _, model, cache = meta_model
    batch = _batch([[1], [2]], [3, 5])
    batch.host = None
    with pytest.raises((RuntimeError, NotImplementedError)):
        model(batch, cache)
