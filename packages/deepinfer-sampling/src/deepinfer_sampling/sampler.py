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

import warnings
from dataclasses import dataclass
from functools import partial

import torch

from .batch import RowGroup, SamplingBatch, SamplingRow
from .fused import gumbel_score, kept_weight, penalize, top_p_mask
from .grammar import apply_token_bitmask
from .logprobs import token_logprobs

__all__ = ["Sampler", "SamplerOutput"]


@dataclass
class SamplerOutput:
    """Result of one Sampler call for R rows.

    token_ids: int64 [R].
    logprobs: float32 [R], logprob of each sampled token (None unless some row asked).
    ranks: int64 [R], rank of each sampled token in its row's raw logits (1 = most likely;
        None unless some row asked logprobs).
    has_allowed: bool [R], whether any token survived the grammar mask together with the
        other masks (min_tokens' EOS/stop ids): False is a dead end, and that row's token is
        meaningless. None when no row has a grammar (other masks never empty a row).
    top_logprobs: float32 [R, N], top_token_ids: int64 [R, N]: the N = batch.num_logprobs most
        likely tokens of every row, most likely first (None unless some row asked; rows that
        asked fewer use a prefix).
    """

    token_ids: torch.Tensor
    logprobs: torch.Tensor | None = None
    ranks: torch.Tensor | None = None
    has_allowed: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None
    top_token_ids: torch.Tensor | None = None


