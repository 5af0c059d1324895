"""V4.1 attention: a per-layer sliding window plus selected compressed entries, with a sink.

Per layer (all [T, ...] flat over the batch):
1. ``qr = q_norm(wq_a x)``, ``q = wq_b qr -> [H, head_dim]``, RoPE on the last `rope_dim` dims.
2. ``kv = kv_norm(wkv x)``, RoPE, FP8 fake-quant (ue8m0, block 32, all dims); K = V = kv.
3. Keys: the window of the last `sliding_window` positions (ring + this step's tokens), plus, for
   ratio > 0, the entries of the layer's kv source that its index source selected.
4. ``o = sparse_sink_attention(q, keys, scale = head_dim^-0.5)``, inverse RoPE at the query
   position, grouped ``wo_a`` (block-diagonal over `o_groups`, dequantised, no activation
   quantisation as in the reference), then ``wo_b`` (FP8 linear).
kv sources run their `Compressor` and write compressed KV (RoPE at j*r, FP4 with e4m3 scale per
16) and index keys into the pages before anyone reads them.
"""

from __future__ import annotations

import torch
from deepinfer_kernels import ops, quant
from torch import nn

from ..cache import KVCache
from ..config import ModelConfig
from ..forward_batch import StepContext
from .compressor import Compressor
from .indexer import Indexer
from .linear import FP8Linear, RMSNorm, dense
from .rope import layer_inv_freq


def rope_tail(
    x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, rd: int, inverse: bool = False
) -> torch.Tensor:
    """RoPE on the last `rd` dims of x [T, ..., d] (a new tensor)."""
    return torch.cat([x[..., :-rd], ops.rope(x[..., -rd:], positions, inv_freq, inverse)], dim=-1)


def window_indices(ctx: StepContext, window: int, ring_len: int) -> torch.Tensor:
    """[T, window] rows into ``cat([rings of the batch's slots [B*ring], this step's kv [T]])``.

    Token at position p of sequence b sees positions p-window+1 .. p; positions before the
    step come from ring row ``b*ring_len + q % ring_len``, the step's own from ``B*ring_len +
    row``; positions < 0 are -1.
    """
    dev = ctx.positions.device
    seq = ctx.seq_of
    ctx_t = torch.tensor(ctx.ctx, device=dev)[seq].unsqueeze(1)
    start_t = torch.tensor(ctx.starts, device=dev)[seq].unsqueeze(1)
    q = ctx.positions.unsqueeze(1) - window + 1 + torch.arange(window, device=dev)
    from_step = ctx.num_seqs * ring_len + start_t + q - ctx_t
    from_ring = seq.unsqueeze(1) * ring_len + q.remainder(ring_len)
    idx = torch.where(q >= ctx_t, from_step, from_ring)
    lowest = 0 if ctx.floor is None else torch.tensor(ctx.floor, device=dev)[seq].unsqueeze(1)
    return torch.where(q < lowest, -1, torch.where(q < 0, -1, idx))


def write_ring(ring: torch.Tensor, ctx: StepContext, kv: torch.Tensor) -> None:
    """Store this step's kv [T, d] at row p % ring_len of each sequence's slot (newest only)."""
    dev = kv.device
    ring_len = ring.shape[1]
    last = torch.tensor([c + n - 1 for c, n in zip(ctx.ctx, ctx.lens, strict=True)], device=dev)
    keep = ctx.positions > last[ctx.seq_of] - ring_len
    slots = torch.tensor(ctx.slots, device=dev)[ctx.seq_of[keep]]
    ring[slots, ctx.positions[keep] % ring_len] = kv[keep].to(ring.dtype)


