"""DSpark draft stages (`mtp.0 .. mtp.{n-1}`): window-only blocks that draft a block of tokens.

Per step, for each sequence whose main-model hidden states `hidden` [T, D * n_targets] arrive
(from `Model.forward(..., return_hidden=True)`):
1. ``main_x = main_norm(main_proj(hidden))`` (stage 0's weights) [T, D]; every stage writes
   ``kv_norm(wkv(main_x))`` (roped at the token's position, FP8 fake-quant) into its own
   sliding-window ring. A prefill only seeds these rings.
2. Drafting (when `draft_ids` are given): the block ``[draft_id, noise x (block-1)]`` sits at
   positions ``last+1 .. last+block`` (last = the sequence's newest main position). Its queries
   attend to the stage ring's last `sliding_window` positions plus all block positions (the
   block sees itself bidirectionally). Streams flow through the stages with single-pass mHC.
3. Head: ``logits_i = head(norm(hc_pre(h)))`` (shared with the main model) plus the Markov bias
   ``markov_head.head(markov_head.embed(tok_i))`` where tok_0 = draft_id and tok_i the token
   drafted at i-1 (so drafting is sequential); confidence ``proj(cat(hc_pre(h)_i, embed_i))``.
Stages use theta = rope_theta without YaRN, `dspark_n_routed_experts` experts, top
`dspark_num_experts_per_tok`. Drafting/verification policy belongs to deepinfer-spec.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from deepinfer_kernels import REGISTRY, ops
from torch import nn

from .batch import ForwardBatch
from .cache import KVCache
from .config import ModelConfig
from .layers.attention import Attention, Projections, write_ring
from .layers.block import Block
from .layers.linear import Embedding, FP8Linear, Linear, RMSNorm, dense
from .layers.mhc import identity_pre
from .step_context import StepContext


@dataclass
class DraftContext:
    """Facts of one drafting step: block positions [B*block], their sequence [B*block], each
    sequence's newest main position `last` [B] and `slots` [B]."""

    positions: torch.Tensor
    seq_of: torch.Tensor
    last: torch.Tensor
    slots: torch.Tensor
    block: int


class DSparkAttention(Attention):
    """Window-only attention of a DSpark stage over its ring of main-model KV plus the block."""

    def seed(self, main_x: torch.Tensor, ctx: StepContext, cache: KVCache) -> None:
        """Write ``kv(main_x)`` [T, D] of the main tokens into this stage's ring."""
        write_ring(cache.swa[self.layer_id], ctx, self.project_kv(main_x, ctx.positions))

    def attend(
        self, x: torch.Tensor, p: Projections, dctx: DraftContext, cache: KVCache
    ) -> torch.Tensor:
        """The draft block's core: its projections `p` (q [B*block, H, head_dim], kv
        [B*block, head_dim]) over the stage's ring plus the block -> o [B*block, H, head_dim]
        (`forward` adds the rest)."""
        q, kv = p.q, p.kv
        ring = cache.swa[self.layer_id]
        r_len, n_seq, w = ring.shape[1], dctx.slots.shape[0], self.window
        dev = x.device
        qpos = dctx.last.unsqueeze(1) - w + 1 + torch.arange(w, device=dev)  # [B, W]
        win = torch.where(
            qpos < 0,
            -1,
            torch.arange(n_seq, device=dev).unsqueeze(1) * r_len + qpos.remainder(r_len),
        )
        blk = (
            n_seq * r_len
            + torch.arange(n_seq, device=dev).unsqueeze(1) * dctx.block
            + torch.arange(dctx.block, device=dev)
        )
        idx = torch.cat([win, blk], dim=1)[dctx.seq_of]  # [B*block, W + block]
        pool = torch.cat([ring[dctx.slots].flatten(0, 1).to(x.dtype), kv])
        return ops.sparse_sink_attention(q, pool, idx, self.attn_sink, self.head_dim**-0.5)


class MarkovHead(nn.Module):
    """`embed.weight [vocab, rank]`, `head.weight [vocab, rank]`: ids [B] -> (bias [B, vocab]
    fp32, embedding [B, rank])."""

    def __init__(self, vocab: int, rank: int, dtype: torch.dtype, device=None) -> None:
        super().__init__()
        self.embed = Embedding(vocab, rank, dtype, device)
        self.head = Linear(rank, vocab, torch.float32, device)  # fp32 as the reference

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        emb = self.embed(ids)
        return dense(emb.float(), self.head.weight), emb


