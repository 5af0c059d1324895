"""SamplingBatch: the per-step, per-row inputs of the Sampler, as device tensors.

The engine describes each row to sample with a `SamplingRow` (params, position, tokens generated
so far, grammar state) and calls `SamplingBatch.build(rows, vocab_size=..., device=...)` once per
step. Everything that depends only on parameters and token histories (which rows are greedy,
which filters any row uses, penalty counts, RNG keys) is prepared here on the CPU, so the
Sampler's hot path runs few device kernels and never synchronises with the device (except on
the rare top-p fallback, see sampler.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .grammar import GrammarMatcher, allocate_token_bitmask
from .params import SamplingParams
from .rng import STREAM_SAMPLE, row_keys

__all__ = ["CANDIDATE_CAP", "NO_TOP_K", "RowGroup", "SamplingBatch", "SamplingRow"]

# Rows with 1 <= top_k <= CANDIDATE_CAP sample among torch.topk candidates; top-p rows without
# such a top-k first try this many candidates.
CANDIDATE_CAP = 1024
# top_k of rows without a top-k limit, in RowGroup.top_k.
NO_TOP_K = 1 << 62


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
class RowGroup:
    """Rows of a batch that take the same sampling path, with their parameters as columns.

    rows: int64 [r] batch row indices, or None when the group is the whole batch in order.
    temperature: float64 [r, 1] (1 for greedy rows). top_k: int64 [r, 1] (NO_TOP_K = off).
    top_p: float64 [r, 1]. log_min_p: float64 [r, 1], log(min_p) (-inf = off).
    rng_keys: int64 [4, r] counter-RNG keys (seq_seed, position, STREAM_SAMPLE);
    seeded: bool [r] (None when all rows are seeded); unseeded rows draw fresh keys.
    Flags (Python, so unused filters cost nothing): use_min_p, use_top_p, use_top_k (some row's
    top_k is below max_top_k, so a per-row mask is needed), max_top_k (largest top_k).
    """

    num_rows: int
    rows: torch.Tensor | None
    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    log_min_p: torch.Tensor
    rng_keys: torch.Tensor
    seeded: torch.Tensor | None
    use_min_p: bool
    use_top_p: bool
    use_top_k: bool
    max_top_k: int


@dataclass
class SamplingBatch:
    """Per-row sampling inputs for logits [R, V], on one device.

    Row groups (None when empty):
        greedy: temperature == 0 rows (argmax).
        topk: sampling rows with 1 <= top_k <= candidate_cap (sample among top-k candidates).
        top_p: other rows with top-p (or a top-k above candidate_cap): try candidate_cap
            candidates, fall back to sorting the row when its kept set reaches past them.
        plain: rows with at most temperature and min-p (whole vocabulary, no sort).
    Penalties (None when no row uses any), on the unique generated tokens of each row:
        penalty_token_ids: int64 [R, U] unique ids (padding repeats the row's first entry, or
            token 0 with neutral constants),
        penalty_repetition: float32 [R, U], the row's repetition penalty,
        penalty_subtract: float32 [R, U] = frequency * count + presence.
    Sparse edits (None when empty): logit_edits = (flat index row * V + col, int64 [E], values
        float32 [E]) added to the logits: logit_bias values, and -inf for EOS/stop ids of rows
        below min_tokens. A (row, col) appears at most once per kind, so the only repeated index
        adds -inf and a bias, which gives -inf in any order.
    Grammar (None when no row has one): grammar_rows int64 [G], grammar_bitmask int32
        [G, ceil(V / 32)].
    num_logprobs: -1 when no row asks, else the largest N asked (top-N returned for all rows).
    """

    num_rows: int
    vocab_size: int
    device: torch.device
    candidate_cap: int
    greedy: RowGroup | None
    topk: RowGroup | None
    top_p: RowGroup | None
    plain: RowGroup | None
    penalty_token_ids: torch.Tensor | None = None
    penalty_repetition: torch.Tensor | None = None
    penalty_subtract: torch.Tensor | None = None
    logit_edits: tuple[torch.Tensor, torch.Tensor] | None = None
    grammar_rows: torch.Tensor | None = None
    grammar_bitmask: torch.Tensor | None = None
    num_logprobs: int = -1

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
        candidate_cap: rows with top_k <= candidate_cap sample among top-k candidates, and
            top-p rows first try that many candidates (tests lower it to exercise the
            fallbacks; tokens do not depend on it beyond float rounding).
        Fills grammar bitmasks (CPU, xgrammar) for rows with a grammar.
        """
        if not rows:
            raise ValueError("rows must not be empty")
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        if candidate_cap < 1:
            raise ValueError(f"candidate_cap must be >= 1, got {candidate_cap}")
        device = torch.device(device)
        num_rows = len(rows)
        params = [r.params for r in rows]
        for i, r in enumerate(rows):
            if r.position < 0:
                raise ValueError(f"rows[{i}].position must be >= 0, got {r.position}")

        def to_dev(values, dtype):
            return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

        top_k_eff = [p.top_k if 0 < p.top_k < vocab_size else 0 for p in params]
        greedy, topk, top_p, plain = [], [], [], []
        for i, p in enumerate(params):
            if p.temperature == 0.0:
                greedy.append(i)
            elif 0 < top_k_eff[i] <= candidate_cap:
                topk.append(i)
            elif p.top_p < 1.0 or top_k_eff[i] > 0:
                top_p.append(i)
            else:
                plain.append(i)
        keys = row_keys(
            torch.tensor([p.seq_seed or 0 for p in params], dtype=torch.int64),
            torch.tensor([r.position for r in rows], dtype=torch.int64),
            STREAM_SAMPLE,
        )

        def group(members: list[int], candidates_are_top_k: bool = False) -> RowGroup | None:
            if not members:
                return None
            ps = [params[i] for i in members]
            ks = [top_k_eff[i] for i in members]
            limits = [k if k > 0 else NO_TOP_K for k in ks]
            seeded = [p.seq_seed is not None for p in ps]
            return RowGroup(
                num_rows=len(members),
                rows=None if members == list(range(num_rows)) else to_dev(members, torch.int64),
                temperature=to_dev([[p.temperature or 1.0] for p in ps], torch.float64),
                top_k=to_dev([[k] for k in limits], torch.int64),
                top_p=to_dev([[p.top_p] for p in ps], torch.float64),
                log_min_p=to_dev(
                    [[math.log(p.min_p) if p.min_p > 0 else -math.inf] for p in ps],
                    torch.float64,
                ),
                rng_keys=keys[:, members].to(device, non_blocking=True),
                seeded=None if all(seeded) else to_dev(seeded, torch.bool),
                use_min_p=any(p.min_p > 0 for p in ps),
                use_top_p=any(p.top_p < 1.0 for p in ps),
                # Top-k candidates are already cut at max_top_k; a mask is needed only below it.
                use_top_k=min(ks) < max(ks) if candidates_are_top_k else max(ks) > 0,
                max_top_k=max(ks),
            )

        batch = SamplingBatch(
            num_rows=num_rows,
            vocab_size=vocab_size,
            device=device,
            candidate_cap=candidate_cap,
            greedy=group(greedy),
            topk=group(topk, candidates_are_top_k=True),
            top_p=group(top_p),
            plain=group(plain),
        )
        batch._build_penalties(rows, to_dev)
        batch._build_logit_edits(rows, eos_token_ids, to_dev)

        grammar_rows = [i for i, r in enumerate(rows) if r.grammar is not None]
        if grammar_rows:
            bitmask = allocate_token_bitmask(len(grammar_rows), vocab_size)
            for g, i in enumerate(grammar_rows):
                rows[i].grammar.fill_bitmask(bitmask, g)
            batch.grammar_rows = to_dev(grammar_rows, torch.int64)
            batch.grammar_bitmask = bitmask.to(device, non_blocking=True)

        asked = [p.logprobs for p in params if p.logprobs is not None]
        batch.num_logprobs = min(max(asked), vocab_size) if asked else -1
        return batch

    def _build_penalties(self, rows: Sequence[SamplingRow], to_dev) -> None:
        """Unique generated tokens per row with their penalty constants (CPU work)."""
        params = [r.params for r in rows]
        if not any(
            p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0 for p in params
        ):
            return
        ids_rows, rep_rows, sub_rows = [], [], []
        for r, p in zip(rows, params, strict=True):
            counts: dict[int, int] = {}
            for t in r.output_token_ids:
                if not 0 <= t < self.vocab_size:
                    raise ValueError(f"output_token_ids must be in [0, {self.vocab_size}), got {t}")
                counts[t] = counts.get(t, 0) + 1
            ids_rows.append(list(counts))
            rep_rows.append([p.repetition_penalty] * len(counts))
            sub_rows.append([p.frequency_penalty * c + p.presence_penalty for c in counts.values()])
        width = max(1, max(len(ids) for ids in ids_rows))
        for ids, rep, sub in zip(ids_rows, rep_rows, sub_rows, strict=True):
            # Padding repeats the first entry whole (or a neutral edit of token 0): the Sampler
            # scatters computed values, and duplicates then write identical values.
            first = (ids[0], rep[0], sub[0]) if ids else (0, 1.0, 0.0)
            pad = width - len(ids)
            ids.extend([first[0]] * pad)
            rep.extend([first[1]] * pad)
            sub.extend([first[2]] * pad)
        self.penalty_token_ids = to_dev(ids_rows, torch.int64)
        self.penalty_repetition = to_dev(rep_rows, torch.float32)
        self.penalty_subtract = to_dev(sub_rows, torch.float32)

    def _build_logit_edits(
        self, rows: Sequence[SamplingRow], eos_token_ids: Sequence[int], to_dev
    ) -> None:
        """logit_bias entries and min_tokens bans, as one sparse list of additions."""
        edit_rows, edit_cols, edit_vals = [], [], []
        for i, r in enumerate(rows):
            p = r.params
            for token, value in (p.logit_bias or {}).items():
                if token >= self.vocab_size:
                    raise ValueError(
                        f"rows[{i}].params.logit_bias key {token} must be < vocab_size "
                        f"{self.vocab_size}"
                    )
                edit_rows.append(i)
                edit_cols.append(token)
                edit_vals.append(value)
            if len(r.output_token_ids) < p.min_tokens:
                banned = {t for t in (*eos_token_ids, *p.stop_token_ids) if t < self.vocab_size}
                for token in sorted(banned):
                    edit_rows.append(i)
                    edit_cols.append(token)
                    edit_vals.append(-math.inf)  # -inf + any bias stays -inf
        if edit_rows:
            flat = [r * self.vocab_size + c for r, c in zip(edit_rows, edit_cols, strict=True)]
            self.logit_edits = (to_dev(flat, torch.int64), to_dev(edit_vals, torch.float32))
