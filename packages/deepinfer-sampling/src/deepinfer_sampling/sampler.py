"""Sampler: logits [R, V] + SamplingBatch -> next token ids (+ logprobs).

Order of operations on each row (float32 working copy of the logits):
    1. penalties on the row's generated tokens: repetition (positive logits / r, negative * r),
       then frequency (- f * count) and presence (- p)
    2. logit_bias (added)
    3. min_tokens: EOS and stop_token_ids -> -inf while the output is shorter than min_tokens
    4. grammar bitmask: disallowed tokens -> -inf
    5. temperature == 0: argmax (first index on ties). Otherwise, in float64 on v = logits / T:
    6. min-p: keep v >= max(v) + log(min_p)   (p >= min_p * p_max)
    7. top-k: keep the k largest
    8. top-p: keep the shortest prefix of the kept tokens, sorted by probability, whose mass
       (renormalised over the kept tokens) reaches top_p
    9. draw: argmax over kept tokens of v + Gumbel(u), u = counter_uniform(seed, position, token
       id, stream 0) for seeded rows (so the token is a pure function of seed, position and the
       row's logits, identical on CPU and CUDA up to float rounding of the logits themselves),
       u from fresh random keys otherwise. Gumbel-max samples exactly softmax over the kept set.

Logprobs are those of the raw model distribution (log_softmax of the input logits, before
penalties, temperature and filters), as vLLM returns by default.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .batch import SamplingBatch
from .grammar import apply_token_bitmask
from .rng import uniform_from_keys

__all__ = ["Sampler", "SamplerOutput"]


@dataclass
class SamplerOutput:
    """Result of one Sampler call for R rows.

    token_ids: int64 [R].
    logprobs: float32 [R], logprob of each sampled token (None unless some row asked).
    top_logprobs: float32 [R, N], top_token_ids: int64 [R, N]: the N = batch.num_logprobs most
        likely tokens of every row, most likely first (None unless some row asked; rows that
        asked fewer use a prefix).
    """

    token_ids: torch.Tensor
    logprobs: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None
    top_token_ids: torch.Tensor | None = None


class Sampler:
    """Stateless sampler; `Sampler()(logits, batch)` gives a SamplerOutput."""

    def __call__(
        self,
        logits: torch.Tensor,
        batch: SamplingBatch,
        generator: torch.Generator | None = None,
    ) -> SamplerOutput:
        """Sample one token per row.

        logits: [R, V] any float dtype, on batch.device; not modified.
        generator: source of fresh randomness for rows without a seed (must live on the CPU or
            on the logits' device); None uses torch's default generator of that device.
        """
        if logits.dim() != 2 or logits.shape != (batch.num_rows, batch.vocab_size):
            raise ValueError(
                f"logits must be [num_rows={batch.num_rows}, vocab={batch.vocab_size}], got "
                f"{tuple(logits.shape)}"
            )
        if not logits.is_floating_point():
            raise ValueError(f"logits must be a float tensor, got {logits.dtype}")
        x = self.processed_logits(logits, batch)
        keys = _rng_keys(batch, generator)
        token_ids = torch.empty(batch.num_rows, dtype=torch.int64, device=x.device)
        if batch.greedy_rows is not None:
            rows = batch.greedy_rows
            token_ids[rows] = x[rows].argmax(dim=1)
        if batch.topk_rows is not None:
            rows = batch.topk_rows
            values, ids = torch.topk(x[rows], batch.max_top_k, dim=1, sorted=True)
            token_ids[rows] = _sample_candidates(values, ids, batch, rows, keys[:, rows])
        if batch.full_rows is not None:
            rows = batch.full_rows
            if batch.full_rows_need_sort:
                token_ids[rows] = _sample_top_p_rows(x[rows], batch, rows, keys[:, rows])
            else:
                token_ids[rows] = _sample_candidates(x[rows], None, batch, rows, keys[:, rows])

        out = SamplerOutput(token_ids=token_ids)
        if batch.num_logprobs >= 0:
            raw = logits.to(torch.float32)
            lse = torch.logsumexp(raw, dim=1, keepdim=True)
            out.logprobs = (raw.gather(1, token_ids[:, None]) - lse).squeeze(1)
            top_values, out.top_token_ids = torch.topk(raw, batch.num_logprobs, dim=1)
            out.top_logprobs = top_values - lse
        return out


    def processed_logits(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Steps 1-4 (penalties, logit bias, min_tokens, grammar) on a float32 copy.

        logits: [R, V] any float dtype. Returns float32 [R, V] (disallowed tokens at -inf).
        """
        x = logits.to(torch.float32, copy=True)
        _apply_penalties(x, batch)
        if batch.logit_bias is not None:
            rows, cols, values = batch.logit_bias
            x.index_put_((rows, cols), values, accumulate=True)
        if batch.stop_mask is not None:
            rows, cols = batch.stop_mask
            x.index_put_((rows, cols), torch.tensor(float("-inf"), device=x.device))
        if batch.grammar_bitmask is not None:
            apply_token_bitmask(x, batch.grammar_bitmask, batch.grammar_rows)
        return x

    def probs(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """The exact distribution each row samples from, float64 [R, V].

        Greedy rows are one-hot at their argmax; other rows are softmax(logits / T) restricted
        to the tokens kept by min-p, top-k and top-p, renormalised. Works on the whole vocabulary
        (sorts every row): for verification and tests, not the hot path.
        """
        x = self.processed_logits(logits, batch)
        out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
        rows = torch.arange(batch.num_rows, device=x.device)
        values, ids = torch.sort(x, dim=1, descending=True, stable=True)
        v = values.to(torch.float64) / batch.temperature[:, None]
        keep = _keep_sorted(v, batch, rows, top_k_possible=True)
        weight = torch.where(keep, torch.exp(v - v[:, :1]), 0.0)
        out.scatter_(1, ids, weight / weight.sum(dim=1, keepdim=True))
        if batch.greedy_rows is not None:
            greedy = batch.greedy_rows
            out[greedy] = 0.0
            out[greedy, x[greedy].argmax(dim=1)] = 1.0
        return out

def _rng_keys(batch: SamplingBatch, generator: torch.Generator | None) -> torch.Tensor:
    """int64 [4, R]: the batch's seeded keys, fresh random keys for unseeded rows."""
    if batch.all_seeded:
        return batch.rng_keys
    gen_device = generator.device if generator is not None else batch.device
    fresh = torch.randint(
        0, 1 << 32, (4, batch.num_rows), dtype=torch.int64, generator=generator, device=gen_device
    ).to(batch.device)
    return torch.where(batch.seeded, batch.rng_keys, fresh)


def _apply_penalties(x: torch.Tensor, batch: SamplingBatch) -> None:
    """Presence, frequency and repetition penalties on x [R, V] in place, touching only the
    [R, L] generated tokens (no full-vocabulary pass)."""
    tokens = batch.output_token_ids
    if tokens is None:
        return
    sorted_tokens, _ = torch.sort(tokens, dim=1)
    valid = sorted_tokens >= 0
    # Occurrences of each token: the width of its run in the sorted row.
    counts = torch.searchsorted(sorted_tokens, sorted_tokens, right=True) - torch.searchsorted(
        sorted_tokens, sorted_tokens, right=False
    )
    first = valid.clone()
    first[:, 1:] &= sorted_tokens[:, 1:] != sorted_tokens[:, :-1]
    cols = sorted_tokens.clamp(min=0)
    old = x.gather(1, cols)
    rep = batch.repetition_penalty[:, None]
    new = torch.where(old > 0, old / rep, old * rep)
    new = new - batch.frequency_penalty[:, None] * counts.to(torch.float32)
    new = new - batch.presence_penalty[:, None]
    # One non-zero delta per (row, token), zeros elsewhere: scatter_add is then exact and
    # order-independent. -inf logits stay -inf.
    delta = torch.where(first & torch.isfinite(old), new - old, 0.0)
    x.scatter_add_(1, cols, delta)


def _sample_candidates(
    values: torch.Tensor,
    ids: torch.Tensor | None,
    batch: SamplingBatch,
    rows: torch.Tensor,
    keys: torch.Tensor,
) -> torch.Tensor:
    """Filter and draw among candidates.

    values: float [r, C] logits of the candidates; sorted descending when top-k/top-p may apply
        (ids given), else the whole vocabulary in id order (ids None, no top-k/top-p).
    ids: int64 [r, C] token ids of the candidates, or None (column = token id).
    rows: int64 [r] batch rows; keys: int64 [4, r] counter-RNG keys.
    Returns int64 [r] token ids.
    """
    v = values.to(torch.float64) / batch.temperature[rows, None]
    keep = _keep_sorted(v, batch, rows, top_k_possible=ids is not None)
    return _draw(v, ids, keep, keys)


def _draw(
    v: torch.Tensor, ids: torch.Tensor | None, keep: torch.Tensor, keys: torch.Tensor
) -> torch.Tensor:
    """Gumbel-max over kept candidates: argmax(v - log(-log u)) ~ softmax(v) restricted to keep.

    v: float64 [r, C]; ids: int64 [r, C] token ids or None (column = token id); keep: bool
    [r, C]; keys: int64 [4, r]. The uniform of a candidate depends only on its token id.
    Returns int64 [r] token ids.
    """
    u = uniform_from_keys(keys, ids if ids is not None else v.shape[1])
    score = torch.where(keep, v - torch.log(-torch.log(u)), float("-inf"))
    choice = score.argmax(dim=1)
    if ids is None:
        return choice
    return ids.gather(1, choice[:, None]).squeeze(1)


def _sample_top_p_rows(
    x: torch.Tensor, batch: SamplingBatch, rows: torch.Tensor, keys: torch.Tensor
) -> torch.Tensor:
    """Rows using top-p without a small top-k: x float32 [r, V] processed logits -> int64 [r].

    Tries the batch.candidate_cap most likely tokens first: when the kept set ends inside them (the
    usual case), nothing is sorted. Rows whose kept set reaches past them (or whose top-k is
    larger than the cap) are redone on the fully sorted row. Both ways use the same
    renormalising mass (a whole-vocabulary sum), so a row's token does not depend on the path.
    """
    num_rows, vocab = x.shape
    temperature = batch.temperature[rows, None]
    v_max = x.max(dim=1, keepdim=True).values.to(torch.float64) / temperature
    # Mass of the tokens min-p keeps, relative to the top token (exp(v - v_max)); rows with a
    # top-k (necessarily > candidate_cap here) renormalise over the top-k set instead (NaN:
    # _keep_sorted then uses the sorted cumulative sum).
    v_all = x.to(torch.float64) / temperature
    weight_all = torch.exp(v_all - v_max)
    if batch.use_min_p:
        weight_all = torch.where(
            v_all >= v_max + torch.log(batch.min_p[rows, None]), weight_all, 0.0
        )
    total = weight_all.sum(dim=1, keepdim=True)
    total = torch.where(batch.top_k[rows, None] == 0, total, float("nan"))

    cap = min(batch.candidate_cap, vocab)
    values, ids = torch.topk(x, cap, dim=1, sorted=True)
    v = values.to(torch.float64) / temperature
    keep = _keep_sorted(v, batch, rows, top_k_possible=True, total=total)
    tokens = _draw(v, ids, keep, keys)
    uncovered = (keep[:, -1] | torch.isnan(total[:, 0])) & (cap < vocab)
    if bool(uncovered.any()):  # a device sync, only on this path
        slow = uncovered.nonzero().squeeze(1)
        values, ids = torch.sort(x[slow], dim=1, descending=True, stable=True)
        v = values.to(torch.float64) / temperature[slow]
        keep = _keep_sorted(v, batch, rows[slow], top_k_possible=True, total=total[slow])
        tokens[slow] = _draw(v, ids, keep, keys[:, slow])
    return tokens

def _keep_sorted(
    v: torch.Tensor,
    batch: SamplingBatch,
    rows: torch.Tensor,
    *,
    top_k_possible: bool,
    total: torch.Tensor | None = None,
) -> torch.Tensor:
    """bool [r, C]: which candidates survive min-p, top-k and top-p.

    v: float64 [r, C] logits / temperature. With top_k_possible, v is sorted descending along
    each row (the kept set is then a prefix); otherwise v is in token order and only min-p may
    apply (the batch guarantees these rows use neither top-k nor top-p).
    total: float64 [r, 1], the mass top-p renormalises by (in units of exp(v - v_max)); NaN or
    None: the sum over the kept candidates.
    """
    v_max = v[:, :1] if top_k_possible else v.max(dim=1, keepdim=True).values
    keep = torch.isfinite(v)
    if batch.use_min_p:
        keep &= v >= v_max + torch.log(batch.min_p[rows, None])
    if top_k_possible:
        top_k = batch.top_k[rows, None]
        position = torch.arange(v.shape[1], device=v.device)
        keep &= (top_k == 0) | (position < top_k)
        if batch.use_top_p:
            weight = torch.where(keep, torch.exp(v - v_max), 0.0)
            cumulative = torch.cumsum(weight, dim=1)
            mass_before = cumulative - weight
            kept_mass = cumulative[:, -1:]
            if total is not None:
                kept_mass = torch.where(torch.isnan(total), kept_mass, total)
            keep &= mass_before < batch.top_p[rows, None] * kept_mass
    return keep
