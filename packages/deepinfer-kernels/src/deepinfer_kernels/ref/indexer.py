"""The lightning indexer's scores, top-k and candidate blocks, in torch (the `ref` tier)."""

from __future__ import annotations

import torch


def indexer_scores(
    q: torch.Tensor, weights: torch.Tensor, k: torch.Tensor, *, batch_invariant: bool = False
) -> torch.Tensor:
    """``score[t, n] = sum_h weights[t, h] * relu(q[t, h] . k[n])``.

    q: [T, IH, Id]; weights: [T, IH] (already scaled); k: [N, Id]. Returns [T, N] fp32.
    """
    if q.dim() != 3 or k.dim() != 2 or q.shape[-1] != k.shape[-1]:
        raise ValueError(
            "indexer_scores: q [T,IH,Id] and k [N,Id] expected, "
            f"got {list(q.shape)}, {list(k.shape)}"
        )
    kt = k.float().t()
    if batch_invariant:
        s = torch.stack([q[i].float() @ kt for i in range(q.shape[0])]).relu_()
    else:
        s = torch.einsum("thd,nd->thn", q.float(), k.float()).relu_()
    return (s * weights.float().unsqueeze(-1)).sum(1)


def index_topk(scores: torch.Tensor, lens: torch.Tensor, topk: int) -> torch.Tensor:
    """Per row, the `topk` best entries among the first `lens[t]` with a finite score.

    scores: [T, N]; lens: [T] int (visible entries per row). Returns [T, topk] int64, chosen
    entry ids in ascending order, then -1 padding. Ties go to the lower entry id (stable sort),
    so the choice does not depend on N or on the rows around it.
    """
    t, n = scores.shape
    out = torch.full((t, topk), -1, dtype=torch.int64, device=scores.device)
    if n == 0 or topk == 0:
        return out
    pos = torch.arange(n, device=scores.device)
    s = scores.float().masked_fill(pos.unsqueeze(0) >= lens.unsqueeze(1), float("-inf"))
    order = torch.sort(s, dim=-1, descending=True, stable=True).indices[:, :topk]
    ok = torch.gather(s, 1, order) > float("-inf")
    picked = torch.where(ok, order, n)  # n sorts after every real id
    picked = picked.sort(dim=-1).values
    w = picked.shape[1]
    out[:, :w] = torch.where(picked < n, picked, -1)
    return out


def candidate_blocks(
    scores: torch.Tensor, lens: torch.Tensor, topk_blocks: int, block_size: int
) -> torch.Tensor:
    """Level one of the two-level top-k: a bool mask [T, N] of the kept candidate entries.

    Entries are grouped in blocks of `block_size`; a block scores the max of its visible entries
    (entry < lens[t]); the block holding the newest visible entry is always kept; then the
    `topk_blocks` best blocks with a finite score are kept (ties to the lower block id).
    """
    t, n = scores.shape
    if n == 0:
        return torch.zeros(t, 0, dtype=torch.bool, device=scores.device)
    pos = torch.arange(n, device=scores.device)
    s = scores.float().masked_fill(pos.unsqueeze(0) >= lens.unsqueeze(1), float("-inf"))
    nb = -(-n // block_size)
    s = torch.nn.functional.pad(s, (0, nb * block_size - n), value=float("-inf"))
    bs = s.view(t, nb, block_size).amax(-1)
    last = (lens - 1).div(block_size, rounding_mode="floor")
    bs = bs.masked_fill(
        torch.arange(nb, device=s.device).unsqueeze(0) == last.unsqueeze(1), float("inf")
    )
    order = torch.sort(bs, dim=-1, descending=True, stable=True).indices[:, :topk_blocks]
    ok = torch.gather(bs, 1, order) > float("-inf")
    keep = torch.zeros(t, nb, dtype=torch.bool, device=s.device).scatter_(1, order, ok)
    return keep.repeat_interleave(block_size, dim=1)[:, :n] & (pos.unsqueeze(0) < lens.unsqueeze(1))
