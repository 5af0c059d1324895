"""A model sharded over gloo ranks (experts, Engram rows) computes what the whole model does.

Two ranks hold half the expert slots each (plus a redundant slot) and half of each Engram
table, load only that from the built-in checkpoint, and run different batches (one rank idle
in a step) in batch-invariant mode: every logit is bitwise the whole model's. A rebalance
between steps moves expert bytes between the ranks and changes nothing.
"""

from __future__ import annotations

import torch
from deepinfer_model.loader import CheckpointReader, load_model
from deepinfer_parallel.local_ranks import run_local_ranks

PROMPTS = {0: [[5, 9, 13, 2], [7, 7]], 1: [[11, 3, 8]]}


def _rank_body(rank: int, world: int) -> dict:
    from deepinfer_kernels import REGISTRY
    from deepinfer_model.batch import ForwardBatch
    from deepinfer_model.builtin import builtin_checkpoint
    from deepinfer_model.cache import CacheSpec, KVCache
    from deepinfer_model.config import ModelConfig
    from deepinfer_model.loader import read_hf_config
    from deepinfer_model.rank_shard import RankShard
    from deepinfer_parallel.layout import ParallelLayout
    from deepinfer_parallel.process_groups import RankGroups

    groups = RankGroups.create(ParallelLayout(world, world, world))
    cfg = ModelConfig.from_hf(read_hf_config(builtin_checkpoint()))
    shard = RankShard.build(
        groups, cfg, device="cpu", extra_experts=world, eplb_window=4, eplb_interval=1
    )
    part = load_model(None, "cpu", torch.float32, progress=False, shard=shard)
    whole = load_model(None, "cpu", torch.float32, progress=False)
    spec = CacheSpec.from_config(cfg, block_size=16, dtype=torch.float32)
    caches = [KVCache(cfg, spec, num_blocks=8, num_slots=4, dtype=torch.float32) for _ in "ab"]
    prompts = PROMPTS[rank]
    same, rebalanced = [], []
    with REGISTRY.batch_invariant_mode():
        # step 1: rank 1 idle; step 2: rank 1 prefills while rank 0 decodes; step 3: after a
        # rebalance, both decode
        lens = [0] * len(prompts)
        for step in range(3):
            if rank == 0:
                seqs = prompts if step == 0 else [[step] for _ in prompts]
            else:
                seqs = [] if step == 0 else prompts if step == 1 else [[2] for _ in prompts]
            starts = list(lens) if seqs else []
            rows = torch.tensor([sum(len(s) for s in seqs)])
            torch.distributed.all_reduce(rows, op=torch.distributed.ReduceOp.MAX)
            if not seqs:
                part.model.idle_forward(int(rows))
            else:
                tables = [[2 * i, 2 * i + 1] for i in range(len(seqs))]
                slots = list(range(len(seqs)))
                batch = ForwardBatch.build(seqs, starts, slots, tables, logits_rows="all")
                batch.collective_rows = int(rows)
                got = part.model(batch, caches[0]).logits
                want = whole.model(
                    ForwardBatch.build(seqs, starts, slots, tables, logits_rows="all"), caches[1]
                ).logits
                same.append(bool(torch.equal(got, want)))
                lens = [n + len(q) for n, q in zip(lens, seqs, strict=True)]
            rebalanced.append(part.model.end_step())
    graphed = _decode_through_graph_pieces(rank, part.model, whole.model, caches, lens)
    total = CheckpointReader(builtin_checkpoint()).total_bytes
    report = part.report
    return {
        "same": same,
        "rebalanced": rebalanced,
        "local_experts": len(part.model.layers[0].ffn.experts),
        "engram_rows": part.model.layers[1].engram.embed.weight.shape[0],
        "bytes_fraction": report.num_bytes / total,
        "held_elsewhere": report.held_elsewhere,
        "graphed": graphed,
    }


def _decode_through_graph_pieces(rank, part, whole, caches, lens) -> dict:
    """A decode step through the piecewise decode graphs (run eagerly on CPU: the pieces and
    their collectives as a CUDA replay would run them), each rank padded to the bucket of the
    largest batch; rank 1 has nothing to decode and runs the idle forward of that bucket."""
    from deepinfer_model.batch import SequenceInput, build_batch
    from deepinfer_model.cuda_graph import DecodeGraphs

    graphs = DecodeGraphs(part, max_batch=4, capture=False)
    graphs.capture_all()  # every rank, together
    counts0 = part.shard.experts.eplb._counts.sum().item()
    bucket = graphs.bucket_for(len(PROMPTS[0]))  # the agreed rows: rank 0's 2 sequences
    if rank == 1:
        part.idle_forward(bucket)
        return {"close": True, "counted": part.shard.experts.eplb._counts.sum().item() - counts0}
    seqs = [SequenceInput([4], n, i, [2 * i, 2 * i + 1]) for i, n in enumerate(lens)]
    batch = build_batch(seqs, "cpu")
    batch.collective_rows = bucket
    got = graphs.forward(batch, caches[0]).logits
    want = whole.forward(build_batch(seqs, "cpu"), caches[1]).logits
    counted = part.shard.experts.eplb._counts.sum().item() - counts0
    return {"close": bool(torch.allclose(got, want, rtol=1e-4, atol=1e-4)), "counted": counted}


def test_two_ranks_equal_the_whole_model_bitwise_through_a_rebalance():
    out = run_local_ranks(_rank_body, 2, args=(2,), timeout_s=150)
    for r in out:
        assert r["same"] and all(r["same"]), out
        assert r["rebalanced"] == [True, True, True]
        assert r["local_experts"] == 5  # (8 experts + 2 redundant) / 2 ranks
        # 4 of the 8 logical experts of each of the 8 layers are the other rank's (6 tensors
        # each): never read; half of each Engram table neither
        assert r["held_elsewhere"] == 8 * 4 * 6 and r["bytes_fraction"] < 0.85
    assert out[0]["engram_rows"] + out[1]["engram_rows"] == 48400
    # graphed decode: the same logits, and only the 2 real rows (top-2, 8 layers) counted
    assert out[0]["graphed"] == {"close": True, "counted": 2 * 2 * 8}
    assert out[1]["graphed"] == {"close": True, "counted": 0}


def test_full_width_plan_holds_an_eighth_of_experts_and_engram_rows():
    from deepinfer_model.config import ModelConfig
    from deepinfer_model.model import Model
    from deepinfer_model.rank_shard import RankShard
    from deepinfer_parallel.layout import ParallelLayout, engram_row_range

    cfg = ModelConfig()  # V4.1-Flash: 384 experts, Engram tables of ~384 M rows
    layout = ParallelLayout(8, 8, 8)
    for rank in (0, 5):
        shard = RankShard.plan(layout, rank, cfg, extra_experts=32)
        model = Model(cfg, dtype=torch.bfloat16, device="meta", shard=shard)
        assert len(model.layers[0].ffn.experts) == (384 + 32) // 8
        sources = model.shard_sources()
        for i, layer in zip(cfg.engram_layer_ids, range(2), strict=True):
            lo, hi = engram_row_range(cfg.engram_num_embeddings[layer], 8, rank)
            assert model.layers[i].engram.embed.weight.shape[0] == hi - lo
            assert sources.sources[f"layers.{i}.engram.embed.weight"].rows == (lo, hi)
        held = {s.name.split(".")[4] for n, s in sources.sources.items() if "layers.0.ffn" in n}
        assert len(held) == 48 and len(sources.elsewhere) == 40 * (384 - len(held)) * 6
