"""SamplingBatch: the per-step, per-row inputs of the Sampler, as device tensors.

The engine describes each row to sample with a `SamplingRow` (params, position, tokens generated
so far, grammar state) and calls `SamplingBatch.build(rows, vocab_size=..., device=...)` once per
step. All decisions that depend only on parameters (which rows are greedy, which filters any row
uses) are made here on the CPU, so the Sampler's hot path never synchronises with the device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .grammar import GrammarMatcher, allocate_token_bitmask
from .params import SamplingParams
from .rng import STREAM_SAMPLE, row_keys

__all__ = ["CANDIDATE_CAP", "SamplingBatch", "SamplingRow"]

# Rows with 1 <= top_k <= CANDIDATE_CAP sample among torch.topk candidates; other sampling rows
# work on the whole vocabulary.
CANDIDATE_CAP = 1024


@dataclass(frozen=True)
class SamplingRow:
    """One row of logits to sample.

    params: the request's SamplingParams.
    position: index, in the whole sequence (prompt + output), of the token this row decides;
        i.e. len(prompt) + len(output so far) for an ordinary decode step. With `params.seq_seed`
        set, the sampled token is a pure function of (seq_seed, position, this row's logits).
    output_token_ids: tokens generated so far (penalties and min_tokens read them).
    grammar: the request's GrammarMatcher, in the state before this token (None: unconstrained).
    """

    params: SamplingParams
    position: int
    output_token_ids: Sequence[int] = ()
    grammar: GrammarMatcher | None = None


@dataclass
class SamplingBatch:
    """Per-row sampling inputs for logits [R, V], on one device.

    Row groups (LongTensor of row indices; None when empty):
        greedy_rows: temperature == 0 rows (argmax).
        topk_rows: sampling rows with 1 <= top_k <= candidate_cap (sample among top-k candidates).
        full_rows: other sampling rows (whole vocabulary).
    Per-row parameters, float64/int64 [R] (greedy rows hold neutral values):
        temperature, top_k (0 = off), top_p, min_p.
    rng_keys: int64 [4, R] counter-RNG keys of (seq_seed, position, STREAM_SAMPLE); meaningful
        where `seeded` [R] bool is True; other rows get fresh keys from the generator at sampling.
    Penalties (None when no row uses any):
        output_token_ids: int64 [R, L], padded with -1.
        presence_penalty, frequency_penalty, repetition_penalty: float32 [R].
    Sparse edits (None when empty):
        logit_bias: (rows int64 [B], cols int64 [B], values float32 [B]).
        stop_mask: (rows int64 [M], cols int64 [M]): EOS/stop ids banned for rows below min_tokens.
    Grammar (None when no row has one):
        grammar_rows: int64 [G]; grammar_bitmask: int32 [G, ceil(V / 32)].
    Logprobs:
        num_logprobs: -1 when no row asks, else the largest N asked (top-N returned for all rows).
    Flags (Python bools, so the Sampler skips unused filters without device syncs):
        use_top_p, use_min_p: some non-greedy row uses the filter; full_rows_need_sort: a full row
        uses top-p or a top-k above candidate_cap.
    """

    num_rows: int
    vocab_size: int
    device: torch.device
    greedy_rows: torch.Tensor | None
    topk_rows: torch.Tensor | None
    full_rows: torch.Tensor | None
    max_top_k: int
    candidate_cap: int
    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    seeded: torch.Tensor
    all_seeded: bool
    rng_keys: torch.Tensor
    output_token_ids: torch.Tensor | None = None
    presence_penalty: torch.Tensor | None = None
    frequency_penalty: torch.Tensor | None = None
    repetition_penalty: torch.Tensor | None = None
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    stop_mask: tuple[torch.Tensor, torch.Tensor] | None = None
    grammar_rows: torch.Tensor | None = None
    grammar_bitmask: torch.Tensor | None = None
    num_logprobs: int = -1
    use_top_p: bool = False
    use_min_p: bool = False
    full_rows_need_sort: bool = False

    @staticmethod
    def build(
        rows: Sequence[SamplingRow],
        *,
        vocab_size: int,
        device: torch.device | str = "cpu",
        eos_token_ids: Sequence[int] = (),
        candidate_cap: int = CANDIDATE_CAP,
    ) -> SamplingBatch:
        """Build the batch for logits [len(rows), vocab_size] on `device`.

        eos_token_ids: the tokenizer's EOS ids; with each row's stop_token_ids they are banned
        while the row has fewer than min_tokens output tokens.
        Fills grammar bitmasks (CPU, xgrammar) for rows with a grammar.
        candidate_cap: rows with top_k <= candidate_cap sample among top-k candidates, and
            top-p rows first try that many candidates (tests lower it to exercise fallbacks;
            tokens do not depend on it beyond float rounding).
        """
        if candidate_cap < 1:
            raise ValueError(f"candidate_cap must be >= 1, got {candidate_cap}")
        if not rows:
            raise ValueError("rows must not be empty")
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        device = torch.device(device)
        num_rows = len(rows)
        params = [r.params for r in rows]
        for i, r in enumerate(rows):
            if r.position < 0:
                raise ValueError(f"rows[{i}].position must be >= 0, got {r.position}")

        def to_dev(values, dtype):
            return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

        def index(rows_list):
            return to_dev(rows_list, torch.int64) if rows_list else None

        greedy, topk, full = [], [], []
        top_k_eff = []
        for i, p in enumerate(params):
            k = p.top_k if 0 < p.top_k < vocab_size else 0
            top_k_eff.append(k)
            if p.temperature == 0.0:
                greedy.append(i)
            elif 0 < k <= candidate_cap:
                topk.append(i)
            else:
                full.append(i)
        sampling = [i for i in range(num_rows) if params[i].temperature > 0.0]

        seeds = [p.seq_seed if p.seq_seed is not None else 0 for p in params]
        keys = row_keys(
            torch.tensor(seeds, dtype=torch.int64),
            torch.tensor([r.position for r in rows], dtype=torch.int64),
            STREAM_SAMPLE,
        )
        seeded = [p.seq_seed is not None for p in params]

        batch = SamplingBatch(
            num_rows=num_rows,
            vocab_size=vocab_size,
            device=device,
            greedy_rows=index(greedy),
            topk_rows=index(topk),
            full_rows=index(full),
            max_top_k=max((top_k_eff[i] for i in topk), default=0),
            candidate_cap=candidate_cap,
            temperature=to_dev([p.temperature or 1.0 for p in params], torch.float64),
            top_k=to_dev(top_k_eff, torch.int64),
            top_p=to_dev([p.top_p for p in params], torch.float64),
            min_p=to_dev([p.min_p for p in params], torch.float64),
            seeded=to_dev(seeded, torch.bool),
            all_seeded=all(seeded[i] for i in sampling),
            rng_keys=keys.to(device, non_blocking=True),
            use_top_p=any(params[i].top_p < 1.0 for i in sampling),
            use_min_p=any(params[i].min_p > 0.0 for i in sampling),
            full_rows_need_sort=any(params[i].top_p < 1.0 or top_k_eff[i] > 0 for i in full),
        )

        if any(
            p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0 for p in params
        ):
            width = max(1, max(len(r.output_token_ids) for r in rows))
            padded = [
                list(r.output_token_ids) + [-1] * (width - len(r.output_token_ids)) for r in rows
            ]
            batch.output_token_ids = to_dev(padded, torch.int64)
            batch.presence_penalty = to_dev([p.presence_penalty for p in params], torch.float32)
            batch.frequency_penalty = to_dev([p.frequency_penalty for p in params], torch.float32)
            batch.repetition_penalty = to_dev([p.repetition_penalty for p in params], torch.float32)

        bias_rows, bias_cols, bias_vals = [], [], []
        for i, p in enumerate(params):
            for token, value in (p.logit_bias or {}).items():
                if token >= vocab_size:
                    raise ValueError(
                        f"rows[{i}].params.logit_bias key {token} must be < vocab_size {vocab_size}"
                    )
                bias_rows.append(i)
                bias_cols.append(token)
                bias_vals.append(value)
        if bias_rows:
            batch.logit_bias = (
                to_dev(bias_rows, torch.int64),
                to_dev(bias_cols, torch.int64),
                to_dev(bias_vals, torch.float32),
            )

        stop_rows, stop_cols = [], []
        for i, (r, p) in enumerate(zip(rows, params, strict=True)):
            if len(r.output_token_ids) < p.min_tokens:
                banned = {t for t in (*eos_token_ids, *p.stop_token_ids) if t < vocab_size}
                stop_rows.extend([i] * len(banned))
                stop_cols.extend(sorted(banned))
        if stop_rows:
            batch.stop_mask = (to_dev(stop_rows, torch.int64), to_dev(stop_cols, torch.int64))

        grammar_rows = [i for i, r in enumerate(rows) if r.grammar is not None]
        if grammar_rows:
            bitmask = allocate_token_bitmask(len(grammar_rows), vocab_size)
            for g, i in enumerate(grammar_rows):
                rows[i].grammar.fill_bitmask(bitmask, g)
            batch.grammar_rows = index(grammar_rows)
            batch.grammar_bitmask = bitmask.to(device, non_blocking=True)

        asked = [p.logprobs for p in params if p.logprobs is not None]
        batch.num_logprobs = min(max(asked), vocab_size) if asked else -1
        return batch
