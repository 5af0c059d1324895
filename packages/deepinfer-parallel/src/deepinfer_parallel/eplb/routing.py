"""Routing through an EPLB placement: (logical expert, token) -> physical replica slot.

A logical expert with ``c`` replicas sends each token to replica ``hash(key, expert) mod c``.
With ``batch_invariant=True`` the key is (request id, position), so a token lands on the same
replica whatever else is in the batch and wherever its row is; otherwise the key is the row index
(what vLLM does), which spreads load just as well but depends on batch composition.

The hash is murmur3's 32-bit finaliser on int64 tensors, written so that no product exceeds
2**48 (no signed overflow), so it gives the same bits on CPU and GPU.
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF
_GOLDEN32 = 0x9E3779B9


def _mul32(h: torch.Tensor, c: int) -> torch.Tensor:
    """``(h * c) mod 2**32`` for ``h`` in [0, 2**32) without int64 overflow (16-bit halves)."""
    lo = h * (c & 0xFFFF)
    hi = ((h * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & _MASK32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    h = h & _MASK32
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def token_hash(request_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """A 32-bit hash ``[T]`` int64 in [0, 2**32) of each token's (request id, position).

    Args:
        request_ids: ``[T]`` integer request (sequence) ids, any int64 value.
        positions: ``[T]`` integer positions of the tokens in their sequences.
    """
    r = request_ids.to(torch.int64)
    p = positions.to(torch.int64)
    h = _fmix32((r & _MASK32) ^ _GOLDEN32)
    h = _fmix32(h ^ ((r >> 32) & _MASK32))
    h = _fmix32(h ^ (p & _MASK32))
    return _fmix32(h ^ ((p >> 32) & _MASK32))


def select_replicas(
    topk_ids: torch.Tensor,
    log2phy: torch.Tensor,
    logcnt: torch.Tensor,
    *,
    batch_invariant: bool = False,
    request_ids: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Map each token's chosen logical experts to physical slots, for one MoE layer.

    Args:
        topk_ids: ``[T, top_k]`` logical expert ids from the router.
        log2phy: ``[num_logical, max_replicas]`` physical slots of each logical expert, -1 padded
            (one layer of :attr:`ExpertPlacement.log2phy`).
        logcnt: ``[num_logical]`` replica counts (one layer of :attr:`ExpertPlacement.logcnt`).
        batch_invariant: key the replica choice by (request id, position) instead of row index.
        request_ids: ``[T]`` request id of each token row; required when ``batch_invariant``.
        positions: ``[T]`` position of each token in its request; required when
            ``batch_invariant``.

    Returns:
        ``[T, top_k]`` int64 physical slot ids; slot ``out[t, j]`` holds ``topk_ids[t, j]``.
    """
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be [T, top_k], got shape {list(topk_ids.shape)}")
    if log2phy.dim() != 2 or logcnt.dim() != 1 or log2phy.shape[0] != logcnt.shape[0]:
        raise ValueError(
            "log2phy must be [num_logical, max_replicas] and logcnt [num_logical] for one layer, "
            f"got {list(log2phy.shape)} and {list(logcnt.shape)}"
        )
    num_tokens = topk_ids.shape[0]
    if batch_invariant:
        if request_ids is None or positions is None:
            raise ValueError("batch_invariant=True needs request_ids [T] and positions [T]")
        if request_ids.shape != (num_tokens,) or positions.shape != (num_tokens,):
            raise ValueError(
                f"request_ids and positions must be [T] = [{num_tokens}], got "
                f"{list(request_ids.shape)} and {list(positions.shape)}"
            )
        key = token_hash(request_ids.to(topk_ids.device), positions.to(topk_ids.device))
    else:
        key = _fmix32(torch.arange(num_tokens, dtype=torch.int64, device=topk_ids.device))
    ids = topk_ids.to(torch.int64)
    # Mix the expert id in so one token's k experts pick independent replicas.
    h = _fmix32(key[:, None] ^ _mul32(ids, _GOLDEN32))  # [T, top_k]
    replica = h % logcnt.to(ids.device)[ids]
    return log2phy.to(ids.device)[ids, replica]
