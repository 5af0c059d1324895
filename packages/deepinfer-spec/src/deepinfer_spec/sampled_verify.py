"""Seeded "sampled-verify": drafts are kept while they equal the target's own seeded sample.

At every verify row the target token ``y_k`` is drawn by the ordinary :class:`Sampler` with the
request's counter-based noise keyed by (seq_seed, position) (stream 0), exactly as a
non-speculative decode step at that position would draw it. Drafts are committed while
``x_k == y_k``; at the first mismatch ``y_k`` is emitted; if all ``K`` match, ``y_K`` (the bonus
row) is emitted. Every emitted token is therefore the token plain seeded sampling would have
produced at its position given the same prefix, so the output equals non-speculative seeded
sampling token for token, whatever the drafts, ``K`` and the batch (reference §2.3).

Because the same :class:`Sampler` call draws ``y``, penalties, min_tokens, logit bias, filters and
the grammar mask apply as in plain decoding, provided each verify row is described with the
prefix it decides after: :func:`verify_sampling_rows` builds those rows (row ``k`` has the drafts
``x_0 .. x_{k-1}`` appended to its output history and a grammar state advanced through them).
Temperature 0 rows are greedy verification.

Unseeded rows also work (the Sampler draws fresh noise; the rule stays lossless because ``y_k``
is a sample of the target given the accepted prefix), but only seeded rows are reproducible.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from deepinfer_sampling import GrammarMatcher, Sampler, SamplingBatch, SamplingParams, SamplingRow

from .verify_batch import DraftLayout, VerifyResult, check_draft_layout, check_verify_inputs


def accept_while_equal(
    cu_num_draft_tokens: torch.Tensor,
    draft_token_ids: torch.Tensor,
    target_token_ids: torch.Tensor,
) -> VerifyResult:
    """Keep each sequence's drafts while they equal the target tokens; emit the first mismatch.

    Args:
        cu_num_draft_tokens: ``[B + 1]`` int64 prefix sums of the draft counts ``K_b >= 0``.
        draft_token_ids: ``[T]`` integer drafts, ``T = sum K_b``.
        target_token_ids: ``[T + B]`` int64 tokens the target chose at each verify row
            (``K_b + 1`` rows per sequence, the last being the bonus row).

    Returns:
        :class:`VerifyResult`.
    """
    layout = check_draft_layout(cu_num_draft_tokens, draft_token_ids)
    rows = draft_token_ids.shape[0] + layout.batch_size
    if target_token_ids.dim() != 1 or target_token_ids.shape[0] != rows:
        raise ValueError(
            f"target_token_ids must be [sum K + B] = [{rows}], got {list(target_token_ids.shape)}"
        )
    return _accept_while_equal(
        layout.to(target_token_ids.device), draft_token_ids, target_token_ids
    )


def _accept_while_equal(
    layout: DraftLayout, draft_token_ids: torch.Tensor, target_token_ids: torch.Tensor
) -> VerifyResult:
    """`accept_while_equal` on checked inputs, `layout` on the device of `target_token_ids`."""
    y = target_token_ids.to(torch.int64)
    x = draft_token_ids.to(y.device, torch.int64)
    match = x == y[layout.target_row_of_draft]
    num_accepted = layout.count_leading_true(match)
    return layout.assemble(x, num_accepted, y[layout.first_target_row + num_accepted])


def verify_sampling_rows(
    params: SamplingParams,
    first_position: int,
    output_token_ids: Sequence[int],
    draft_token_ids: Sequence[int],
    grammar: GrammarMatcher | None = None,
) -> list[SamplingRow]:
    """The ``K + 1`` sampler rows of one sequence's verify step.

    Args:
        params: the request's sampling parameters (its ``seq_seed`` keys the noise).
        first_position: position in the sequence of the token the first verify row decides
            (``len(prompt) + len(output_token_ids)``).
        output_token_ids: tokens generated so far (before the drafts).
        draft_token_ids: the ``K`` drafts.
        grammar: the request's matcher in its current state, or None. It is not modified: row
            ``k`` gets a fork advanced through ``x_0 .. x_{k-1}``. If the grammar rejects draft
            ``x_j``, rows after ``j`` keep the state before ``x_j``: they are never reached,
            since the sampler at row ``j`` cannot emit a disallowed ``x_j``; likewise after a
            draft stop token that ends the grammar.

    Returns:
        ``K + 1`` :class:`SamplingRow` s, row ``k`` at position ``first_position + k`` with the
        drafts ``x_0 .. x_{k-1}`` appended to its output history.
    """
    drafts = [int(t) for t in draft_token_ids]
    history = list(output_token_ids)
    rows: list[SamplingRow] = []
    state = grammar.fork() if grammar is not None else None
    grammar_ok = True
    for k in range(len(drafts) + 1):
        rows.append(
            SamplingRow(
                params=params,
                position=first_position + k,
                output_token_ids=history + drafts[:k],
                grammar=None if state is None else state.fork(),
            )
        )
        if state is not None and grammar_ok and k < len(drafts):
            grammar_ok = state.accept_token(drafts[k])
            if grammar_ok and state.is_terminated():
                # A stop token ends the sequence: later rows are past its end and never
                # emitted; a terminated matcher cannot fill a mask, so they keep the state
                # before the stop token.
                state.rollback(1)
                grammar_ok = False
    return rows


def sampled_verify(
    cu_num_draft_tokens: torch.Tensor,
    draft_token_ids: torch.Tensor,
    target_logits: torch.Tensor,
    sampling_batch: SamplingBatch,
    *,
    sampler: Sampler | None = None,
    generator: torch.Generator | None = None,
) -> VerifyResult:
    """Verify drafts by the target's own seeded samples.

    Args:
        cu_num_draft_tokens: ``[B + 1]`` int64 prefix sums of the draft counts ``K_b >= 0``.
        draft_token_ids: ``[T]`` integer drafts, ``T = sum K_b``.
        target_logits: ``[T + B, V]`` raw target logits, ``K_b + 1`` rows per sequence; the
            sampler applies penalties, temperature, filters and the grammar mask.
        sampling_batch: ``SamplingBatch`` of the ``T + B`` rows, built from
            :func:`verify_sampling_rows` of every sequence in batch order.
        sampler: the :class:`Sampler` to use (default a fresh one).
        generator: noise for unseeded rows (see :meth:`Sampler.__call__`).

    Returns:
        :class:`VerifyResult`; with every row seeded it equals plain seeded sampling.
    """
    layout = check_verify_inputs(cu_num_draft_tokens, draft_token_ids, target_logits)
    if sampling_batch.num_rows != target_logits.shape[0]:
        raise ValueError(
            f"sampling_batch must describe the {target_logits.shape[0]} target rows, has "
            f"{sampling_batch.num_rows}"
        )
    sampler = sampler if sampler is not None else Sampler()
    target_tokens = sampler(target_logits, sampling_batch, generator).token_ids
    return _accept_while_equal(layout, draft_token_ids, target_tokens)
