"""Lightning-indexer ops: `indexer_scores`, `index_topk`, `candidate_blocks`.

Tiers: `triton` (the default on a GPU and the portable one: one launch per call on any CUDA GPU
Triton supports), `ref` (torch: the numerics oracle and the CPU path). `indexer_scores` has
only the ref tier (torch on the GPU) so far."""

from __future__ import annotations

import torch

from ..registry import REGISTRY, Implementation

REGISTRY.declare(
    "indexer_scores", "q [T,IH,Id], weights [T,IH], k [N,Id] -> [T,N] fp32 sum_h w relu(q.k)"
)
REGISTRY.declare(
    "index_topk", "scores [T,N], lens [T], topk -> [T,topk] int64 ascending ids, -1 padded"
)
REGISTRY.declare(
    "candidate_blocks", "scores [T,N], lens [T], topk_blocks, block_size -> [T,N] bool mask"
)
REGISTRY.register(
    Implementation("indexer_scores", "ref", "deepinfer_kernels.ref.indexer:indexer_scores")
)
REGISTRY.register(Implementation("index_topk", "ref", "deepinfer_kernels.ref.indexer:index_topk"))
REGISTRY.register(
    Implementation("candidate_blocks", "ref", "deepinfer_kernels.ref.indexer:candidate_blocks")
)
# one launch per call instead of the ref's dozen sort/gather ops (the decode step's host cost)
for _op in ("index_topk", "candidate_blocks"):
    REGISTRY.register(
        Implementation(
            _op,
            "triton",
            f"deepinfer_kernels.triton.indexer:{_op}",
            devices=("cuda",),
            min_capability=(9, 0),
            requires=("triton",),
        )
    )


def indexer_scores(q: torch.Tensor, weights: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``score[t, n] = sum_h weights[t, h] * relu(q[t, h] . k[n])``; [T, N] fp32."""
    return REGISTRY.call("indexer_scores", q, weights, k, batch_invariant=REGISTRY.batch_invariant)


def index_topk(scores: torch.Tensor, lens: torch.Tensor, topk: int) -> torch.Tensor:
    """The `topk` best finite-scored entries among the first lens[t] of each row, ascending ids,
    -1 padded; ties go to the lower id. Returns [T, topk] int64."""
    return REGISTRY.call("index_topk", scores, lens, topk)


def candidate_blocks(
    scores: torch.Tensor, lens: torch.Tensor, topk_blocks: int, block_size: int
) -> torch.Tensor:
    """Bool [T, N]: entries of the `topk_blocks` best blocks (block score = max visible entry;
    the block of the newest visible entry always kept)."""
    return REGISTRY.call("candidate_blocks", scores, lens, topk_blocks, block_size)
