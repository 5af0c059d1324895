"""The DeepEP adapter: refused clearly where DeepEP cannot run; its layout handling checked
against a one-rank stand-in of `deep_ep.Buffer` with DeepEP's documented shapes (DeepEP itself
needs CUDA and is not installed here)."""

from __future__ import annotations

import sys
import types

import pytest
import torch
from deepinfer_parallel import deep_ep_dispatch
from deepinfer_parallel.deep_ep_dispatch import DeepEPDispatch, deep_ep_reason
from deepinfer_parallel.dispatch_backends import make_dispatch
from deepinfer_parallel.expert_dispatch import ExpertShard

D, K, E = 8, 2, 4


class OneRankBuffer:
    """deep_ep.Buffer on one rank: normal dispatch hands every token over with its local ids;
    low-latency dispatch lays tokens out per expert, [E, max_tokens, D] with recv counts, and
    its combine applies the weights while summing."""

    def __init__(self, group, num_nvl_bytes=0, num_rdma_bytes=0, low_latency_mode=False, **_):
        self.low_latency_mode = low_latency_mode

    @staticmethod
    def get_low_latency_rdma_size_hint(*_):
        return 0

    def get_dispatch_layout(self, topk_idx, num_experts):
        per_expert = torch.bincount(topk_idx[topk_idx >= 0], minlength=num_experts)
        return torch.tensor([topk_idx.shape[0]]), None, per_expert, None, None

    def dispatch(self, x, topk_idx, topk_weights, **_):
        return x, topk_idx, topk_weights, [], None, None

    def combine(self, y, handle):
        return y, None, None

    def low_latency_dispatch(self, x, topk_idx, max_tokens, num_experts, use_fp8=True):
        assert not use_fp8
        recv = torch.zeros(num_experts, max_tokens, x.shape[1], dtype=x.dtype)
        counts = torch.zeros(num_experts, dtype=torch.int32)
        where = {}
        for t in range(x.shape[0]):
            for j in range(topk_idx.shape[1]):
                e = int(topk_idx[t, j])
                recv[e, counts[e]] = x[t]
                where[(t, j)] = (e, int(counts[e]))
                counts[e] += 1
        return recv, counts, where, None, None

    def low_latency_combine(self, y, topk_idx, topk_weights, handle):
        out = torch.zeros(topk_idx.shape[0], y.shape[2], dtype=y.dtype)
        for (t, j), (e, row) in handle.items():
            out[t] += topk_weights[t, j] * y[e, row]
        return out, None, None


@pytest.fixture
def fake_deep_ep(monkeypatch):
    monkeypatch.setitem(sys.modules, "deep_ep", types.SimpleNamespace(Buffer=OneRankBuffer))
    monkeypatch.setattr(deep_ep_dispatch, "deep_ep_reason", lambda: None)


def _experts():
    return torch.randn(E, D, D, generator=torch.Generator().manual_seed(1)) / D**0.5


def _compute(mats):
    def compute(x, w, ids):
        y = torch.zeros(x.shape)
        for r in range(x.shape[0]):
            for j in range(ids.shape[1]):
                if ids[r, j] >= 0:
                    y[r] += w[r, j] * (x[r] @ mats[ids[r, j]])
        return y

    return compute


@pytest.mark.parametrize("rows", [4, 600], ids=["low-latency", "normal"])
def test_adapter_layouts_give_the_dense_result(fake_deep_ep, rows):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, D, generator=g)
    ids = torch.tensor([[0, 3], [1, 2], [3, 1], [2, 0]])
    w = torch.rand(4, K, generator=g)
    mats = _experts()
    backend = DeepEPDispatch(None, ExpertShard(0, 1, E), hidden_size=D, max_decode_tokens=8)
    got = backend.routed(x, w, ids, ids, _compute(mats), rows)
    assert torch.allclose(got, _compute(mats)(x, w, ids), atol=1e-6)


def test_deep_ep_is_refused_where_it_cannot_run():
    if deep_ep_reason() is None:
        pytest.skip("DeepEP runs here")
    with pytest.raises(RuntimeError, match=r"expert dispatch 'deep_ep': .*use 'allgather'"):
        make_dispatch("deep_ep", None, ExpertShard(0, 1, E), D)
    with pytest.raises(ValueError, match="'nccl' is not one of allgather, alltoall, deep_ep"):
        make_dispatch("nccl", None, ExpertShard(0, 1, E), D)
