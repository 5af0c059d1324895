"""A plain float64 re-implementation of the V4.1 attention layers (reference §2.2, §2.4),
computed from the layer inputs a forward actually saw; the oracle of test_attention_reference
(every layer, every row) and test_yoco (consumer layers run on some rows, windows floored).

KV fake-quantisation must be off (it is tested in the kernels). FP8 linears are written as
quantise-activation-then-matmul, and so is the grouped `wo_a`: its input, cast to FP8 per token
with one UE8M0 scale per 32 values, as DeepInfer casts it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from deepinfer_kernels import ops, quant

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


@dataclass
class Captured:
    """What one forward showed of each attention layer L: `ins[L]` its input rows (the
    attention norm's output, float64), `outs[L]` its output rows (wo_b's, float64),
    `contexts[L]` the fp32 context its output projection cast to FP8."""

    ins: dict[int, torch.Tensor] = field(default_factory=dict)
    outs: dict[int, torch.Tensor] = field(default_factory=dict)
    contexts: list[torch.Tensor] = field(default_factory=list)


def capture(model, run: Callable[[], object]) -> Captured:
    """Run `run()` (a forward of `model`) and record every backbone layer's attention.

    With the KV fake-quantisation off, the FP8 cast of each layer's context is the only call
    of `ops.fake_quant_fp8_ue8m0`, once per layer in order."""
    cap = Captured()

    def keep(store, i):
        def hook(mod, args, out):
            store[i] = out.detach().double()

        return hook

    handles = []
    for i, layer in enumerate(model.layers):
        assert not layer.attn.fake_quant_kv, "the oracle needs fake_quant_kv=False"
        handles.append(layer.attn_norm.register_forward_hook(keep(cap.ins, i)))
        handles.append(layer.attn.wo_b.register_forward_hook(keep(cap.outs, i)))
    cast = ops.fake_quant_fp8_ue8m0

    def recording_cast(x, block=32):
        cap.contexts.append(x.detach().clone())
        return cast(x, block)

    ops.fake_quant_fp8_ue8m0 = recording_cast
    try:
        run()
    finally:
        ops.fake_quant_fp8_ue8m0 = cast
        for h in handles:
            h.remove()
    assert len(cap.contexts) == len(model.layers)
    return cap


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


def _index_scores(cfg, attn, x_tok, keys, tok):
    """Indexer scores of the token at position `tok` (input row x_tok [D]) at index source
    `attn` against index keys [n]."""
    idx, eps, rd = attn.indexer, cfg.rms_norm_eps, cfg.qk_rope_head_dim
    qr = rms(lin8(x_tok.unsqueeze(0), attn.wq_a), attn.q_norm.weight, eps)
    q = lin8(qr, idx.wq_b).view(idx.n_heads, idx.head_dim)
    q = rope_last(q, tok, attn.inv_freq, rd)
    w = (x_tok @ idx.weights_proj.weight.double().T) * idx.head_dim**-0.5 * idx.n_heads**-0.5
    n_vis = (tok + 1) // attn.ratio
    return [
        sum(float(w[h]) * max(0.0, float(q[h] @ keys[j])) for h in range(idx.n_heads))
        if j < n_vis
        else float("-inf")
        for j in range(len(keys))
    ]


def check_attention_layers(
    cfg,
    model,
    cap: Captured,
    t: int,
    rows: dict[int, list[int]] | None = None,
    floors: dict[int, int] | None = None,
    tol: float = 1e-5,
) -> dict[int, dict[int, list[int]]]:
    """Check every backbone layer's output rows in `cap` against the float64 semantics of one
    sequence of `t` tokens, and return the entries each index source chose, per position.

    rows[L]: the positions of layer L's output rows (default: all t); its input rows are all t
    positions for a kv source (it compresses the whole sequence) and rows[L] otherwise.
    floors[L]: the lowest position layer L's sliding window sees (default 0).
    """
    eps, rd, w_len = cfg.rms_norm_eps, cfg.qk_rope_head_dim, cfg.sliding_window
    entries, ikeys, chosen, cands = {}, {}, {}, {}
    for layer in range(cfg.num_hidden_layers):
        attn = model.layers[layer].attn
        r = cfg.compress_ratios[layer]
        out_pos = list(range(t)) if rows is None or layer not in rows else rows[layer]
        floor = 0 if floors is None else floors.get(layer, 0)
        x = cap.ins[layer]
        in_pos = list(range(t)) if layer in cfg.kv_source_layer_ids else out_pos
        assert x.shape[0] == len(in_pos), f"layer {layer}: {x.shape[0]} input rows"
        row_of = {p: i for i, p in enumerate(in_pos)}
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
            chosen[layer], cands[layer] = {}, {}
            for tok in out_pos:
                sc = _index_scores(cfg, attn, x[row_of[tok]], ikeys[src], tok)
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
                    cands[layer][tok] = {j for b in keep for j in range(b * bs, (b + 1) * bs)}
                elif 0 <= cfg.candidate_source_layer_id < layer:
                    allowed = cands[cfg.candidate_source_layer_id][tok]
                    sc = [s if j in allowed else float("-inf") for j, s in enumerate(sc)]
                chosen[layer][tok] = topk_ids(sc, cfg.index_topk)
        # the attention itself
        n = len(in_pos)
        qr = rms(lin8(x, attn.wq_a), attn.q_norm.weight, eps)
        q = lin8(qr, attn.wq_b).view(n, attn.n_heads, attn.head_dim)
        kv = rms(lin8(x, attn.wkv), attn.kv_norm.weight, eps)
        out = torch.zeros(len(out_pos), attn.n_heads, attn.head_dim, dtype=F64)
        for i, tok in enumerate(out_pos):
            qt = rope_last(q[row_of[tok]], tok, attn.inv_freq, rd)
            keys = [
                rope_last(kv[row_of[s]], s, attn.inv_freq, rd)
                for s in range(max(floor, tok - w_len + 1), tok + 1)
            ]
            if r:
                keys += [
                    entries[cfg.kv_source_of(layer)][j]
                    for j in chosen[cfg.index_source_of(layer)][tok]
                ]
            if not keys:
                continue  # nothing visible: the sink takes all the weight, o = 0
            kk = torch.stack(keys)
            for h in range(attn.n_heads):
                lg = (kk @ qt[h]) * attn.head_dim**-0.5
                den = torch.exp(lg).sum() + math.exp(float(attn.attn_sink[h]))
                out[i, h] = (torch.exp(lg).unsqueeze(1) * kk).sum(0) / den
            out[i] = rope_last(out[i], tok, attn.inv_freq, rd, inverse=True)
        # The context reaching wo_a, then the FP8 cast of the model's own fp32 context: a
        # float64 context would round a value lying within its last bits of an FP8 step to the
        # other side now and then.
        ctx = cap.contexts[layer]
        m = len(out_pos)
        torch.testing.assert_close(
            ctx.double(), out.reshape(m, -1), rtol=tol, atol=tol, msg=f"layer {layer} context"
        )
        acts, scales = quant.act_quant_fp8(ctx, 32)
        assert scales.shape == (m, attn.n_heads * attn.head_dim // 32)
        ctx8 = quant.act_dequant_fp8(acts, scales, F64)
        g = attn.n_groups
        wo_a = attn.wo_a.dequantized(F64).view(g, attn.o_lora_rank, -1)
        o = torch.cat([ctx8.view(m, g, -1)[:, k] @ wo_a[k].T for k in range(g)], dim=1)
        want = lin8(o, attn.wo_b)
        torch.testing.assert_close(cap.outs[layer], want, rtol=tol, atol=tol, msg=f"layer {layer}")
    return chosen
