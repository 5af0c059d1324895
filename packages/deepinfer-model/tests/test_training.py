"""Training mode (`deepinfer_model.training`): the same function as the inference model, with
gradients where the checkpoint's rounding has none, and an export back to the same tensors."""

import pytest
import torch
from deepinfer_model.batch import ForwardBatch
from deepinfer_model.cache import CacheSpec, KVCache
from deepinfer_model.config import ModelConfig
from deepinfer_model.dspark import dspark_step
from deepinfer_model.model import Model, init_random_
from deepinfer_model.tiny_checkpoint import checkpoint_tensors, model_tensor_specs
from deepinfer_model.training import enable_training_, straight_through, training_values

CFG = ModelConfig.tiny()


def _model(seed=3):
    model = init_random_(Model(CFG), seed)
    model.engram_hasher.set_token_map([i % 300 for i in range(CFG.vocab_size)])
    return model


def _forward(model, toks, hidden=False):
    spec = CacheSpec.from_config(CFG, block_size=16, dtype=torch.float32)
    cache = KVCache(CFG, spec, num_blocks=8, num_slots=2, dtype=torch.float32)
    batch = ForwardBatch.build(
        toks, [0] * len(toks), [0, 1][: len(toks)], [[0, 1, 2], [3, 4, 5]][: len(toks)],
        logits_rows="all", return_hidden=hidden,
    )  # fmt: skip
    return model(batch, cache), batch, cache


def _tokens(n, seed):
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def pair():
    """An inference model and the same weights in training mode (masters = the weights)."""
    ref, train = _model(), _model()
    enable_training_(train)
    return ref, train


def test_training_mode_computes_the_inference_function(pair):
    ref, train = pair
    toks = [_tokens(37, 0), _tokens(29, 1)]  # past window 8, top-4 entries and 2 candidate blocks
    with torch.no_grad():
        want = _forward(ref, toks)[0].logits
        got = _forward(train, toks)[0].logits
    # the same roundings of the same values; only the matmul order differs (FP8 flips, see
    # test_model_invariants.FP8_FLIP_TOL)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-2)
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.95


def test_every_trainable_weight_gets_a_gradient_except_the_indexer(pair):
    _, train = pair
    train.zero_grad(set_to_none=True)
    toks = [_tokens(33, 2), _tokens(33, 3)]
    out = _forward(train, toks)[0]
    target = torch.tensor(toks).flatten()[1:]
    torch.nn.functional.cross_entropy(out.logits[:-1], target).backward()
    named = {n: p for n, p in train.named_parameters() if p.requires_grad}
    assert any(n.endswith(".master") for n in named) and "head.weight" in named
    for name, p in named.items():
        if name.startswith("mtp.") or ".indexer." in name:
            # DSpark stages are not on the target's path; the indexer only picks (top-k)
            assert p.grad is None or not p.grad.any(), name
        else:
            assert p.grad is not None and torch.isfinite(p.grad).all(), name
            assert p.grad.any(), name
    assert not train.layers[2].ffn.gate.bias.requires_grad  # balanced, not trained


def test_dspark_stages_train_through_dspark_step(pair):
    _, train = pair
    train.zero_grad(set_to_none=True)
    toks = [_tokens(20, 4)]
    with torch.no_grad():
        out, batch, cache = _forward(train, toks, hidden=True)
    teacher = iter(torch.tensor([[5, 6, 7, 8]]).T)
    draft = dspark_step(
        train, batch, out.hidden, cache, torch.tensor([4]), sample=lambda _: next(teacher)
    )
    (draft.logits.logsumexp(-1).sum() + draft.confidence.sum()).backward()
    experts_hit = 0
    for name, p in train.named_parameters():
        if name.startswith("mtp.") and p.requires_grad:
            if ".experts." in name:  # 4 block tokens reach only the experts they are routed to
                experts_hit += p.grad is not None and bool(p.grad.any())
            else:
                assert p.grad is not None and p.grad.any(), name
    assert experts_hit >= 3


def test_straight_through_keeps_values_and_passes_gradients():
    from deepinfer_kernels import quant

    x = torch.randn(4, 64, requires_grad=True)
    y = straight_through(quant.fake_quant_fp4_ue8m0, x, 32)
    assert torch.equal(y, quant.fake_quant_fp4_ue8m0(x.detach(), 32))
    (y * torch.arange(64.0)).sum().backward()
    assert torch.equal(x.grad, torch.arange(64.0).expand(4, 64))


def test_export_gives_back_the_checkpoint_values(pair):
    """Masters taken from the weights export to the same values (a scale may come out halved
    with codes doubled where a block's largest code rounded to a power of two)."""
    from deepinfer_kernels import quant
    from deepinfer_model.tiny_checkpoint import quantized_format

    ref, train = pair
    specs = model_tensor_specs(CFG)
    by_name = {s.name: s for s in specs}
    tensors = checkpoint_tensors(specs, training_values(train))
    state = ref.state_dict()

    def value(source, name):
        spec, t = by_name[name], source[name]
        if spec.dtype in (torch.float32, torch.bfloat16):
            return t.to(spec.dtype).float()  # the model's fp32 copies of bf16-on-disk weights
        scale_name = name.removesuffix(".weight") + ".scale"
        fmt, scale = quantized_format(spec, by_name[scale_name]), source[scale_name]
        if fmt == "fp8_blocks":
            return quant.dequantize_fp8_blocks(t, scale)
        if fmt == "fp8_rows":
            return quant.act_dequant_fp8(t, scale.float())
        return quant.dequantize_fp4(t, scale)

    for s in specs:
        if s.name.endswith(".scale") and s.name.removesuffix(".scale") + ".weight" in by_name:
            continue
        assert torch.equal(value(tensors, s.name), value(state, s.name)), s.name
