"""init_random_: deterministic, and the fast expert codes give sane FP4 experts."""

import torch
from deepinfer_kernels import quant
from deepinfer_model.batch import ForwardBatch
from deepinfer_model.cache import CacheSpec, KVCache
from deepinfer_model.config import ModelConfig
from deepinfer_model.layers.linear import FP4Weight
from deepinfer_model.model import Model, init_random_


def _model(seed: int, expert_codes: bool) -> Model:
    cfg = ModelConfig.tiny()
    model = init_random_(Model(cfg), seed, expert_codes=expert_codes)
    model.engram_hasher.set_token_map([i % 300 for i in range(cfg.vocab_size)])
    return model


def test_expert_codes_are_sane_fp4_weights_and_deterministic():
    a, b, c = _model(3, True), _model(3, True), _model(4, True)
    experts = [m for m in a.modules() if isinstance(m, FP4Weight)]
    assert experts
    for mod in experts:
        w = quant.dequantize_fp4(mod.weight, mod.scale)
        target = mod.in_features**-0.5
        assert torch.isfinite(w).all()
        assert 0.5 * target < float(w.std()) < 2.0 * target
    same = zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    assert all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in same)
    assert not all(
        torch.equal(x.weight, y.weight)
        for x, y in zip(experts, [m for m in c.modules() if isinstance(m, FP4Weight)], strict=True)
    )


def test_expert_codes_model_gives_finite_logits():
    model = _model(0, True)
    cfg = model.config
    spec = CacheSpec.from_config(cfg, block_size=16, dtype=torch.float32)
    cache = KVCache(cfg, spec, num_blocks=4, num_slots=1, dtype=torch.float32)
    toks = list(range(5, 25))
    logits = model(ForwardBatch.build([toks], [0], [0], [[0, 1]], logits_rows="all"), cache).logits
    assert torch.isfinite(logits).all() and float(logits.std()) > 0.05
