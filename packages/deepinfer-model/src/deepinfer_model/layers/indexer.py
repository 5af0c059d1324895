"""Lightning indexer of an index-source layer (V4.1 CSA2).

Index keys (owned by kv sources): ``k_j = FP4(rope(k_norm(wk L_j), j*r))`` [index_head_dim].
Index queries: ``q = FP4(rope(wq_b(qr), t))`` [index_n_heads, index_head_dim], no Hadamard.
Scores: ``s_j = sum_h w_h relu(q_h . k_j)`` with ``w = weights_proj(x) / sqrt(Id * IH)``; entry j is
visible to position t iff ``j < (t+1) // r``. The candidate source additionally keeps the top
`candidate_topk_blocks` blocks of `candidate_block_size` entries (pinning the newest block);
later index sources score only inside those blocks. Then top-`index_topk` by score.

Parameters: `wq_b` (FP8 [IH*Id, q_lora_rank]), `weights_proj.weight [IH, D]`; owners also
`wk.weight [Id, head_dim]` and `k_norm.weight [Id]`.

Decode `index_k` semantics (reference §2.4): every index source scores against the index keys
of *its own* kv source (the latest kv source at or before it), always including the entries that
source published in this same step. DeepSeek's reference decode instead lets a ratio-2 owner
whose group is still incomplete fall back to the last published key cache (layer 20's); we do
not reproduce that, so prefill, chunked prefill and decode select identically.

Tie-breaking: entries with equal scores are taken lowest id first, and only entries with a
finite score are ever selected (the reference may pick masked entries when fewer candidates
than top-k exist; with the released config that never happens).
"""

from __future__ import annotations

import torch
from deepinfer_kernels import ops
from torch import nn

from ..config import ModelConfig
from .linear import FP8Linear, Linear, RMSNorm
from .rope import rope_tail
from .rounding import straight_through


class Indexer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, dtype: torch.dtype, device=None) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.ratio = config.compress_ratios[layer_id]
        self.n_heads, self.head_dim = config.index_n_heads, config.index_head_dim
        self.rope_dim = config.qk_rope_head_dim
        self.topk = config.index_topk
        self.owns_k = layer_id in config.kv_source_layer_ids
        self.is_candidate_source = layer_id == config.candidate_source_layer_id
        self.uses_candidates = 0 <= config.candidate_source_layer_id < layer_id
        self.candidate_topk_blocks = config.candidate_topk_blocks
        self.candidate_block_size = config.candidate_block_size
        self.wq_b = FP8Linear(
            config.q_lora_rank, self.n_heads * self.head_dim, config.fp8_block_size, device
        )
        self.weights_proj = Linear(config.hidden_size, self.n_heads, dtype, device)
        if self.owns_k:
            self.wk = Linear(config.head_dim, self.head_dim, dtype, device)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype, device)

    def index_keys(
        self, latent: torch.Tensor, entry: torch.Tensor, inv_freq: torch.Tensor, fake_quant: bool
    ) -> torch.Tensor:
        """latent [M, head_dim] (pre-RoPE), entry ids [M] -> index keys [M, Id]."""
        k = self.k_norm(self.wk(latent))
        k = rope_tail(k, entry * self.ratio, inv_freq, self.rope_dim)
        return straight_through(ops.fake_quant_fp4_ue8m0, k, 32) if fake_quant else k

    def queries(
        self,
        x: torch.Tensor,
        qr: torch.Tensor,
        positions: torch.Tensor,
        inv_freq: torch.Tensor,
        fake_quant: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D], qr [T, q_lora] -> (q [T, IH, Id], weights [T, IH] fp32)."""
        q = self.wq_b(qr).view(-1, self.n_heads, self.head_dim)
        q = rope_tail(q, positions, inv_freq, self.rope_dim)
        if fake_quant:
            q = straight_through(ops.fake_quant_fp4_ue8m0, q, 32)
        w = self.weights_proj(x, torch.float32) * (self.head_dim**-0.5 * self.n_heads**-0.5)
        return q, w

    def select(
        self,
        q: torch.Tensor,
        w: torch.Tensor,
        keys: torch.Tensor,
        positions: torch.Tensor,
        candidates: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One sequence: q [n, IH, Id], w [n, IH], keys [n_c, Id], positions [n].

        Returns (top-k entry ids [n, index_topk] ascending, -1 padded; the candidate mask
        [n, n_c] when this is the candidate source, else None).
        """
        return self._choose(ops.indexer_scores(q, w, keys), positions, candidates)

    def select_batched(
        self,
        q: torch.Tensor,
        w: torch.Tensor,
        keys: torch.Tensor,
        positions: torch.Tensor,
        candidates: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`select` for g sequences of n tokens at once: q [g, n, IH, Id], w [g, n, IH],
        keys [g, N, Id] (each sequence's entries, padded to N with any rows: entries at or past
        a token's visible count never count), positions [g, n], candidates [g, n, N] | None.

        Returns (top-k [g*n, index_topk] sequence-major, candidate masks [g, n, N] | None).
        Scores are `ops.indexer_scores`' math, batched over the sequences.
        """
        g, n = positions.shape
        s = torch.einsum("gthd,gnd->gthn", q.float(), keys.float()).relu_()
        scores = (s * w.float().unsqueeze(-1)).sum(2).flatten(0, 1)  # [g*n, N]
        flat = None if candidates is None else candidates.flatten(0, 1)
        top, cand = self._choose(scores, positions.flatten(), flat)
        return top, None if cand is None else cand.view(g, n, -1)

    def _choose(
        self, scores: torch.Tensor, positions: torch.Tensor, candidates: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """scores [t, N] of rows at `positions` [t] -> (top-k [t, K], candidate mask | None)."""
        lens = (positions + 1) // self.ratio
        cand = None
        if self.is_candidate_source:
            cand = ops.candidate_blocks(
                scores, lens, self.candidate_topk_blocks, self.candidate_block_size
            )
        elif self.uses_candidates:
            if candidates is None:
                raise RuntimeError(f"layer {self.layer_id}: candidate blocks were not computed")
            scores = scores.masked_fill(~candidates, float("-inf"))
        return ops.index_topk(scores, lens, self.topk), cand
