"""V4.1 attention: a per-layer sliding window plus selected compressed entries, with a sink.

Per layer (all [T, ...] flat over the batch):
1. ``qr = q_norm(wq_a x)``, ``q = wq_b qr -> [H, head_dim]``, RoPE on the last `rope_dim` dims.
2. ``kv = kv_norm(wkv x)``, RoPE, FP8 fake-quant (ue8m0, block 32, all dims); K = V = kv.
3. Keys: the window of the last `sliding_window` positions (ring + this step's tokens), plus, for
   ratio > 0, the entries of the layer's kv source that its index source selected.
4. ``o = sparse_sink_attention(q, keys, scale = head_dim^-0.5)``, inverse RoPE at the query
   position, o cast to FP8 e4m3 per token with one UE8M0 scale per 32 values (as DeepInfer's
   output projection takes it; the inference/model.py reference leaves it unquantised), grouped
   ``wo_a`` (block-diagonal over `o_groups`, dequantised weight), then ``wo_b`` (FP8 linear).
kv sources run their `Compressor` and write compressed KV (RoPE at j*r, FP4 with e4m3 scale per
16) and index keys into the pages before anyone reads them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
from deepinfer_kernels import ops
from torch import nn

from ..cache import KVCache
from ..config import ModelConfig
from ..step_context import CandidateMasks, Compressed, StepContext
from .compressor import Compressor
from .indexer import Indexer
from .linear import FP8Linear, RMSNorm, dense
from .rope import layer_inv_freq, rope_tail
from .rounding import straight_through


def write_ring(ring: torch.Tensor, ctx: StepContext, kv: torch.Tensor) -> None:
    """Store this step's kv [T, d] at row p % ring_len of each sequence's slot (newest only)."""
    rows, slot, ring_row = ctx.ring_write(ring.shape[1])
    ring.index_put_((slot, ring_row), kv.index_select(0, rows).to(ring.dtype))


@dataclass
class Projections:
    """What an attention layer computes per token before touching the cache
    (`Attention.project`), all [T, ...]: q [T, H, head_dim] roped, qr [T, q_lora_rank], kv
    [T, head_dim] the window entry (normed, roped, fake-quantised); on index sources index_q
    [T, IH, Id] and index_w [T, IH] fp32 (`Indexer.queries`); on kv sources comp_a, comp_z
    (`Compressor.project`: values and gate scores [T, head_dim] fp32, or for ratio 1 the latent
    [T, head_dim] and None); on ratio-1 kv sources also entry_kv [T, head_dim] and entry_keys
    [T, index_head_dim], the compressed entry and index key each token closes (with ratio 1
    every token closes entry = its position, so they are per-token work: in the decode graphs,
    not in the eager attention core)."""

    q: torch.Tensor
    qr: torch.Tensor
    kv: torch.Tensor
    index_q: torch.Tensor | None = None
    index_w: torch.Tensor | None = None
    comp_a: torch.Tensor | None = None
    comp_z: torch.Tensor | None = None
    entry_kv: torch.Tensor | None = None
    entry_keys: torch.Tensor | None = None

    def rows(self, n: int) -> Projections:
        """The first n rows of every tensor (views)."""
        values = (getattr(self, f.name) for f in dataclasses.fields(self))
        return Projections(*(None if t is None else t[:n] for t in values))

    def select(self, rows: torch.Tensor) -> Projections:
        """Rows `rows` [T'] (device int64) of every tensor."""
        values = (getattr(self, f.name) for f in dataclasses.fields(self))
        return Projections(*(None if t is None else t.index_select(0, rows) for t in values))


class Attention(nn.Module):
    """One layer's attention. Parameters (HF names): `wq_a`, `q_norm`, `wq_b`, `wkv`, `kv_norm`,
    `wo_a`, `wo_b` (FP8 + `.scale`), `attn_sink [H]` fp32; `compressor.*` on kv sources,
    `indexer.*` on index sources. x: [T, D] -> [T, D] in three parts (`Block` calls them one
    by one): `project` (per token), `attend` (reads and writes the cache), `output` (per token)."""

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
        self.observer: Callable[[Attention, Projections, StepContext], None] | None = None
        """Training hook: called from `attend` with (this layer, its projections, the step
        context) once the layer's compressed entries and top-k are in the context (a training
        script fits the indexer from them: its top-k has no gradient)."""

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
        return straight_through(ops.fake_quant_fp8_ue8m0, kv, 32) if self.fake_quant_kv else kv

    def output(self, o: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """o [T, H, head_dim] -> [T, D]: inverse RoPE, FP8 cast of the context, grouped wo_a,
        wo_b."""
        o = rope_tail(o, positions, self.inv_freq, self.rope_dim, inverse=True)
        # DeepInfer feeds wo_a an FP8 context: e4m3 per token, one UE8M0 scale per 32 values
        # (in training the gradient passes the rounding unchanged, as the KV fake-quant's)
        o = straight_through(ops.fake_quant_fp8_ue8m0, o.reshape(o.shape[0], -1), 32)
        o = o.view(o.shape[0], self.n_groups, -1)
        wo_a = self.wo_a.dequantized(o.dtype).view(self.n_groups, self.o_lora_rank, -1)
        o = torch.stack([dense(o[:, g], wo_a[g]) for g in range(self.n_groups)], dim=1)
        return self.wo_b(o.flatten(1))

    def project(self, x: torch.Tensor, positions: torch.Tensor) -> Projections:
        """x [T, D] at `positions` [T] -> every per-token projection `attend` needs."""
        q, qr = self.project_q(x, positions)
        p = Projections(q, qr, self.project_kv(x, positions))
        if self.is_index_source:
            p.index_q, p.index_w = self.indexer.queries(
                x, qr, positions, self.inv_freq, self.fake_quant_kv
            )
        if self.is_kv_source:
            p.comp_a, p.comp_z = self.compressor.project(x)
            if self.ratio == 1:
                p.entry_kv, p.entry_keys = self._entries(p.comp_a, positions)
        return p

    def _entries(
        self, latent: torch.Tensor, entry: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-RoPE latents [M, head_dim] of entries `entry` [M] -> (compressed kv [M, head_dim]
        (RoPE at entry * ratio, FP4 fake-quantised), index keys [M, index_head_dim])."""
        keys = self.indexer.index_keys(latent, entry, self.inv_freq, self.fake_quant_kv)
        kv = rope_tail(latent, entry * self.ratio, self.inv_freq, self.rope_dim)
        if self.fake_quant_kv:
            kv = straight_through(ops.fake_quant_fp4_e4m3_scale, kv, 16)
        return kv, keys

    # -- compressed branch ----------------------------------------------------------------------
    def publish(self, x: torch.Tensor, p: Projections, ctx: StepContext, cache: KVCache) -> None:
        """kv source: compress, write index keys and compressed KV to pages, read back every
        sequence's entries into `ctx.compressed` (gathers with index tensors built on the host:
        no sync). Once per step: `attend` publishes unless the step's context already holds
        this layer's entries (the YOCO boundary publishes every token's before it cuts the rows
        the consumer layers run). No-op on other layers."""
        if not self.is_kv_source or self.ratio == 0 or self.layer_id in ctx.compressed:
            return
        r, bs = self.ratio, cache.block_size
        done = ctx.completed_entries(r, bs)
        if p.entry_kv is not None:
            # ratio 1: every row closes its entry (done["rows"] is every row, in order)
            kv, keys = p.entry_kv, p.entry_keys
        else:
            latent, _, entry = self.compressor(p.comp_a, p.comp_z, ctx, cache)
            if done["count"]:
                kv, keys = self._entries(latent, entry)
        if done["count"]:
            where = (done["page"], done["page_row"])
            cache.compressed_kv[self.layer_id].index_put_(where, kv.to(cache.dtype))
            cache.index_k[self.layer_id].index_put_(where, keys.to(cache.dtype))
        pages, rows, offsets, counts, token_offsets = ctx.all_entries(r, bs)
        ctx.compressed[self.layer_id] = Compressed(
            cache.compressed_kv[self.layer_id][pages, rows].to(x.dtype),
            cache.index_k[self.layer_id][pages, rows].to(x.dtype),
            offsets,
            counts,
        )
        ctx.memo[("entry_offsets", self.layer_id)] = token_offsets

    # sequences with at most this many new tokens (decode, verify) score their entries batched
    BATCHED_SELECT_MAX_TOKENS = 8

    def _select(self, p: Projections, ctx: StepContext) -> None:
        """index source: top-k compressed entries per token -> ctx.topk[layer_id].

        Sequences with the same small number of new tokens are scored together against their
        own entries, padded ([g, n, max_entries]); longer ones (prefill) alone."""
        q, w = p.index_q, p.index_w
        comp = ctx.compressed[self.kv_source]
        # without candidates a layer that needs them fails in `Indexer.select` (RuntimeError)
        use_cand = ctx.candidates is not None and self.indexer.uses_candidates
        parts = []
        cands = CandidateMasks(ctx.num_seqs)
        groups = ctx.equal_length_groups(self.BATCHED_SELECT_MAX_TOKENS)
        for group in groups:
            if len(group) == 1:
                b = group[0]
                s, n = ctx.starts[b], ctx.lens[b]
                o, c = comp.offsets[b], comp.counts[b]
                top, cand = self.indexer.select(
                    q[s : s + n],
                    w[s : s + n],
                    comp.index_k[o : o + c],
                    ctx.positions[s : s + n],
                    ctx.candidates[b] if use_cand else None,
                )
                cands.set(b, cand)
            else:
                top, cand = self._select_group(q, w, comp, ctx, group, use_cand)
                if cand is not None:
                    ctx.candidate_groups[tuple(group)] = cand
                    cands.set_group(group, cand, comp.counts)
            parts.append(top)
        top = torch.cat(parts) if len(parts) > 1 else parts[0]
        # sequences' rows are contiguous and in sequence order: groups in sequence order keep
        # the flat row order (always so for a decode step: one group)
        if [b for group in groups for b in group] != list(range(ctx.num_seqs)):
            part_rows = [
                r
                for group in groups
                for b in group
                for r in range(ctx.starts[b], ctx.starts[b] + ctx.lens[b])
            ]
            order = torch.empty(ctx.num_tokens, dtype=torch.int64)
            order[torch.tensor(part_rows)] = torch.arange(ctx.num_tokens)
            top = top.index_select(0, ctx.upload(order))
        ctx.topk[self.layer_id] = top
        if self.indexer.is_candidate_source:
            ctx.candidates = cands

    def _select_group(
        self,
        q: torch.Tensor,
        w: torch.Tensor,
        comp: Compressed,
        ctx: StepContext,
        group: list[int],
        use_cand: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`Indexer.select_batched` for sequences `group` of n new tokens each:
        (top-k [g*n, K] in group order, candidate masks [g, n, max_entries] | None)."""
        g, n = len(group), ctx.lens[group[0]]
        width = max(comp.counts[b] for b in group)
        rows, ent = self._group_rows(ctx, group, comp.offsets, comp.counts)
        qg = (q if rows is None else q.index_select(0, rows)).view(g, n, *q.shape[1:])
        wg = (w if rows is None else w.index_select(0, rows)).view(g, n, -1)
        pg = (ctx.positions if rows is None else ctx.positions.index_select(0, rows)).view(g, n)
        keys = comp.index_k[ent] if width else comp.index_k.new_zeros(g, 0, comp.index_k.shape[1])
        cand = None
        if use_cand:
            cand = ctx.candidate_groups.get(tuple(group))
            if cand is None or cand.shape[2] != width:
                cand = torch.stack(
                    [
                        torch.nn.functional.pad(ctx.candidates[b], (0, width - comp.counts[b]))
                        for b in group
                    ]
                )
        return self.indexer.select_batched(qg, wg, keys, pg, cand)

    def _group_rows(
        self, ctx: StepContext, group: list[int], offsets: list[int], counts: list[int]
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Device (flat rows [g*n] of sequences `group`, None when that is every row in order;
        entry rows [g, max count] into the kv source's `Compressed`, whose per-sequence
        `offsets`/`counts` are given). Host-built once per step and kv source."""

        def build():
            g, n = len(group), ctx.lens[group[0]]
            width = max(counts[b] for b in group)
            rows = torch.tensor([ctx.starts[b] + i for b in group for i in range(n)])
            off = torch.tensor([offsets[b] for b in group]).unsqueeze(1)
            last = torch.tensor([offsets[b] + max(counts[b], 1) - 1 for b in group])
            # A sequence with no entries yet points past its own range; keep its (fully masked)
            # padding reads inside the step's entries.
            total = sum(counts)
            ent = torch.minimum(off + torch.arange(width), last.unsqueeze(1)).clamp(0, total - 1)
            whole = rows.tolist() == list(range(ctx.num_tokens))
            packed = ctx.upload(torch.cat([rows, ent.flatten()]))
            return (None if whole else packed[: g * n]), packed[g * n :].view(g, width)

        return ctx.memoized(("select_group", tuple(group), self.kv_source), build)

    def prepare(self, ctx: StepContext, cache: KVCache) -> None:
        """Build the host-side index tensors `attend` will use in this step now (the model
        calls this for every layer before the first one runs, so that on CUDA they all travel
        in one host->device copy: `StepContext.staged`). Only host work: nothing is launched."""
        bs = cache.block_size
        ctx.ring_write(cache.swa[self.layer_id].shape[1])
        if self.ratio == 0:
            return
        if self.is_kv_source:
            done = ctx.completed_entries(self.ratio, bs)
            ctx.all_entries(self.ratio, bs)
            if self.ratio > 1:
                s_len = cache.comp_kv[self.layer_id].shape[1]
                if done["count"]:
                    ctx.group_sources(self.ratio, s_len)
                ctx.ring_write(s_len)
        if self.is_index_source:
            _, _, offsets, counts, _ = ctx.all_entries(
                self.config.compress_ratios[self.kv_source], bs
            )
            for group in ctx.equal_length_groups(self.BATCHED_SELECT_MAX_TOKENS):
                if len(group) > 1:
                    self._group_rows(ctx, group, offsets, counts)

    def forward(self, x: torch.Tensor, ctx: StepContext, cache: KVCache) -> torch.Tensor:
        """The whole layer, x [T, D] -> [T, D]: `project`, `attend`, `output` (`ctx` may be a
        DSpark draft context: anything with `positions`)."""
        pos = ctx.positions
        return self.output(self.attend(x, self.project(x, pos), ctx, cache), pos)

    def attend(
        self, x: torch.Tensor, p: Projections, ctx: StepContext, cache: KVCache
    ) -> torch.Tensor:
        """The part that reads and writes the cache: x [T, D] and its projections `p` ->
        o [T, H, head_dim] before `output`. Everything else of the layer is per token (the
        CUDA-graph pieces of a decode step)."""
        ring = cache.swa[self.layer_id]
        pool = [ring[ctx.token["slots"]].flatten(0, 1).to(x.dtype), p.kv]
        idx = [ctx.window(self.window, ring.shape[1])]
        if self.ratio > 0:
            self.publish(x, p, ctx, cache)
            if self.is_index_source:
                self._select(p, ctx)
            if self.observer is not None:
                self.observer(self, p, ctx)
            top = ctx.topk[self.index_source]  # [T, K] entry ids of the own sequence, -1 = none
            comp = ctx.compressed[self.kv_source]
            base = ring.shape[1] * ctx.num_seqs + x.shape[0]
            offs = ctx.entry_offsets(self.kv_source)
            idx.append(torch.where(top >= 0, top + base + offs.unsqueeze(1), -1))
            pool.append(comp.kv)
        o = ops.sparse_sink_attention(
            p.q, torch.cat(pool), torch.cat(idx, dim=1), self.attn_sink, self.head_dim**-0.5
        )
        write_ring(ring, ctx, p.kv)
        return o
