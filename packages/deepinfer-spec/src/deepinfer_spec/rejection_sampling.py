"""Lossless speculative verification by rejection sampling (the exact chain rule).

For each sequence, draft ``x_k`` (drawn from the draft distribution ``q_k``) is accepted when
``q_k(x_k) > 0`` and ``p_k(x_k) >= u_k * q_k(x_k)`` with ``u_k ~ U(0, 1)``, i.e. with probability
``min(1, p/q)``. At the first rejection the next token is drawn from ``norm((p_k - q_k)+)``
(falling back to ``p_k`` if that is empty) and the rest is dropped; when every draft is accepted
the bonus token is drawn from ``p_{K+1}``. The emitted tokens are then distributed exactly as
sampling from the target alone (reference §2.1). One-hot drafts (``draft_probs=None``) are the
case ``q_k = onehot(x_k)``: accept with probability ``p_k(x_k)``, resample from ``p_k`` with
``x_k`` removed.

Randomness. With ``seeds`` every draw is a counter-based uniform keyed by (seed, position of the
decided token), so the result does not depend on the batch: the accept coin uses stream
``STREAM_SPEC_ACCEPT`` (1) and the residual/bonus draw stream ``STREAM_SPEC_RESIDUAL`` (2), both
disjoint from the sampler's stream 0 and the drafter's stream 3. Each (seed, position) coin
influences the output at most once, because a position whose coin was looked at is decided in that
step. Note the *output* still depends on the drafts and on K (that is what rejection sampling
is); for outputs equal to plain seeded sampling use :func:`deepinfer_spec.sampled_verify`.
Without seeds the draws come from ``generator`` (or torch's default generator).
"""

from __future__ import annotations

import torch
from deepinfer_sampling.rng import STREAM_SPEC_ACCEPT, STREAM_SPEC_RESIDUAL, counter_uniform

from .verify_batch import VerifyResult, check_row_keys, check_verify_inputs


def _uniforms(
    rows: int,
    columns: int,
    seeds: torch.Tensor | None,
    positions: torch.Tensor | None,
    stream: int,
    generator: torch.Generator | None,
    device: torch.device,
) -> torch.Tensor:
    """``[rows, columns]`` float64 uniforms in (0, 1): counter-based if seeded, else generator."""
    if seeds is not None:
        return counter_uniform(seeds, positions, columns, stream=stream).to(device)
    # torch.rand is in [0, 1); keep it off 0 so -log(u) stays finite and u*q > 0.
    u = torch.rand(rows, columns, dtype=torch.float64, generator=generator, device=device)
    return u.clamp_min_(torch.finfo(torch.float64).tiny)