class ConfidenceHead(nn.Module):
    """`proj.weight [1, D + rank]` (fp32 math): (x [..., D], markov [..., rank]) -> [...]."""

    def __init__(self, dim: int, dtype: torch.dtype, device=None) -> None:
        super().__init__()
        self.proj = Linear(dim, 1, torch.float32, device)  # fp32 as the reference

    def forward(self, x: torch.Tensor, markov: torch.Tensor) -> torch.Tensor:
        z = torch.cat([x.float(), markov.float()], dim=-1)
        return dense(z, self.proj.weight).squeeze(-1)


class DSparkStage(Block):
    """Stage k: a Block (window-only attention, DSpark MoE) named `mtp.k.*`; stage 0 adds
    `main_proj` (FP8 [D, D*n_targets]) and `main_norm`; the last stage adds `norm`,
    `markov_head.{embed,head}`, `confidence_head.proj`."""

    def __init__(
        self,
        config: ModelConfig,
        stage: int,
        dtype: torch.dtype,
        device=None,
        fake_quant_kv: bool = True,
    ) -> None:
        super().__init__(
            config, config.num_hidden_layers + stage, dtype, device, fake_quant_kv, DSparkAttention
        )
        self.stage = stage
        d = config.hidden_size
        if stage == 0:
            self.main_proj = FP8Linear(
                d * len(config.dspark_target_layer_ids), d, config.fp8_block_size, device
            )
            self.main_norm = RMSNorm(d, config.rms_norm_eps, dtype, device)
        if stage == config.num_nextn_predict_layers - 1:
            self.norm = RMSNorm(d, config.rms_norm_eps, dtype, device)
            self.markov_head = MarkovHead(
                config.vocab_size, config.dspark_markov_rank, dtype, device
            )
            self.confidence_head = ConfidenceHead(d + config.dspark_markov_rank, dtype, device)


@dataclass
class DraftOutput:
    """tokens: [B, block] drafted ids (position last+2 .. last+block+1); logits: [B, block,
    vocab] fp32 (Markov bias included); confidence: [B, block] fp32 (raw logit)."""

    tokens: torch.Tensor
    logits: torch.Tensor
    confidence: torch.Tensor


def confidence_probabilities(config: ModelConfig, confidence: torch.Tensor) -> torch.Tensor:
    """`DraftOutput.confidence` [..., block] raw logits -> [..., block] fp32 probabilities that
    each draft is accepted given the ones before it, ``sigmoid(logit / T_i)`` with the config's
    calibrated per-position temperatures (`dspark_confidence_temperatures`; 1.0 when empty).
    Their cumulative product along the block predicts that the first k drafts all survive."""
    temps = config.dspark_confidence_temperatures or (1.0,) * confidence.shape[-1]
    t = torch.tensor(temps, dtype=torch.float32, device=confidence.device)
    return torch.sigmoid(confidence.float() / t)