class Attention(nn.Module):
    """One layer's attention. Parameters (HF names): `wq_a`, `q_norm`, `wq_b`, `wkv`, `kv_norm`,
    `wo_a`, `wo_b` (FP8 + `.scale`), `attn_sink [H]` fp32; `compressor.*` on kv sources,
    `indexer.*` on index sources. x: [T, D] -> [T, D]."""

    def __init__(
        self,
        config: ModelConfig,
        layer_id: int,
        dtype: torch.dtype,
        device=None,
        fake_quant_kv: bool = True,
    ) -> None:
        super().__init__()
        c = config
        self.config, self.layer_id = c, layer_id
        self.n_heads, self.head_dim, self.rope_dim = (
            c.num_attention_heads,
            c.head_dim,
            c.qk_rope_head_dim,
        )
        self.n_groups, self.o_lora_rank = c.o_groups, c.o_lora_rank
        self.window = c.sliding_window
        self.ratio = c.compress_ratios[layer_id]
        self.fake_quant_kv = fake_quant_kv
        blk = c.fp8_block_size
        self.attn_sink = nn.Parameter(
            torch.zeros(self.n_heads, dtype=torch.float32, device=device), requires_grad=False
        )
        self.wq_a = FP8Linear(c.hidden_size, c.q_lora_rank, blk, device)
        self.q_norm = RMSNorm(c.q_lora_rank, c.rms_norm_eps, dtype, device)
        self.wq_b = FP8Linear(c.q_lora_rank, self.n_heads * self.head_dim, blk, device)
        self.wkv = FP8Linear(c.hidden_size, self.head_dim, blk, device)
        self.kv_norm = RMSNorm(self.head_dim, c.rms_norm_eps, dtype, device)
        self.wo_a = FP8Linear(
            self.n_heads * self.head_dim // self.n_groups,
            self.n_groups * self.o_lora_rank,
            blk,
            device,
        )
        self.wo_b = FP8Linear(self.n_groups * self.o_lora_rank, c.hidden_size, blk, device)
        backbone = layer_id < c.num_hidden_layers
        self.is_kv_source = backbone and layer_id in c.kv_source_layer_ids
        self.is_index_source = backbone and layer_id in c.index_source_layer_ids
        self.kv_source = c.kv_source_of(layer_id) if backbone else -1
        self.index_source = c.index_source_of(layer_id) if backbone else -1
        if self.is_kv_source:
            self.compressor = Compressor(c, layer_id, dtype, device)
        if self.is_index_source:
            self.indexer = Indexer(c, layer_id, dtype, device)
        self.register_buffer("inv_freq", layer_inv_freq(c, self.ratio).to(device), persistent=False)

    # -- pieces shared with the DSpark attention ------------------------------------------------
    def project_q(
        self, x: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D] -> (q [T, H, head_dim] roped, qr [T, q_lora_rank])."""
        qr = self.q_norm(self.wq_a(x))
        q = self.wq_b(qr).view(-1, self.n_heads, self.head_dim)
        return rope_tail(q, positions, self.inv_freq, self.rope_dim), qr

    def project_kv(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [T, D] -> window kv [T, head_dim] (normed, roped, FP8 fake-quantised)."""
        kv = rope_tail(self.kv_norm(self.wkv(x)), positions, self.inv_freq, self.rope_dim)
        return quant.fake_quant_fp8_ue8m0(kv, 32) if self.fake_quant_kv else kv

    def output(self, o: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """o [T, H, head_dim] -> [T, D]: inverse RoPE, grouped wo_a, wo_b."""
        o = rope_tail(o, positions, self.inv_freq, self.rope_dim, inverse=True)
        o = o.reshape(o.shape[0], self.n_groups, -1)
        wo_a = self.wo_a.dequantized(o.dtype).view(self.n_groups, self.o_lora_rank, -1)
        o = torch.stack([dense(o[:, g], wo_a[g]) for g in range(self.n_groups)], dim=1)
        return self.wo_b(o.flatten(1))

    # -- compressed branch ----------------------------------------------------------------------
    def _publish(self, x: torch.Tensor, ctx: StepContext, cache: KVCache) -> None:
        """kv source: compress, write index keys and compressed KV to pages, read them back."""
        latent, seq, entry = self.compressor(x, ctx, cache)
        r = self.ratio
        if latent.shape[0]:
            keys = self.indexer.index_keys(latent, entry, self.inv_freq, self.fake_quant_kv)
            kv = rope_tail(latent, entry * r, self.inv_freq, self.rope_dim)
            if self.fake_quant_kv:
                kv = quant.fake_quant_fp4_e4m3_scale(kv, 16)
            for b in range(ctx.num_seqs):
                sel = seq == b
                if not bool(sel.any()):
                    continue
                pages, rows = cache.entry_location(ctx.block_table(b), entry[sel], r)
                cache.compressed_kv[self.layer_id][pages, rows] = kv[sel].to(cache.dtype)
                cache.index_k[self.layer_id][pages, rows] = keys[sel].to(cache.dtype)
        out = []
        for b in range(ctx.num_seqs):
            n_c = (ctx.ctx[b] + ctx.lens[b]) // r
            ids = torch.arange(n_c, device=x.device)
            pages, rows = cache.entry_location(ctx.block_table(b), ids, r)
            out.append(
                (
                    cache.compressed_kv[self.layer_id][pages, rows].to(x.dtype),
                    cache.index_k[self.layer_id][pages, rows].to(x.dtype),
                )
            )
        ctx.compressed[self.layer_id] = out

    def _select(self, x: torch.Tensor, qr: torch.Tensor, ctx: StepContext) -> None:
        """index source: top-k compressed entries per token -> ctx.topk[layer_id]."""
        q, w = self.indexer.queries(x, qr, ctx.positions, self.inv_freq, self.fake_quant_kv)
        parts, cands = [], []
        for b in range(ctx.num_seqs):
            s, n = ctx.starts[b], ctx.lens[b]
            keys = ctx.compressed[self.kv_source][b][1]
            cand_b = (
                ctx.candidates[b]
                if (ctx.candidates is not None and self.indexer.uses_candidates)
                else None
            )
            top, cand = self.indexer.select(
                q[s : s + n], w[s : s + n], keys, ctx.positions[s : s + n], cand_b
            )
            parts.append(top)
            cands.append(cand)
        ctx.topk[self.layer_id] = torch.cat(parts)
        if self.indexer.is_candidate_source:
            ctx.candidates = cands

    def forward(self, x: torch.Tensor, ctx: StepContext, cache: KVCache) -> torch.Tensor:
        pos = ctx.positions
        q, qr = self.project_q(x, pos)
        kv = self.project_kv(x, pos)
        ring = cache.swa[self.layer_id]
        slots = torch.tensor(ctx.slots, device=x.device)
        pool = [ring[slots].flatten(0, 1).to(x.dtype), kv]
        idx = [window_indices(ctx, self.window, ring.shape[1])]
        if self.ratio > 0:
            if self.is_kv_source:
                self._publish(x, ctx, cache)
            if self.is_index_source:
                self._select(x, qr, ctx)
            top = ctx.topk[self.index_source]  # [T, K] entry ids of the own sequence, -1 = none
            entries = [e for e, _ in ctx.compressed[self.kv_source]]
            base = ring.shape[1] * ctx.num_seqs + x.shape[0]
            offs = torch.tensor([0] + [e.shape[0] for e in entries], device=x.device).cumsum(0)[:-1]
            comp = torch.where(top >= 0, top + base + offs[ctx.seq_of].unsqueeze(1), -1)
            pool.extend(entries)
            idx.append(comp)
        o = ops.sparse_sink_attention(
            q, torch.cat(pool), torch.cat(idx, dim=1), self.attn_sink, self.head_dim**-0.5
        )
        write_ring(ring, ctx, kv)
        return self.output(o, pos)