class Sampler:
    """Stateless sampler; `Sampler()(logits, batch)` gives a SamplerOutput.

    use_triton: on CUDA, let top-k rows (max top_k <= 256) use the triton kernels of
        topk_triton.py (imported, compiled and checked against the torch path on first use;
        any failure falls back to torch with a warning). False: torch ops only (benchmarks
        compare the two). The tokens are the same either way (see _sample_topk).
    """

    def __init__(self, use_triton: bool = True) -> None:
        self.use_triton = use_triton

    def __call__(
        self,
        logits: torch.Tensor,
        batch: SamplingBatch,
        generator: torch.Generator | None = None,
    ) -> SamplerOutput:
        """Sample one token per row.

        logits: [R, V] any float dtype, on batch.device; not modified.
        generator: source of fresh randomness for rows without a seed (on the CPU or on the
            logits' device); None uses torch's default generator of the logits' device.
        """
        x = self.processed_logits(logits, batch)
        groups = [
            (group, fn)
            for group, fn in (
                (batch.greedy, _sample_greedy),
                (batch.topk, partial(_sample_topk, use_triton=self.use_triton)),
                (batch.top_p, _sample_top_p),
                (batch.plain, _sample_plain),
            )
            if group is not None
        ]
        if len(groups) == 1 and groups[0][0].rows is None:
            group, fn = groups[0]
            token_ids = fn(x, group, batch, generator)
        else:
            token_ids = torch.empty(batch.num_rows, dtype=torch.int64, device=x.device)
            for group, fn in groups:
                token_ids[group.rows] = fn(x[group.rows], group, batch, generator)

        out = SamplerOutput(token_ids=token_ids)
        if batch.grammar_bitmask is not None:
            # Only grammar rows can be emptied (the other masks touch EOS/stop ids only).
            out.has_allowed = torch.ones(batch.num_rows, dtype=torch.bool, device=x.device)
            rows = batch.grammar_rows
            out.has_allowed[rows] = (x.index_select(0, rows) > float("-inf")).any(dim=1)
        if batch.num_logprobs >= 0:
            lp = token_logprobs(logits, token_ids, batch.num_logprobs)
            out.logprobs, out.ranks = lp.logprobs, lp.ranks
            out.top_logprobs, out.top_token_ids = lp.top_logprobs, lp.top_token_ids
        return out

    def processed_logits(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Steps 1-4 (penalties, logit bias, min_tokens, grammar) on a float32 copy.

        logits: [R, V] any float dtype. Returns float32 [R, V] (disallowed tokens at -inf).
        """
        if logits.dim() != 2 or logits.shape != (batch.num_rows, batch.vocab_size):
            raise ValueError(
                f"logits must be [num_rows={batch.num_rows}, vocab={batch.vocab_size}], got "
                f"{tuple(logits.shape)}"
            )
        if not logits.is_floating_point():
            raise ValueError(f"logits must be a float tensor, got {logits.dtype}")
        x = logits.to(torch.float32, copy=True)
        if batch.penalty_token_ids is not None:
            # Only the [R, U] generated tokens are touched, never a whole-vocabulary pass.
            ids = batch.penalty_token_ids
            old = x.gather(1, ids)
            x.scatter_(1, ids, penalize(old, batch.penalty_repetition, batch.penalty_subtract))
        if batch.logit_edits is not None:
            # One scatter kernel (index_put_ with accumulate sorts and asserts on CUDA).
            flat_index, values = batch.logit_edits
            x.view(-1).scatter_add_(0, flat_index, values)
        if batch.grammar_bitmask is not None:
            apply_token_bitmask(x, batch.grammar_bitmask, batch.grammar_rows)
        return x

    def probs(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """The exact distribution each row samples from, float64 [R, V].

        Greedy rows are one-hot at their argmax; other rows are softmax(logits / T) restricted
        to the tokens kept by min-p, top-k and top-p, renormalised. Sorts every row: for
        verification and tests, not the hot path.
        """
        x = self.processed_logits(logits, batch)
        out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
        for group in (batch.topk, batch.top_p, batch.plain):
            if group is None:
                continue
            rows = group.rows if group.rows is not None else slice(None)
            values, ids = torch.sort(x[rows], dim=1, descending=True, stable=True)
            v = values.to(torch.float64) / group.temperature
            weight = torch.where(_keep(v, group), torch.exp(v - v[:, :1]), 0.0)
            out[rows] = torch.zeros_like(weight).scatter_(
                1, ids, weight / weight.sum(dim=1, keepdim=True)
            )
        if batch.greedy is not None:
            group = batch.greedy
            rows = group.rows if group.rows is not None else torch.arange(batch.num_rows)
            rows = rows.to(x.device)
            out[rows] = 0.0
            out[rows, x[rows].argmax(dim=1)] = 1.0
        return out


def _rng_keys(
    group: RowGroup, generator: torch.Generator | None, device: torch.device
) -> torch.Tensor:
    """int64 [4, r]: the group's seeded keys, fresh random keys for its unseeded rows."""
    if group.seeded is None:
        return group.rng_keys
    gen_device = generator.device if generator is not None else device
    fresh = torch.randint(
        0, 1 << 32, (4, group.num_rows), dtype=torch.int64, generator=generator, device=gen_device
    ).to(device)
    return torch.where(group.seeded, group.rng_keys, fresh)


def _sample_greedy(x, group, batch, generator) -> torch.Tensor:
    """x float32 [r, V] -> int64 [r]: argmax (first index on ties)."""
    return x.argmax(dim=1)


def _sample_topk(x, group, batch, generator, use_triton=False) -> torch.Tensor:
    """Rows with a top-k <= candidate_cap: draw among the group's max_top_k candidates.

    On CUDA (max_top_k <= 256, triton present and checked): two triton kernels, group maxima
    over the vocabulary, then the exact top-k from the winning groups fused with the draw
    (topk_triton.py). Otherwise torch.topk + _draw_sorted. Both draw
    with the same float64 arithmetic; they can differ only where torch.topk breaks a tie at the
    k-th logit differently (the kernels keep the lower token id) or a top-p cumulative sum
    rounds differently at the boundary (summation order).
    """
    keys = _rng_keys(group, generator, x.device)
    if use_triton and x.is_cuda and group.max_top_k <= _TRITON_MAX_K:
        topk_draw = _triton_topk_draw(x.device)
        if topk_draw is not None:
            return _run_topk_draw(topk_draw, x, keys, group)
    values, ids = torch.topk(x, group.max_top_k, dim=1, sorted=True)
    tokens, _ = _draw_sorted(values, ids, group, keys)
    return tokens


def _run_topk_draw(topk_draw, x, keys, group: RowGroup, **kwargs) -> torch.Tensor:
    """topk_triton.topk_draw on a top-k group's rows (kwargs: its tuning knobs, e.g. chunk)."""
    return topk_draw(
        x,
        keys,
        group.temperature,
        group.top_k,
        group.top_p,
        group.log_min_p,
        max_top_k=group.max_top_k,
        use_min_p=group.use_min_p,
        use_top_p=group.use_top_p,
        **kwargs,
    )


# Largest max_top_k served by the triton kernels (topk_triton.MAX_K; not imported here, so that
# importing this module never imports triton).
_TRITON_MAX_K = 256
# Lazily loaded triton top-k draw (a cache, not state: its tokens equal the torch path's).
_triton_cache: dict[str, object] = {}


def _triton_topk_draw(device: torch.device):
    """topk_triton.topk_draw once imported and checked on `device`, or None (torch path)."""
    if "fn" in _triton_cache:
        return _triton_cache["fn"]
    if "failed" in _triton_cache:
        return None
    try:
        from .topk_triton import topk_draw

        _check_topk_draw(topk_draw, device, quick=True)
        _triton_cache["fn"] = topk_draw
        return topk_draw
    except Exception as e:  # no triton, no compiler, or a mismatch: keep torch, say so once
        warnings.warn(
            f"deepinfer_sampling: triton top-k kernels unavailable ({e!r}); using torch.topk",
            stacklevel=3,
        )
        _triton_cache["failed"] = True
        return None


def _check_topk_draw(
    topk_draw,
    device: torch.device,
    chunk: int | None = None,
    vocabs: tuple[int, ...] = (20000, 300),
    quick: bool = False,
) -> None:
    """Raise unless topk_draw gives the torch path's tokens on fixed tie-free probes.

    Covers: no filter, min-p only, all filters with per-row top-k, seeded and unseeded keys,
    several stage-1 chunks (vocab 20000) and a vocab below one chunk. Tests pass a small
    `chunk` and `vocabs` (to run it under the triton interpreter on CPU). quick: only the
    all-filters probe at the first vocab (the check on first use: two kernels to compile).
    """
    from .params import SamplingParams

    g = torch.Generator().manual_seed(1234)
    configs = [
        [dict(top_k=50)] * 4,
        [dict(top_k=k, min_p=0.05) for k in (1, 7, 50, 200)],
        [
            dict(top_k=k, top_p=p, min_p=m)
            for k in (2, 30, 64)
            for p in (0.5, 0.9)
            for m in (0.0, 0.1)
        ],
    ]
    if quick:
        configs, vocabs = configs[-1:], vocabs[:1]
    for vocab in vocabs:
        for config in configs:
            rows = [
                SamplingRow(
                    SamplingParams(temperature=0.5 + 0.1 * i, seed=i if i % 3 else None, **c),
                    position=7 * i,
                )
                for i, c in enumerate(config)
            ]
            batch = SamplingBatch.build(rows, vocab_size=vocab, device=device)
            group = batch.topk
            if group is None or group.rows is not None:
                raise ValueError(f"probe vocab {vocab} must exceed every probe top_k")
            # Distinct float32 values per row: no ties for torch.topk to break its own way.
            x = torch.randperm(vocab, generator=g).float().repeat(len(rows), 1) / 40.0
            x = (x + torch.randn(len(rows), 1, generator=g)).to(device)
            keys = _rng_keys(group, torch.Generator(device=device).manual_seed(5), device)
            values, ids = torch.topk(x, group.max_top_k, dim=1, sorted=True)
            want, _ = _draw_sorted(values, ids, group, keys)
            got = _run_topk_draw(topk_draw, x, keys, group, chunk=chunk)
            if not torch.equal(got, want):
                raise RuntimeError(
                    f"triton top-k draw disagrees with torch: {got.tolist()} vs {want.tolist()}"
                )


def _sample_plain(x, group, batch, generator) -> torch.Tensor:
    """Rows with only temperature and min-p: draw over the whole vocabulary, unsorted."""
    keys = _rng_keys(group, generator, x.device)
    columns = torch.arange(x.shape[1], device=x.device)[None, :]
    score = gumbel_score(*_key_words(keys), columns, x, group.temperature)
    if group.use_min_p:
        x_max = x.max(dim=1, keepdim=True).values
        weight = kept_weight(x, x_max, group.temperature, group.log_min_p)
        score = torch.where(weight > 0, score, float("-inf"))
    return score.argmax(dim=1)


def _sample_top_p(x, group, batch, generator) -> torch.Tensor:
    """Rows using top-p without a small top-k: x float32 [r, V] -> int64 [r].

    Tries the batch.candidate_cap most likely tokens first: when the kept set ends inside them
    (the usual case for a language model), nothing is sorted. Rows whose kept set reaches past
    them (or whose top-k is larger than the cap) are redone on the fully sorted row. Both ways
    renormalise top-p by the same whole-vocabulary sum, so the token does not depend on the way.
    """
    vocab = x.shape[1]
    keys = _rng_keys(group, generator, x.device)
    # Mass min-p keeps, in units of exp(v - v_max). Rows with a top-k (necessarily above the
    # cap here) renormalise over their top-k set instead (NaN: the sorted cumulative sum).
    x_max = x.max(dim=1, keepdim=True).values
    total = kept_weight(x, x_max, group.temperature, group.log_min_p).sum(dim=1, keepdim=True)
    if group.use_top_k:
        total = torch.where(group.top_k < vocab, float("nan"), total)
    cap = min(batch.candidate_cap, vocab)
    values, ids = torch.topk(x, cap, dim=1, sorted=True)
    tokens, score = _draw_sorted(values, ids, group, keys, total)
    if cap == vocab:
        return tokens
    # A row is covered when its last candidate is not kept (the kept set is a prefix).
    uncovered = torch.isfinite(score[:, -1]) | torch.isnan(total[:, 0])
    if bool(uncovered.any()):  # a device sync, only on this path
        slow = uncovered.nonzero().squeeze(1)
        values, ids = torch.sort(x[slow], dim=1, descending=True, stable=True)
        tokens[slow], _ = _draw_sorted(
            values, ids, _subgroup(group, slow), keys[:, slow], total[slow]
        )
    return tokens


def _key_words(keys: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """int64 [4, r] -> four int64 [r, 1] views."""
    k = keys[:, :, None]
    return k[0], k[1], k[2], k[3]


def _draw_sorted(
    values: torch.Tensor,
    ids: torch.Tensor,
    group: RowGroup,
    keys: torch.Tensor,
    total: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Filter and draw among candidates sorted by logit, descending.

    values: float32 [r, C] processed logits; ids: int64 [r, C] their token ids; keys: int64
    [4, r]; total: float64 [r, 1] top-p mass (units of exp(v - v_max)), NaN or None: the sum
    over the kept candidates. Gumbel-max: argmax(v - log(-log u)) over kept candidates samples
    softmax(v) renormalised over them; a candidate's u depends only on its token id.
    Returns (token ids int64 [r], masked scores float64 [r, C]; -inf = not kept).
    """
    if group.use_top_k:
        beyond = torch.arange(values.shape[1], device=values.device) >= group.top_k
        values = values.masked_fill(beyond, float("-inf"))
    score = gumbel_score(*_key_words(keys), ids, values, group.temperature)
    if group.use_min_p or group.use_top_p:
        weight = kept_weight(values, values[:, :1], group.temperature, group.log_min_p)
        if group.use_top_p:
            cumulative = torch.cumsum(weight, dim=1)
            mass = cumulative[:, -1:]
            if total is not None:
                mass = torch.where(torch.isnan(total), mass, total)
            score = top_p_mask(score, weight, cumulative, group.top_p * mass)
        else:
            score = torch.where(weight > 0, score, float("-inf"))
    choice = score.argmax(dim=1, keepdim=True)
    return ids.gather(1, choice).squeeze(1), score


def _subgroup(group: RowGroup, index: torch.Tensor) -> RowGroup:
    """The rows `index` (int64 [s], positions within the group) of a group."""
    return RowGroup(
        num_rows=int(index.shape[0]),
        rows=None,
        temperature=group.temperature[index],
        top_k=group.top_k[index],
        top_p=group.top_p[index],
        log_min_p=group.log_min_p[index],
        rng_keys=group.rng_keys[:, index],
        seeded=None,
        use_min_p=group.use_min_p,
        use_top_p=group.use_top_p,
        use_top_k=group.use_top_k,
        max_top_k=group.max_top_k,
    )


def _keep(v: torch.Tensor, group: RowGroup) -> torch.Tensor:
    """bool [r, C]: which candidates survive min-p, top-k and top-p.

    v: float64 [r, C] logits / temperature, sorted descending along each row (so the kept set
    is a prefix). top-p renormalises over what min-p and top-k keep.
    """
    v_max = v[:, :1]
    keep = torch.arange(v.shape[1], device=v.device) < group.top_k
    if group.use_min_p:
        keep = keep & (v >= v_max + group.log_min_p)
    if group.use_top_p:
        weight = torch.where(keep, torch.exp(v - v_max), 0.0)
        cumulative = torch.cumsum(weight, dim=1)
        keep = keep & (cumulative - weight < group.top_p * cumulative[:, -1:])
    return keep