def sample_from_weights(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One draw per row from unnormalised non-negative ``weights [R, V]`` by the exponential race.

    ``argmax_v weights[v] / -log(u[v])`` with ``u [R, V]`` uniform in (0, 1) picks ``v`` with
    probability ``weights[v] / sum(weights)`` (it is Gumbel-max, ``log w - log(-log u)``, without
    the log of zero weights). Returns ``[R]`` int64.
    """
    race = weights.to(torch.float64) / (-torch.log(uniforms))
    return race.argmax(dim=-1)


def rejection_sample(
    cu_num_draft_tokens: torch.Tensor,
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    *,
    seeds: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    greedy: torch.Tensor | None = None,
) -> VerifyResult:
    """Verify a flat varlen batch of drafts by lossless rejection sampling.

    Args:
        cu_num_draft_tokens: ``[B + 1]`` int64 prefix sums of the draft counts ``K_b >= 0``.
        draft_token_ids: ``[T]`` integer draft tokens, ``T = sum K_b``.
        draft_probs: ``[T, V]`` the (final, processed) distribution each draft was drawn from, or
            ``None`` for one-hot drafts (e.g. argmax MTP drafts). Same device as
            ``target_probs``; the other index tensors may live on the CPU.
        target_probs: ``[T + B, V]`` final target distributions, ``K_b + 1`` rows per sequence
            (see :mod:`deepinfer_spec.verify_batch`). Rows should sum to 1.
        seeds: ``[B]`` int64 per-sequence seeds; makes every draw a counter-based function of
            (seed, position). ``None``: draw from ``generator``.
        positions: ``[T + B]`` int64, position in its sequence of the token each target row
            decides; required with ``seeds``.
        generator: torch generator for the unseeded draws, on the device of ``target_probs``
            (ignored with ``seeds``).
        greedy: ``[B]`` bool, sequences at temperature 0: accept a draft iff it is the target's
            argmax and emit the argmax (the exact limit of the rule for one-hot ``p``).

    Returns:
        :class:`VerifyResult` with ``num_accepted [B]``, ``next_token_ids [B]`` and
        ``output_token_ids [B, max_K + 1]``.
    """
    layout = check_verify_inputs(cu_num_draft_tokens, draft_token_ids, target_probs, draft_probs)
    batch, total = layout.batch_size, draft_token_ids.shape[0]
    check_row_keys(seeds, positions, batch, total + batch)
    greedy = _check_greedy(greedy, batch, target_probs.device)
    device = target_probs.device
    x = draft_token_ids.to(device, torch.int64)
    if seeds is not None:
        seeds, positions = seeds.to(device), positions.to(device)
    vocab = target_probs.shape[1]

    # 1. Accept coins, one per draft row, keyed by the position the draft would occupy.
    p_x = target_probs[layout.target_row_of_draft, x].to(torch.float64)
    if draft_probs is None:
        q_x = torch.ones_like(p_x)
    else:
        q_x = draft_probs[torch.arange(total, device=device), x].to(torch.float64)
    u = _uniforms(
        total,
        1,
        None if seeds is None else seeds[layout.seq_of_draft],
        None if positions is None else positions[layout.target_row_of_draft],
        STREAM_SPEC_ACCEPT,
        generator,
        device,
    )[:, 0]
    accept = (q_x > 0) & (p_x >= u * q_x)
    any_greedy = greedy is not None and bool(greedy.any())
    if any_greedy:
        target_argmax = target_probs.argmax(dim=-1)  # [T + B]; ties go to the lowest token id
        is_greedy = greedy[layout.seq_of_draft]
        accept = torch.where(is_greedy, x == target_argmax[layout.target_row_of_draft], accept)
    num_accepted = layout.count_leading_true(accept)

    # 2. One draw per sequence at the row after the accepted prefix: the residual at the first
    # rejection, or p itself for the bonus token.
    all_accepted = num_accepted == layout.num_drafts
    next_row = layout.first_target_row + num_accepted  # [B] target rows
    weights = target_probs[next_row].to(torch.float64)  # [B, V]
    first_draft_row = layout.first_target_row - torch.arange(batch, device=device)  # cu[:-1]
    rejected_draft = (first_draft_row + num_accepted).clamp_max(max(total - 1, 0))
    if total:
        if draft_probs is None:
            q = torch.zeros_like(weights)
            q[torch.arange(batch, device=device), x[rejected_draft]] = 1.0
        else:
            q = draft_probs[rejected_draft].to(torch.float64)
        residual = (weights - q).clamp_min_(0.0)
        empty = residual.sum(dim=-1) <= 0  # p <= q everywhere: fall back to p
        use_residual = (~all_accepted & ~empty)[:, None]
        weights = torch.where(use_residual, residual, weights)
    draw_u = _uniforms(
        batch,
        vocab,
        seeds,
        None if positions is None else positions[next_row],
        STREAM_SPEC_RESIDUAL,
        generator,
        device,
    )
    next_tokens = sample_from_weights(weights, draw_u)
    if any_greedy:
        next_tokens = torch.where(greedy, target_argmax[next_row], next_tokens)
    return layout.assemble(x, num_accepted, next_tokens)


def _check_greedy(
    greedy: torch.Tensor | None, batch: int, device: torch.device
) -> torch.Tensor | None:
    """Check ``greedy [B]`` bool and move it to ``device``; None (no greedy sequence) stays None."""
    if greedy is None:
        return None
    if greedy.dtype != torch.bool or tuple(greedy.shape) != (batch,):
        raise ValueError(
            f"greedy must be a bool tensor [B] = [{batch}], got dtype {greedy.dtype}, shape "
            f"{list(greedy.shape)}"
        )
    return greedy.to(device)
