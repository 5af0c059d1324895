"""DeepSeek-V4.1 text model: embed -> hc_mult streams -> 40 mHC blocks -> collapse -> head.

`Model.forward(batch, cache)` runs one flat batch (prefill, chunked prefill, decode and
multi-token verify alike) and returns logits for `batch.logits_indices`. Parameter names are
the checkpoint's (`embed.weight`, `layers.N.attn.wq_a.weight` + `.scale`, ..., `mtp.K.*`).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from deepinfer_kernels import REGISTRY, ops
from torch import nn

from .batch import ForwardBatch, ForwardOutput, HostBatchInfo
from .cache import KVCache
from .config import ModelConfig
from .dspark import DSparkStage
from .layers.block import Block
from .layers.engram import EngramHasher
from .layers.linear import Embedding, RMSNorm, dense
from .layers.mhc import identity_pre
from .shard_sources import ShardSources, TensorSource
from .staging import HostStaging
from .step_context import StepContext

if TYPE_CHECKING:
    from .rank_shard import RankShard


class Head(nn.Module):
    """`weight [vocab, D]`: x [R, D] -> logits [R, vocab] fp32 (fp32 matmul, as the reference)."""

    def __init__(self, vocab: int, dim: int, dtype: torch.dtype, device=None) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.zeros(vocab, dim, dtype=dtype, device=device), requires_grad=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dense(x.float(), self.weight.float())  # .float() of the fp32 weight is itself


class Model(nn.Module):
    """The V4.1 text model (plus the DSpark stage modules under `mtp`).

    dtype: activation / plain-weight dtype (fp32 on CPU for tests, bf16 on GPU);
    fake_quant_kv: apply the reference's KV fake-quantisation (FP8 window KV, FP4 compressed KV,
    FP4 index keys and queries); off gives the unquantised math.
    The Engram compressed-token map is not a checkpoint tensor: install it with
    `model.engram_hasher.set_token_map(...)` after building (the loader does).
    Build it on its device (`device=`); `.to(device)` is fine, but never `.to(dtype)`/`.half()`:
    torch counts float8 as floating point and would convert the FP8 weights.
    shard: this rank's part of a parallel model (`rank_shard.RankShard`: its expert slots and
    Engram rows); None builds every parameter. A sharded model's forwards are collective: every
    rank of its groups runs the same number of them with the same `collective_rows`, and a rank
    with nothing to run calls `idle_forward` instead.
    """

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        fake_quant_kv: bool = True,
        shard: RankShard | None = None,
    ) -> None:
        super().__init__()
        config.validate()
        self.config, self.dtype = config, dtype
        self.shard = shard
        dev = torch.device(device) if device is not None else None
        self.embed = Embedding(config.vocab_size, config.hidden_size, dtype, dev)
        self.layers = nn.ModuleList(
            Block(config, i, dtype, dev, fake_quant_kv, shard=shard)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, dev)
        # fp32 like the reference (bf16 on disk; the loader casts): logits come out in fp32
        # without converting a [vocab, D] weight on every step
        self.head = Head(config.vocab_size, config.hidden_size, torch.float32, dev)
        self.mtp = nn.ModuleList(
            DSparkStage(config, k, dtype, dev, fake_quant_kv)
            for k in range(config.num_nextn_predict_layers)
        )
        self.engram_hasher = EngramHasher(config, dev) if config.engram_layer_ids else None
        self.staging: HostStaging | None = None
        """Batches each step's index uploads (`prepare`); made on the first CUDA step."""

    @torch.inference_mode()
    def end_step(self) -> bool:
        """Close one engine step for online EPLB (`RankShard.experts.eplb`); when it rebalances,
        move every MoE layer's expert bytes to the new placement over the EP group (all ranks
        call this after the same step) and return True."""
        ep = self.shard.experts if self.shard is not None else None
        if ep is None:
            return False
        new = ep.end_step()
        if new is None:
            return False
        from deepinfer_parallel.eplb import exchange_experts

        for i, layer in enumerate(self.layers):
            stacks = layer.ffn.stacked()
            names = list(stacks)
            moved = exchange_experts(
                [stacks[n] for n in names], ep.moves(i, new), ep.shard.ep_rank, ep.dispatch.group
            )
            layer.ffn.replace_experts_(dict(zip(names, moved, strict=True)))
        ep.adopt(new)
        return True

    def shard_sources(self):
        """What this rank's part loads from the full checkpoint (`shard_sources.ShardSources`): each
        local expert slot from its logical expert, each Engram table's rows as a row range; the
        other experts are left to their ranks."""

        sources: dict[str, TensorSource] = {}
        elsewhere: set[str] = set()
        parts = ("w1", "w2", "w3")
        leaves = ("weight", "scale")
        ep = self.shard.experts if self.shard is not None else None
        for i, layer in enumerate(self.layers):
            pre = f"layers.{i}"
            if ep is not None:
                held = ep.local_logical(i)
                for slot, e in enumerate(held):
                    for m in parts:
                        for leaf in leaves:
                            src = f"{pre}.ffn.experts.{e}.{m}.{leaf}"
                            sources[f"{pre}.ffn.experts.{slot}.{m}.{leaf}"] = TensorSource(src)
                for e in set(range(self.config.n_routed_experts)) - set(held):
                    elsewhere.update(
                        f"{pre}.ffn.experts.{e}.{m}.{leaf}" for m in parts for leaf in leaves
                    )
            table = layer.engram.embed if layer.engram is not None else None
            if table is not None and table.sharded is not None:
                rows = (table.sharded.shard.lo, table.sharded.shard.hi)
                for leaf in leaves:
                    name = f"{pre}.engram.embed.{leaf}"
                    sources[name] = TensorSource(name, rows)
        return ShardSources(sources, frozenset(elsewhere))

    def prepare(self, batch: ForwardBatch, cache: KVCache) -> tuple[StepContext, HostBatchInfo]:
        """Validate `batch` (ValueError naming the field) and derive its attention metadata:
        the `StepContext` with every layer's host-side index tensors built before the first
        layer runs (on CUDA they reach the device in one non-blocking copy, `HostStaging`).
        Returns it with the batch's CPU mirror."""
        host = batch.host_info()
        ctx = StepContext.from_batch(batch, host)
        cfg = self.config
        ids = batch.input_ids
        if ids.device.type == "cpu" and (int(ids.min()) < 0 or int(ids.max()) >= cfg.vocab_size):
            # on an accelerator this would be a sync per step: the engine checks at admission
            raise ValueError(f"ForwardBatch.input_ids: ids must be in [0, {cfg.vocab_size})")
        if max(c + n for c, n in zip(ctx.ctx, ctx.lens, strict=True)) > cfg.max_position_embeddings:
            raise ValueError(
                f"ForwardBatch.positions: must be < max_position_embeddings "
                f"{cfg.max_position_embeddings}"
            )
        if ctx.floor is not None and any(
            src > cfg.decoder_start_layer for src in cfg.kv_source_layer_ids
        ):
            raise NotImplementedError(
                "ForwardBatch.yoco_floor: a kv source after the decoder start layer "
                f"({cfg.decoder_start_layer}) would compress consumer-layer rows; YOCO "
                "truncation for such a config is not implemented"
            )
        t = ids.shape[0]
        if len(host.logits_indices) != batch.logits_indices.shape[0] or any(
            r < 0 or r >= t for r in host.logits_indices
        ):
            raise ValueError(f"ForwardBatch.logits_indices: rows must be in [0, {t})")
        if ctx.device.type == "cuda" and self.staging is None:
            self.staging = HostStaging(ctx.device)
        with ctx.staged(self.staging):
            for layer in self.layers:
                layer.attn.prepare(ctx, cache)
        return ctx, host

    def forward(self, batch: ForwardBatch, cache: KVCache) -> ForwardOutput:
        """Run the new tokens of every sequence in `batch`, writing their state into `cache`.

        Returns logits [R, vocab] fp32 for `batch.logits_indices` and, if
        `batch.return_hidden`, the DSpark inputs [T, D * len(dspark_target_layer_ids)]: for each
        target layer the mean over the hc streams of that layer's input, concatenated in target
        order.

        YOCO prefill truncation (`batch.yoco_floor`, reference §3 "decoder SWA bounded
        replay", as DeepInfer's `v4_modules/yoco.py`): the producer layers 0 ..
        `decoder_start_layer` - 1 run on every token exactly as without a floor, and so does
        the decoder start's compressor (layer 20 publishes the compressed KV and index keys of
        every token). The consumer layers, from the decoder start on, never see a window
        position below the sequence's floor; with `batch.yoco_truncation` "compact" they run
        only the tokens at or after it (hidden rows of the others are zero and their logits
        cannot be requested), with "mask" every token. This is approximate by design (the exact
        path is `yoco_floor=None`).

        With DEEPINFER_BATCH_INVARIANT=1 (the kernel registry's setting) every token of every
        sequence is evaluated alone, in position order: its logits are then bitwise the same
        whatever the batch, chunking or decode/verify split (the canonical per-token answer;
        slow, as the reference tier's batch-invariant mode may be).

        With `batch.host` given, the forward never waits for the device (no device->host read):
        every index it needs is built on the host and copied over without blocking.

        A sharded model pads its collectives to `batch.collective_rows` (default: T); in
        batch-invariant mode that many single-token forwards run, idle ones after this rank's
        own tokens.
        """
        t = batch.input_ids.shape[0]
        rows = self._collective_rows(batch)
        if REGISTRY.batch_invariant and (t > 1 or rows > t):
            host = batch.host_info()
            StepContext.from_batch(batch, host)  # validate once, with the batch's own field names
            out = self._forward_per_token(batch, cache, host)
            for _ in range(rows - t):
                self.idle_forward(1)
            return out
        return self._forward(batch, cache, rows)

    def _collective_rows(self, batch: ForwardBatch) -> int:
        t = batch.input_ids.shape[0]
        if self.shard is None or batch.collective_rows is None:
            return t
        if batch.collective_rows < t:
            raise ValueError(
                f"ForwardBatch.collective_rows={batch.collective_rows} < the batch's {t} tokens"
            )
        return batch.collective_rows

    @torch.inference_mode()
    def idle_forward(self, rows: int) -> None:
        """Take part in one step's collectives without tokens of this rank's own: in layer order
        the sharded Engram lookups and the expert dispatches, padded to `rows` (the step's
        agreed count; in batch-invariant mode `rows` single-token forwards)."""
        if self.shard is None:
            return
        forwards, each = (rows, 1) if REGISTRY.batch_invariant else (1, rows)
        for _ in range(forwards):
            with self.shard.forward(each):
                for layer in self.layers:
                    self._idle_layer(layer)

    @staticmethod
    def _idle_layer(layer: Block) -> None:
        if layer.engram is not None:
            layer.engram.idle()
        layer.ffn.idle()

    def _forward_per_token(
        self, batch: ForwardBatch, cache: KVCache, host: HostBatchInfo
    ) -> ForwardOutput:
        """`forward` as a sequence of single-token forwards (batch-invariant mode); `host` is
        the batch's `host_info()`."""
        wanted = {r: i for i, r in enumerate(host.logits_indices)}
        logits: list[torch.Tensor | None] = [None] * len(wanted)
        hidden = []
        cu = host.cu_seqlens
        for b in range(len(cu) - 1):
            for row in range(cu[b], cu[b + 1]):
                one = batch.token_alone(host, b, row, logits=row in wanted)
                out = self._forward(one, cache, 1)
                if row in wanted:
                    logits[wanted[row]] = out.logits[0]
                if batch.return_hidden:
                    hidden.append(out.hidden)
        stacked = (
            torch.stack(logits)
            if logits
            else torch.zeros(0, self.config.vocab_size, device=batch.input_ids.device)
        )
        return ForwardOutput(
            logits=stacked, hidden=torch.cat(hidden) if batch.return_hidden else None
        )

    def _forward(self, batch: ForwardBatch, cache: KVCache, rows: int) -> ForwardOutput:
        if self.shard is None:
            return self._forward_layers(batch, cache)
        with self.shard.forward(rows):
            return self._forward_layers(batch, cache)

    def _replica_keys(self, ctx: StepContext) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Batch-invariant expert replica choice: each token keyed by (its slot, position)."""
        if self.shard is None or not REGISTRY.batch_invariant:
            return None
        return ctx.token["slot"], ctx.positions

    def _forward_layers(self, batch: ForwardBatch, cache: KVCache) -> ForwardOutput:
        ctx, host = self.prepare(batch, cache)
        if self.shard is not None:
            self.shard.scope.keys = self._replica_keys(ctx)
        cfg = self.config
        ids = batch.input_ids
        host_rows = host.logits_indices
        t = ids.shape[0]
        rows = batch.logits_indices
        hashes = self.engram_hasher(ids, ctx, cache) if self.engram_hasher is not None else None
        h, pre = self.embed_streams(ids)
        hidden: dict[int, torch.Tensor] = {}
        rows_of = None  # YOCO compact: flat rows the consumer layers run (None: all)
        rows_of_cpu = None
        for i, layer in enumerate(self.layers):
            if rows_of is not None and rows_of.numel() == 0:
                # every token of the step lies below its YOCO floor: nothing left to run
                if batch.return_hidden and i in cfg.dspark_target_layer_ids:
                    hidden[i] = h.new_zeros(t, cfg.hidden_size)
                if self.shard is not None:
                    self._idle_layer(layer)  # the other ranks still run this layer
                continue
            if layer.engram is not None:
                h = layer.engram(h, hashes[:, layer.engram.layer_index])
            if batch.return_hidden and i in cfg.dspark_target_layer_ids:
                hidden[i] = self._scatter(h.float().mean(1).to(h.dtype), rows_of, t)
            if i == cfg.decoder_start_layer and ctx.floor is not None:
                h, pre, ctx, rows_of, rows_of_cpu = self._enter_consumers(layer, h, pre, ctx, cache)
            else:
                h, pre = layer(h, pre, ctx, cache)
        if rows_of_cpu is not None:
            pos_of = torch.full((t,), -1, dtype=torch.int64)
            pos_of[rows_of_cpu] = torch.arange(rows_of_cpu.shape[0])
            kept = pos_of[torch.tensor(host_rows, dtype=torch.int64)]
            if kept.numel() and int(kept.min()) < 0:
                raise ValueError(
                    "ForwardBatch.logits_indices: a requested row lies before its sequence's "
                    "yoco_floor, so the decoder layers never ran on it"
                )
            rows = ctx.upload(kept)
        logits = self.logits(h[rows], pre[rows])
        out_hidden = None
        if batch.return_hidden:
            out_hidden = torch.cat([hidden[i] for i in cfg.dspark_target_layer_ids], dim=-1)
        return ForwardOutput(logits=logits, hidden=out_hidden)

    def _enter_consumers(
        self, layer: Block, h: torch.Tensor, pre: torch.Tensor, ctx: StepContext, cache: KVCache
    ) -> tuple[torch.Tensor, torch.Tensor, StepContext, torch.Tensor | None, torch.Tensor | None]:
        """The decoder start `layer` under a YOCO floor, DeepInfer's truncation boundary: its
        compressor publishes the entries of every token (h, pre: all rows), then its attention
        and FFN run in the consumer layers' context (`StepContext.consumer_view`). Returns the
        streams and pre of the rows that run on, that context, and those rows (device, CPU;
        None: every row)."""
        s = layer.enter(h, pre, ctx.positions)
        layer.attn.publish(s.x, s.proj, ctx, cache)
        view, rows, rows_cpu = ctx.consumer_view()
        if self.shard is not None:
            self.shard.scope.keys = self._replica_keys(view)
        if rows is not None:
            if rows_cpu.numel() == 0:  # every token of the step lies below its floor
                if self.shard is not None:
                    layer.ffn.idle()  # the other ranks still run this layer's experts
                return h[rows], pre[rows], view, rows, rows_cpu
            s = s.select(rows)
        h, pre = layer.leave(layer.attn.attend(s.x, s.proj, view, cache), s, view.positions)
        return h, pre, view, rows, rows_cpu

    def embed_streams(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [T] -> (h [T, hc, D] the embedding on every stream, pre [T, hc] the one-hot
        collapse layer 0's attention uses)."""
        h = self.embed(ids).to(self.dtype).unsqueeze(1).repeat(1, self.config.hc_mult, 1)
        return h, identity_pre(ids.shape[0], self.config.hc_mult, ids.device)

    def logits(self, h: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        """Last streams h [R, hc, D] and the last FFN site's pre [R, hc] -> logits [R, vocab]
        fp32."""
        return self.head(self.norm(ops.hc_pre(h, pre)))

    @staticmethod
    def _scatter(x: torch.Tensor, rows: torch.Tensor | None, total: int) -> torch.Tensor:
        """Rows [T', ...] back to [total, ...] (zeros for rows that skipped the late layers)."""
        if rows is None:
            return x
        out = x.new_zeros(total, *x.shape[1:])
        out[rows] = x
        return out


@torch.no_grad()
def init_random_(model: Model, seed: int = 0, *, expert_codes: bool = False) -> Model:
    """Fill every parameter of `model` in place with deterministic random values in the
    checkpoint formats (FP8 blocks via `quantize_fp8_blocks`, FP4 experts via
    `quantize_fp4_experts`), scaled so activations stay O(1): linears ~ N(0, 1/in), norms 1,
    mHC projections small, sinks and biases small. CPU generator; same bytes for a seed.

    expert_codes: fill the FP4 expert matrices instead with uniformly random e2m1 codes and one
    power-of-two scale (std within 2x of 1/sqrt(in)), drawn on the weights' device without a
    quantisation pass: seconds instead of hours for 384 experts per layer (benchmarks at the
    real expert count). Same bytes for a seed on the same device type."""
    from deepinfer_kernels import quant

    from .layers.linear import FP4Weight, FP8Linear, use_checkpoint_order_

    use_checkpoint_order_(model)  # the expert bytes below are written in the checkpoint's order
    g = torch.Generator().manual_seed(seed)

    def randn(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float32) * std

    done: set[int] = set()
    code_seed = seed
    for mod in model.modules():
        if expert_codes and isinstance(mod, FP4Weight):
            dev = mod.weight.device
            code_seed += 1
            dg = torch.Generator(device=dev).manual_seed(code_seed)
            codes = torch.randint(-128, 128, mod.weight.shape, generator=dg, device=dev)
            mod.weight.copy_(codes.to(torch.int8))
            # uniform e2m1 codes have rms sqrt(mean(v^2)) = 2.93 in units of the scale
            exponent = round(math.log2(mod.in_features**-0.5 / 2.93))
            mod.scale.copy_(torch.full(mod.scale.shape, 2.0**exponent, device=dev))
            done.update((id(mod.weight), id(mod.scale)))
        elif isinstance(mod, (FP8Linear, FP4Weight)):
            quantize = (
                quant.quantize_fp8_blocks
                if isinstance(mod, FP8Linear)
                else quant.quantize_fp4_experts
            )
            w, s = quantize(randn(mod.out_features, mod.in_features, std=mod.in_features**-0.5))
            mod.weight.copy_(w)
            mod.scale.copy_(s)
            done.update((id(mod.weight), id(mod.scale)))
    for name, p in model.named_parameters():
        if id(p) in done:
            continue
        leaf = name.rsplit(".", 1)[-1]
        if name.endswith("embed.weight") and "engram" in name:
            w, s = quant.quantize_fp8_blocks(randn(*p.shape, std=1.0))
            p.copy_(w)
            # the table's scale param is handled below via its own name
            continue
        if name.endswith("embed.scale"):
            p.copy_(torch.ones(p.shape).to(p.dtype))
            continue
        if p.dtype in (torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.int8):
            raise RuntimeError(f"init_random_: no rule for quantised parameter {name}")
        if "norm" in name and leaf == "weight":
            val = 1.0 + randn(*p.shape, std=0.05)
        elif leaf.startswith("hc_") and leaf.endswith("_fn"):
            val = randn(*p.shape, std=0.02)
        elif leaf.endswith("_base"):
            val = randn(*p.shape, std=0.5)
        elif leaf.endswith("_scale"):
            val = 0.5 + randn(*p.shape, std=0.05).abs()
        elif leaf == "attn_sink":
            val = randn(*p.shape, std=0.5)
        elif leaf in ("bias", "bias_vl"):
            val = randn(*p.shape, std=0.1)
        elif leaf in ("q_weight", "k_weight"):
            val = 1.0 + randn(*p.shape, std=0.1)
        elif p.dim() == 2:
            val = randn(*p.shape, std=p.shape[1] ** -0.5)
        else:
            val = randn(*p.shape, std=1.0)
        p.copy_(val.to(p.dtype))
    return model
