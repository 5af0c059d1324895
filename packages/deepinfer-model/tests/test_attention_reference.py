"""Every attention layer of the tiny model against a plain float64 re-implementation of the
V4.1 semantics (reference §2.2, §2.4), computed from the layer inputs the model actually saw.

Covers window-only layers, the ratio-2 and ratio-1 kv sources (compressor, RoPE at j*r, index
keys), reuse layers, the candidate source and the re-index layer. KV fake-quantisation is off
(it is tested in the kernels); FP8 linears are written as quantise-activation-then-matmul, and
so is the grouped `wo_a` (its input cast to FP8 per token and 32 values, as in DeepInfer).
"""

import math

import pytest
import torch
from deepinfer_kernels import ops, quant
from deepinfer_model.batch import ForwardBatch
from deepinfer_model.cache import CacheSpec, KVCache
from deepinfer_model.config import ModelConfig
from deepinfer_model.model import Model, init_random_

F64 = torch.float64


def lin8(x, mod):
    """FP8 linear: activations quantised per 32 (UE8M0), weight dequantised, f64 matmul."""
    return quant.fake_quant_fp8_ue8m0(x.float(), 32).double() @ mod.dequantized(F64).T


def rms(x, w, eps):
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * w.double()


def rope_last(v, pos, inv, rd, inverse=False):
    """Rotate adjacent pairs of the last rd dims of a vector by pos * inv (float64)."""
    out = v.clone()
    for i in range(rd // 2):
        ang = float(pos) * float(inv[i])
        c, s = math.cos(ang), (-1 if inverse else 1) * math.sin(ang)
        a, b = v[..., v.shape[-1] - rd + 2 * i], v[..., v.shape[-1] - rd + 2 * i + 1]
        out[..., v.shape[-1] - rd + 2 * i] = a * c - b * s
        out[..., v.shape[-1] - rd + 2 * i + 1] = a * s + b * c
    return out


def topk_ids(scores, k):
    """Best k finite scores, ties to the lower id, returned ascending."""
    cand = sorted((-s, j) for j, s in enumerate(scores) if s != float("-inf"))
    return sorted(j for _, j in cand[:k])


@pytest.fixture(scope="module")
def captured():
    cfg = ModelConfig.tiny()
    model = init_random_(Model(cfg, fake_quant_kv=False), 4)
    model.engram_hasher.set_token_map([i % 300 for i in range(cfg.vocab_size)])
    ins, outs = {}, {}

    def keep(store, i):
        def hook(mod, args, out):
            store[i] = out.detach().double()

        return hook

    # A layer's attention input is its attention norm's output (Block.enter) and its output is
    # wo_b's (Attention.output).
    for i, layer in enumerate(model.layers):
        layer.attn_norm.register_forward_hook(keep(ins, i))
        layer.attn.wo_b.register_forward_hook(keep(outs, i))
    # With the KV fake-quantisation off, the FP8 cast of each layer's context before wo_a is the
    # only call of this op, once per layer in order: record its input.
    contexts = []
    cast = ops.fake_quant_fp8_ue8m0

    def recording_cast(x, block=32):
        contexts.append(x.detach().clone())
        return cast(x, block)

    t = 23
    toks = torch.randint(0, 500, (t,), generator=torch.Generator().manual_seed(7)).tolist()
    spec = CacheSpec.from_config(cfg, block_size=16, dtype=torch.float32)
    ops.fake_quant_fp8_ue8m0 = recording_cast
    try:
        model(
            ForwardBatch.build([toks], [0], [0], [[0, 1]]),
            KVCache(cfg, spec, 4, 1, dtype=torch.float32),
        )
    finally:
        ops.fake_quant_fp8_ue8m0 = cast
    assert len(contexts) == cfg.num_hidden_layers
    return cfg, model, ins, outs, t, contexts


def _latents(cfg, attn, x, t):
    """Compressed latents L_j (pre-RoPE) of a kv source from its input x [t, D]."""
    comp, r = attn.compressor, attn.ratio
    eps = cfg.rms_norm_eps
    if r == 1:
        return [rms(x[j] @ comp.wkv.weight.double().T, comp.norm.weight, eps) for j in range(t)]
    a = x @ comp.wkv.weight.double().T
    z = x @ comp.wgate.weight.double().T
    out = []
    for j in range(t // r):
        zz = z[j * r : j * r + r]
        p = torch.exp(zz - zz.max(0).values) / torch.exp(zz - zz.max(0).values).sum(0)
        out.append(rms((p * a[j * r : j * r + r]).sum(0), comp.norm.weight, eps))
    return out


def _index_scores(cfg, model, layer, ins, keys, tok):
    """Indexer scores of token `tok` at index source `layer` against index keys [n]."""
    attn = model.layers[layer].attn
    idx, x, eps, rd = attn.indexer, ins[layer], cfg.rms_norm_eps, cfg.qk_rope_head_dim
    qr = rms(lin8(x[tok : tok + 1], attn.wq_a), attn.q_norm.weight, eps)
    q = lin8(qr, idx.wq_b).view(idx.n_heads, idx.head_dim)
    q = rope_last(q, tok, attn.inv_freq, rd)
    w = (x[tok] @ idx.weights_proj.weight.double().T) * idx.head_dim**-0.5 * idx.n_heads**-0.5
    n_vis = (tok + 1) // attn.ratio
    return [
        sum(float(w[h]) * max(0.0, float(q[h] @ keys[j])) for h in range(idx.n_heads))
        if j < n_vis
        else float("-inf")
        for j in range(len(keys))
    ]


def test_every_attention_layer_matches_float64_semantics(captured):
    cfg, model, ins, outs, t, contexts = captured
    eps, rd, w_len = cfg.rms_norm_eps, cfg.qk_rope_head_dim, cfg.sliding_window
    entries, ikeys, chosen, cands = {}, {}, {}, {}
    for layer in range(cfg.num_hidden_layers):
        attn = model.layers[layer].attn
        x, r = ins[layer], cfg.compress_ratios[layer]
        if layer in cfg.kv_source_layer_ids:
            lat = _latents(cfg, attn, x, t)
            entries[layer] = [rope_last(v, j * r, attn.inv_freq, rd) for j, v in enumerate(lat)]
            ikeys[layer] = [
                rope_last(
                    rms(v @ attn.indexer.wk.weight.double().T, attn.indexer.k_norm.weight, eps),
                    j * r,
                    attn.inv_freq,
                    rd,
                )
                for j, v in enumerate(lat)
            ]
        if layer in cfg.index_source_layer_ids:
            src = cfg.kv_source_of(layer)
            chosen[layer], cands[layer] = [], []
            for tok in range(t):
                sc = _index_scores(cfg, model, layer, ins, ikeys[src], tok)
                n_vis = (tok + 1) // r
                if layer == cfg.candidate_source_layer_id:
                    bs = cfg.candidate_block_size
                    nb = -(-len(sc) // bs)
                    bscore = [max(sc[b * bs : (b + 1) * bs]) for b in range(nb)]
                    if n_vis:
                        bscore[(n_vis - 1) // bs] = float("inf")
                    keep = [
                        b
                        for b in sorted(range(nb), key=lambda b: (-bscore[b], b))[
                            : cfg.candidate_topk_blocks
                        ]
                        if bscore[b] > float("-inf")
                    ]
                    cands[layer].append({j for b in keep for j in range(b * bs, (b + 1) * bs)})
                elif 0 <= cfg.candidate_source_layer_id < layer:
                    allowed = cands[cfg.candidate_source_layer_id][tok]
                    sc = [s if j in allowed else float("-inf") for j, s in enumerate(sc)]
                chosen[layer].append(topk_ids(sc, cfg.index_topk))
        # the attention itself
        qr = rms(lin8(x, attn.wq_a), attn.q_norm.weight, eps)
        q = lin8(qr, attn.wq_b).view(t, attn.n_heads, attn.head_dim)
        kv = rms(lin8(x, attn.wkv), attn.kv_norm.weight, eps)
        out = torch.zeros(t, attn.n_heads, attn.head_dim, dtype=F64)
        for tok in range(t):
            qt = rope_last(q[tok], tok, attn.inv_freq, rd)
            keys = [
                rope_last(kv[s], s, attn.inv_freq, rd)
                for s in range(max(0, tok - w_len + 1), tok + 1)
            ]
            if r:
                keys += [
                    entries[cfg.kv_source_of(layer)][j]
                    for j in chosen[cfg.index_source_of(layer)][tok]
                ]
            kk = torch.stack(keys)
            for h in range(attn.n_heads):
                lg = (kk @ qt[h]) * attn.head_dim**-0.5
                den = torch.exp(lg).sum() + math.exp(float(attn.attn_sink[h]))
                out[tok, h] = (torch.exp(lg).unsqueeze(1) * kk).sum(0) / den
            out[tok] = rope_last(out[tok], tok, attn.inv_freq, rd, inverse=True)
        # The context reaching wo_a, then its FP8 cast (per token, 32 values per UE8M0 scale,
        # as DeepInfer) of the model's own fp32 context: a float64 context would round a value
        # lying within its last bits of an FP8 step to the other side now and then.
        ctx = contexts[layer]
        torch.testing.assert_close(
            ctx.double(), out.reshape(t, -1), rtol=1e-5, atol=1e-5, msg=f"layer {layer} context"
        )
        acts, scales = quant.act_quant_fp8(ctx, 32)
        assert scales.shape == (t, attn.n_heads * attn.head_dim // 32)
        ctx8 = quant.act_dequant_fp8(acts, scales, F64)
        g = attn.n_groups
        wo_a = attn.wo_a.dequantized(F64).view(g, attn.o_lora_rank, -1)
        o = torch.cat([ctx8.view(t, g, -1)[:, k] @ wo_a[k].T for k in range(g)], dim=1)
        want = lin8(o, attn.wo_b)
        torch.testing.assert_close(outs[layer], want, rtol=1e-5, atol=1e-5, msg=f"layer {layer}")
    # the selections really select (visible > index_topk happens in this sequence)
    assert max(len(c) for c in chosen[2]) == cfg.index_topk
    assert any(len(c) < (tok + 1) // 2 for tok, c in enumerate(chosen[2]))
