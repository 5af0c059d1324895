"""Greedy verification (temperature 0): keep drafts while they equal the target's argmax.

This is the exact special case of both rejection sampling and sampled-verify when every target
distribution is one-hot at its argmax: a draft is accepted iff it is the argmax, and the next
token is the argmax of the row after the accepted prefix. Ties go to the lowest token id
(``torch.argmax``), as in the sampler's greedy path.
"""

from __future__ import annotations

import torch

from .sampled_verify import _accept_while_equal
from .verify_batch import VerifyResult, check_verify_inputs


def greedy_verify(
    cu_num_draft_tokens: torch.Tensor,
    draft_token_ids: torch.Tensor,
    target_scores: torch.Tensor,
) -> VerifyResult:
    """Verify drafts against the target argmax.

    Args:
        cu_num_draft_tokens: ``[B + 1]`` int64 prefix sums of the draft counts ``K_b >= 0``.
        draft_token_ids: ``[T]`` integer draft tokens, ``T = sum K_b``.
        target_scores: ``[T + B, V]`` target logits or probabilities (only the argmax matters),
            ``K_b + 1`` rows per sequence.

    Returns:
        :class:`VerifyResult`.
    """
    layout = check_verify_inputs(cu_num_draft_tokens, draft_token_ids, target_scores)
    # Ties go to the lowest token id, as in the sampler's greedy rows.
    return _accept_while_equal(layout, draft_token_ids, target_scores.argmax(dim=-1))
