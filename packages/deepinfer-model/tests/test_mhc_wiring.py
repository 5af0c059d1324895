"""Single-pass mHC wiring of the whole tiny model in float64 (reference §2.1, V4.1):
attention collapses with the previous FFN site's `pre` (layer 0: one-hot stream 0), the FFN
with this layer's attention `pre`, the head with the last FFN `pre`; Engram adds before its
block; the sublayers themselves are taken as captured (they are tested elsewhere)."""

import math

import torch
from deepinfer_model.batch import ForwardBatch
from deepinfer_model.cache import CacheSpec, KVCache
from deepinfer_model.config import ModelConfig
from deepinfer_model.model import Model, init_random_

F64 = torch.float64


def sinkhorn_site(h, fn, scale, base, cfg):
    """h [T, hc, D] f64 -> pre [T, hc], post [T, hc], comb [T, hc, hc] by plain loops."""
    hc, eps = cfg.hc_mult, cfg.hc_eps
    t = h.shape[0]
    pre, post, comb = (
        torch.zeros(t, hc, dtype=F64),
        torch.zeros(t, hc, dtype=F64),
        torch.zeros(t, hc, hc, dtype=F64),
    )
    flat = h.reshape(t, -1)
    for i in range(t):
        r = 1 / math.sqrt(float(flat[i].square().mean()) + cfg.rms_norm_eps)
        m = (fn.double() @ flat[i]) * r
        s, b = scale.double(), base.double()
        for k in range(hc):
            pre[i, k] = 1 / (1 + math.exp(-(m[k] * s[0] + b[k]))) + eps
            post[i, k] = 2 / (1 + math.exp(-(m[hc + k] * s[1] + b[hc + k])))
        c = (m[2 * hc :] * s[2] + b[2 * hc :]).view(hc, hc)
        c = torch.softmax(c, -1) + eps
        c = c / (c.sum(0, keepdim=True) + eps)
        for _ in range(cfg.hc_sinkhorn_iters - 1):
            c = c / (c.sum(1, keepdim=True) + eps)
            c = c / (c.sum(0, keepdim=True) + eps)
        comb[i] = c
    return pre, post, comb


def rms(x, w, eps):
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * w.double()


def test_single_pass_mhc_wiring_end_to_end():
    cfg = ModelConfig.tiny()
    model = init_random_(Model(cfg, fake_quant_kv=False), 5)
    model.engram_hasher.set_token_map([i % 300 for i in range(cfg.vocab_size)])
    cap: dict[str, torch.Tensor] = {}

    def keep(name):
        def hook(mod, args, out):
            cap[name + ".in"] = (args[0] if args else None).detach().double()
            cap[name + ".out"] = (out[0] if isinstance(out, tuple) else out).detach().double()

        return hook

    def keep_out(name):
        def hook(mod, args, out):
            cap[name] = out.detach().double()

        return hook

    for i, layer in enumerate(model.layers):
        # the attention's input is its norm's output (Block.enter), its output wo_b's
        layer.attn_norm.register_forward_hook(keep_out(f"{i}.attn.in"))
        layer.attn.wo_b.register_forward_hook(keep_out(f"{i}.attn.out"))
        layer.ffn.register_forward_hook(keep(f"{i}.ffn"))
        if layer.engram is not None:
            layer.engram.register_forward_hook(keep(f"{i}.engram"))
    toks = torch.randint(0, 500, (11,), generator=torch.Generator().manual_seed(3)).tolist()
    spec = CacheSpec.from_config(cfg, block_size=16, dtype=torch.float32)
    logits = model(
        ForwardBatch.build([toks], [0], [0], [[0]], logits_rows="all"),
        KVCache(cfg, spec, 2, 1, dtype=torch.float32),
    ).logits.double()

    eps, hc = cfg.rms_norm_eps, cfg.hc_mult
    h = model.embed.weight.double()[toks].unsqueeze(1).repeat(1, hc, 1)
    pre_in = torch.zeros(len(toks), hc, dtype=F64)
    pre_in[:, 0] = 1.0
    for i, layer in enumerate(model.layers):
        if layer.engram is not None:
            torch.testing.assert_close(cap[f"{i}.engram.in"], h, rtol=1e-4, atol=1e-4)
            h = cap[f"{i}.engram.out"]
        a_pre, a_post, a_comb = sinkhorn_site(
            h, layer.hc_attn_fn, layer.hc_attn_scale, layer.hc_attn_base, cfg
        )
        x = rms((pre_in.unsqueeze(-1) * h).sum(1), layer.attn_norm.weight, eps)
        torch.testing.assert_close(
            cap[f"{i}.attn.in"], x, rtol=1e-4, atol=1e-4, msg=f"attn input {i}"
        )
        y = cap[f"{i}.attn.out"]
        h = a_post.unsqueeze(-1) * y.unsqueeze(1) + torch.einsum("tjk,tjd->tkd", a_comb, h)
        f_pre, f_post, f_comb = sinkhorn_site(
            h, layer.hc_ffn_fn, layer.hc_ffn_scale, layer.hc_ffn_base, cfg
        )
        x = rms((a_pre.unsqueeze(-1) * h).sum(1), layer.ffn_norm.weight, eps)
        torch.testing.assert_close(
            cap[f"{i}.ffn.in"], x, rtol=1e-4, atol=1e-4, msg=f"ffn input {i}"
        )
        y = cap[f"{i}.ffn.out"]
        h = f_post.unsqueeze(-1) * y.unsqueeze(1) + torch.einsum("tjk,tjd->tkd", f_comb, h)
        pre_in = f_pre
    final = rms((pre_in.unsqueeze(-1) * h).sum(1), model.norm.weight, eps)
    torch.testing.assert_close(logits, final @ model.head.weight.double().T, rtol=1e-4, atol=1e-4)