def dspark_step(
    model: nn.Module,
    batch: ForwardBatch,
    hidden: torch.Tensor,
    cache: KVCache,
    draft_ids: torch.Tensor | None = None,
    sample: Callable[[torch.Tensor], torch.Tensor] | None = None,
    last_positions: torch.Tensor | None = None,
) -> DraftOutput | None:
    """Seed the stage rings with this step's main hidden states and, if `draft_ids` [B] are
    given, draft one block per sequence (B = sequences of `batch`).

    `batch` is the `ForwardBatch` the main model just ran (positions/slots/cu_seqlens);
    `hidden` [T, D * n_targets] its `ForwardOutput.hidden`. `draft_ids[b]` is the token at
    position last_b + 1 (sampled from the main logits). `sample(logits [B, vocab]) -> ids [B]`
    picks each drafted token (default: argmax). `last_positions` [B]: the newest *accepted*
    main position of each sequence to draft after (default: each sequence's last token in
    `batch`); after a verify, rows of rejected drafts may be in `batch`/`hidden` (they are
    written to the rings by position and simply overwritten later). Returns None when only
    seeding.
    """
    if REGISTRY.batch_invariant and (batch.input_ids.shape[0] > 1):
        return _dspark_per_token(model, batch, hidden, cache, draft_ids, sample, last_positions)
    cfg: ModelConfig = model.config
    stages = list(model.mtp)
    if not stages:
        raise ValueError("model has no DSpark stages (num_nextn_predict_layers = 0)")
    ctx = StepContext.from_batch(batch)
    if hidden.shape != (ctx.num_tokens, cfg.hidden_size * len(cfg.dspark_target_layer_ids)):
        raise ValueError(
            f"hidden: must be [{ctx.num_tokens}, D * n_targets = "
            f"{cfg.hidden_size * len(cfg.dspark_target_layer_ids)}], got {list(hidden.shape)}"
        )
    s0 = stages[0]
    main_x = s0.main_norm(s0.main_proj(hidden.to(model.dtype)))
    for st in stages:
        st.attn.seed(main_x, ctx, cache)
    if draft_ids is None:
        return None
    n_seq, blk, dev = ctx.num_seqs, cfg.dspark_block_size, hidden.device
    if draft_ids.shape != (n_seq,):
        raise ValueError(f"draft_ids: must be [{n_seq}], got {list(draft_ids.shape)}")
    last_cpu = ctx.last_positions_cpu()
    last = ctx.upload(last_cpu)
    if last_positions is not None:
        bad = last_positions.shape != (n_seq,)
        if not bad and last_positions.device.type == "cpu":
            # checked only when given on the host: on the device it would cost a sync
            lp = last_positions.long()
            bad = bool((lp > last_cpu).any()) or bool((lp < 0).any())
        if bad:
            raise ValueError(
                f"last_positions: must be [{n_seq}] positions in [0, last token of the batch]"
            )
        last = last_positions.to(device=dev, dtype=torch.int64, non_blocking=True)
    ids = torch.full((n_seq, blk), cfg.dspark_noise_token_id, dtype=torch.int64, device=dev)
    ids[:, 0] = draft_ids
    dctx = DraftContext(
        positions=(last.unsqueeze(1) + 1 + torch.arange(blk, device=dev)).flatten(),
        seq_of=torch.arange(n_seq, device=dev).repeat_interleave(blk),
        last=last,
        slots=ctx.token["slots"],
        block=blk,
    )
    h = model.embed(ids.flatten()).to(model.dtype).unsqueeze(1).repeat(1, cfg.hc_mult, 1)
    pre = identity_pre(h.shape[0], cfg.hc_mult, dev)
    for st in stages:
        h, pre = st(h, pre, dctx, cache)
    top = stages[-1]
    x = ops.hc_pre(h, pre)  # [B*block, D]
    logits = model.head(top.norm(x)).view(n_seq, blk, -1)
    pick = sample or (lambda lg: lg.argmax(-1))
    tok = draft_ids
    out_ids, embeds = [], []
    for i in range(blk):
        bias, emb = top.markov_head(tok)
        logits[:, i] += bias
        embeds.append(emb)
        tok = pick(logits[:, i])
        out_ids.append(tok)
    conf = top.confidence_head(x.view(n_seq, blk, -1), torch.stack(embeds, dim=1))
    return DraftOutput(tokens=torch.stack(out_ids, dim=1), logits=logits, confidence=conf)


def _dspark_per_token(model, batch, hidden, cache, draft_ids, sample, last_positions):
    """Batch-invariant mode: seed every token alone, then draft each sequence alone."""
    host = batch.host_info()
    n_seq = StepContext.from_batch(batch, host).num_seqs
    if draft_ids is not None and draft_ids.shape != (n_seq,):
        raise ValueError(f"draft_ids: must be [{n_seq}], got {list(draft_ids.shape)}")
    cu = host.cu_seqlens
    outs = []
    for b in range(len(cu) - 1):
        for row in range(cu[b], cu[b + 1]):
            one = batch.token_alone(host, b, row, logits=False)
            last_row = row == cu[b + 1] - 1
            out = dspark_step(
                model,
                one,
                hidden[row : row + 1],
                cache,
                None if draft_ids is None or not last_row else draft_ids[b : b + 1],
                sample,
                None if last_positions is None else last_positions[b : b + 1],
            )
            if out is not None:
                outs.append(out)
    if draft_ids is None:
        return None
    return DraftOutput(
        tokens=torch.cat([o.tokens for o in outs]),
        logits=torch.cat([o.logits for o in outs]),
        confidence=torch.cat([o.confidence for o in outs]),
    )
