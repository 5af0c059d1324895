"""Model components against plain float64 math: YaRN, compressor pooling, Engram hashes,
router weights, the SwiGLU clamp, and the model's window/compressed index plumbing."""

import math

import pytest
import torch
from deepinfer_kernels import quant
from deepinfer_model.batch import ForwardBatch
from deepinfer_model.cache import CacheSpec, KVCache
from deepinfer_model.config import ModelConfig
from deepinfer_model.layers.compressor import Compressor
from deepinfer_model.layers.engram import EngramHasher, hash_multipliers
from deepinfer_model.layers.moe import MoE
from deepinfer_model.layers.rope import layer_inv_freq, yarn_inv_freq
from deepinfer_model.model import Model, init_random_
from deepinfer_model.step_context import StepContext


def test_yarn_frequencies_match_formula():
    d, theta, factor, orig = 64, 160000.0, 16.0, 65536
    got = yarn_inv_freq(d, theta, factor, orig, 32, 1)
    low = max(math.floor(d * math.log(orig / (32 * 2 * math.pi)) / (2 * math.log(theta))), 0)
    high = min(math.ceil(d * math.log(orig / (1 * 2 * math.pi)) / (2 * math.log(theta))), d - 1)
    for i in range(d // 2):
        f = theta ** (-2 * i / d)
        s = 1 - min(max((i - low) / max(high - low, 1e-3), 0.0), 1.0)
        assert abs(float(got[i]) - (f / factor * (1 - s) + f * s)) <= 1e-6 * f
    cfg = ModelConfig()
    plain = layer_inv_freq(cfg, 0)
    assert torch.allclose(plain, torch.tensor([1e4 ** (-2 * i / 64) for i in range(32)]))
    assert torch.equal(layer_inv_freq(cfg, 2), layer_inv_freq(cfg, 1))
    assert float(layer_inv_freq(cfg, 2)[-1]) < 160000.0 ** (-62 / 64)  # long wavelengths slowed


def _ctx(cfg, toks_per_step, slot=0):
    spec = CacheSpec.from_config(cfg, block_size=16, dtype=torch.float32)
    cache = KVCache(cfg, spec, num_blocks=4, num_slots=2, dtype=torch.float32)
    out, start = [], 0
    for n in toks_per_step:
        batch = ForwardBatch.build([[3] * n], [start], [slot], [[0, 1]])
        out.append(StepContext.from_batch(batch))
        start += n
    return cache, out


@pytest.mark.parametrize("steps", [[5], [1, 1, 1, 1, 1], [3, 2], [1, 4]])
def test_ratio2_compressor_pools_with_softmax_over_pairs(steps):
    cfg = ModelConfig.tiny()
    g = torch.Generator().manual_seed(0)
    comp = Compressor(cfg, 2, torch.float32)
    comp.wkv.weight.copy_(torch.randn(64, 64, generator=g) / 8)
    comp.wgate.weight.copy_(torch.randn(64, 64, generator=g) / 8)
    comp.norm.weight.copy_(torch.rand(64, generator=g) + 0.5)
    x = torch.randn(5, 64, generator=g)
    cache, ctxs = _ctx(cfg, steps)
    lat, ent, s = [], [], 0
    for c in ctxs:
        latent, _, entry = comp(*comp.project(x[s : s + c.num_tokens]), c, cache)
        lat.append(latent)
        ent += entry.tolist()
        s += c.num_tokens
    assert ent == [0, 1]
    got = torch.cat(lat).double()
    xd = x.double()
    a_all = (xd @ comp.wkv.weight.double().T).tolist()
    z_all = (xd @ comp.wgate.weight.double().T).tolist()
    for j in range(2):
        pooled = []
        for c in range(64):
            a = [a_all[t][c] for t in (2 * j, 2 * j + 1)]
            z = [z_all[t][c] for t in (2 * j, 2 * j + 1)]
            e = [math.exp(v - max(z)) for v in z]
            pooled.append(sum(ai * ei for ai, ei in zip(a, e, strict=False)) / sum(e))
        ms = sum(v * v for v in pooled) / 64
        want = [
            float(comp.norm.weight[c]) * v / math.sqrt(ms + cfg.rms_norm_eps)
            for c, v in enumerate(pooled)
        ]
        torch.testing.assert_close(
            got[j], torch.tensor(want, dtype=torch.float64), rtol=1e-4, atol=1e-5
        )


def test_engram_hashes_on_known_windows():
    cfg = ModelConfig.tiny()
    hasher = EngramHasher(cfg)
    tmap = [(7 * i + 3) % cfg.engram_compressed_vocab_size for i in range(cfg.vocab_size)]
    tmap[0] = cfg.engram_compressed_vocab_size - 1  # make sure every class exists
    hasher.set_token_map(tmap, cfg.engram_compressed_vocab_size)
    toks = [5, 9, 200, 7, 7, 400]
    primes = cfg.engram_layout_primes()

    def expect(prefix_toks, layer_idx, layer_id):
        mult = hash_multipliers(layer_id, 4, cfg.engram_compressed_vocab_size)
        flat = [p for row in primes[layer_idx] for p in row]
        offsets = [sum(flat[:i]) for i in range(len(flat))]
        rows = []
        for p in range(len(prefix_toks)):
            win = [
                tmap[prefix_toks[p - s]] if p - s >= 0 else tmap[cfg.engram_pad_token_id]
                for s in range(4)
            ]
            h = win[0] * mult[0]
            ids = []
            for n in range(1, 4):
                h ^= win[n] * mult[n]
                ids += [h % primes[layer_idx][n - 1][head] for head in range(cfg.engram_n_heads)]
            rows.append([i + o for i, o in zip(ids, offsets, strict=False)])
        return rows

    # one shot vs two steps must agree (history ring), and both equal the loop
    cache, (c1,) = _ctx(cfg, [6])
    one = hasher(torch.tensor(toks), c1, cache)
    cache2, (ca, cb) = _ctx(cfg, [4, 2])
    two = torch.cat(
        [hasher(torch.tensor(toks[:4]), ca, cache2), hasher(torch.tensor(toks[4:]), cb, cache2)]
    )
    assert torch.equal(one, two)
    for li, lid in enumerate(cfg.engram_layer_ids):
        assert one[:, li].tolist() == expect(toks, li, lid)
        assert int(one[:, li].max()) < cfg.engram_num_embeddings[li]


def test_released_multipliers_are_numpy_stream():
    import numpy as np

    bound = (np.iinfo(np.int64).max // 99092) // 2
    for layer in (1, 14):
        v = (
            np.random.default_rng(10007 * layer).integers(0, bound, size=(4,), dtype=np.int64) * 2
            + 1
        )
        assert hash_multipliers(layer, 4, 99092) == tuple(int(x) for x in v)


def test_router_weights_match_loop():
    cfg = ModelConfig.tiny()
    moe = MoE(cfg, 4, 2, torch.float32)
    g = torch.Generator().manual_seed(3)
    moe.gate.weight.copy_(torch.randn(4, 64, generator=g))
    moe.gate.bias.copy_(torch.randn(4, generator=g))
    x = torch.randn(5, 64, generator=g)
    w, ids = moe.gate(x)
    for t in range(5):
        s = [
            math.sqrt(math.log1p(math.exp(float(x[t].double() @ moe.gate.weight[e].double()))))
            for e in range(4)
        ]
        biased = sorted(range(4), key=lambda e: -(s[e] + float(moe.gate.bias[e])))[:2]
        assert sorted(ids[t].tolist()) == sorted(biased)
        tot = sum(s[e] for e in biased)
        for k, e in enumerate(ids[t].tolist()):
            assert abs(float(w[t, k]) - s[e] / tot * 1.5) < 1e-5


@pytest.mark.parametrize(("topk", "norm"), [(1, True), (2, False), (2, True)])
def test_router_normalises_only_with_norm_topk_prob_and_topk_above_one(topk, norm):
    # reference Gate: weights /= sum + 1e-20 only `if norm_topk_prob and topk > 1`; then * scale
    cfg = ModelConfig.tiny(norm_topk_prob=norm)
    moe = MoE(cfg, 4, topk, torch.float32)
    g = torch.Generator().manual_seed(7)
    moe.gate.weight.copy_(torch.randn(4, 64, generator=g))
    moe.gate.bias.copy_(torch.randn(4, generator=g))
    x = torch.randn(6, 64, generator=g)
    w, ids = moe.gate(x)
    for t in range(6):
        s = [
            math.sqrt(math.log1p(math.exp(float(x[t].double() @ moe.gate.weight[e].double()))))
            for e in range(4)
        ]
        chosen = sorted(range(4), key=lambda e: -(s[e] + float(moe.gate.bias[e])))[:topk]
        assert sorted(ids[t].tolist()) == sorted(chosen)
        tot = sum(s[e] for e in chosen) if (norm and topk > 1) else 1.0
        for k, e in enumerate(ids[t].tolist()):
            assert abs(float(w[t, k]) - s[e] / tot * 1.5) < 1e-5


def test_shared_expert_swiglu_clamp():
    cfg = ModelConfig.tiny()
    moe = MoE(cfg, 4, 2, torch.float32)
    se = moe.shared_experts
    g = torch.Generator().manual_seed(4)
    for lin in (se.w1, se.w2, se.w3):
        w, s = quant.quantize_fp8_blocks(
            torch.randn(lin.out_features, lin.in_features, generator=g)
        )
        lin.weight.copy_(w)
        lin.scale.copy_(s)
    x = torch.randn(3, 64, generator=g) * 4  # pre-activations far beyond the limit 10
    got = se(x).double()
    w1, w2, w3 = (lin.dequantized(torch.float64) for lin in (se.w1, se.w2, se.w3))
    xq = quant.fake_quant_fp8_ue8m0(x).double()
    gate, up = xq @ w1.T, xq @ w3.T
    assert float(gate.max()) > 10 and float(up.abs().max()) > 10
    act = torch.nn.functional.silu(gate.clamp(max=10)) * up.clamp(-10, 10)
    want = quant.fake_quant_fp8_ue8m0(act.float()).double() @ w2.T
    torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)


def test_state_dict_names_follow_the_checkpoint():
    cfg = ModelConfig.tiny()
    names = set(Model(cfg).state_dict())
    for n in (
        "embed.weight",
        "head.weight",
        "norm.weight",
        "layers.0.attn.wq_a.weight",
        "layers.0.attn.wq_a.scale",
        "layers.0.attn.attn_sink",
        "layers.0.hc_attn_fn",
        "layers.0.hc_ffn_scale",
        "layers.2.attn.compressor.wgate.weight",
        "layers.4.attn.compressor.norm.weight",
        "layers.2.attn.indexer.wk.weight",
        "layers.6.attn.indexer.wq_b.scale",
        "layers.1.engram.embed.weight",
        "layers.1.engram.embed.scale",
        "layers.3.engram.wkv.scale",
        "layers.0.ffn.experts.3.w2.scale",
        "layers.0.ffn.shared_experts.w1.weight",
        "layers.0.ffn.gate.bias",
        "mtp.0.main_proj.weight",
        "mtp.0.main_norm.weight",
        "mtp.1.markov_head.embed.weight",
        "mtp.1.confidence_head.proj.weight",
        "mtp.1.norm.weight",
        "mtp.0.attn.wkv.weight",
    ):
        assert n in names, n
    assert "layers.4.attn.compressor.wgate.weight" not in names  # ratio 1: no gate
    assert "layers.3.attn.indexer.wq_b.weight" not in names  # reuse layer
    assert "layers.6.attn.indexer.wk.weight" not in names  # reindex layer: no own keys
    assert not any("hc_head" in n for n in names)


def test_moe_stacks_are_views_and_survive_reload():
    cfg = ModelConfig.tiny()
    model = init_random_(Model(cfg), 1)
    moe = model.layers[0].ffn
    st = moe.stacked()
    assert st["w1.weight"].data_ptr() == moe.experts[0].w1.weight.data_ptr()
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    sd["layers.0.ffn.experts.2.w3.weight"] = torch.ones_like(sd["layers.0.ffn.experts.2.w3.weight"])
    model.load_state_dict(sd, assign=True)
    assert torch.equal(
        moe.stacked()["w3.weight"][2], torch.ones_like(sd["layers.0.ffn.experts.2.w3.weight"])
    )
