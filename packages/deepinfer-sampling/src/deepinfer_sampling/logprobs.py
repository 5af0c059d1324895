"""Log-probabilities of given tokens under raw logits, with their ranks and each row's top N
(what the sampler reports for sampled tokens, and an engine for prompt tokens)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TokenLogprobs:
    """Per row: `logprobs` [R] float32, the natural-log probability of the row's token;
    `ranks` [R] int64, its rank in the row (1 = most likely; ties share the better rank);
    `top_logprobs` [R, N] float32 and `top_token_ids` [R, N] int64, the N most likely."""

    logprobs: torch.Tensor
    ranks: torch.Tensor
    top_logprobs: torch.Tensor
    top_token_ids: torch.Tensor


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_top: int) -> TokenLogprobs:
    """logits [R, V] (any float dtype; log-softmax in float32), token_ids [R] int64 on the same
    device, num_top in [0, V]. Device work only: nothing waits for the device."""
    if logits.dim() != 2 or token_ids.shape != (logits.shape[0],):
        raise ValueError(
            f"token_logprobs: logits must be [R, V] and token_ids [R], got "
            f"{tuple(logits.shape)} and {tuple(token_ids.shape)}"
        )
    if not 0 <= num_top <= logits.shape[1]:
        raise ValueError(
            f"token_logprobs: num_top must be in [0, {logits.shape[1]}], got {num_top}"
        )
    raw = logits.to(torch.float32)
    lse = torch.logsumexp(raw, dim=1, keepdim=True)
    picked = raw.gather(1, token_ids[:, None])
    top_values, top_ids = torch.topk(raw, num_top, dim=1)
    return TokenLogprobs(
        logprobs=(picked - lse).squeeze(1),
        ranks=(raw > picked).sum(dim=1) + 1,
        top_logprobs=top_values - lse,
        top_token_ids=top_ids,
    )
