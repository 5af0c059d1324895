"""Piecewise CUDA graphs of decode steps (`DecodeGraphs`).

A decode step (every sequence brings one new token) launches the same per-token kernels every
time; only each layer's attention core (`Attention.attend`: ring reads and writes, compressed
entries, selection, sparse attention) depends on the step's context lengths and pages. So the
forward is cut at the attention cores into L+1 pieces, captured once per padded batch size
(a "bucket") and replayed:

    piece 0:      ids, positions -> embedding streams -> [engram] -> layer 0 `enter`
    piece i:      o of layer i-1 -> layer i-1 `leave` -> [engram] -> layer i `enter`
    piece L:      o of layer L-1 -> layer L-1 `leave` -> norm + head -> logits [bucket, vocab]

Between two pieces the core runs eagerly on the real rows (`[:B]` views of the piece's outputs)
and writes its result into the next piece's static input. Padded rows (B .. bucket-1) hold
whatever ids and positions an earlier step left there; they never reach the cache (only the
eager cores write it, on real rows) and their logits are dropped. A bucket is captured the
first time a step of its size runs (one device sync then).

Without capture (`capture=False`, the default off CUDA) the same pieces run eagerly on the
padded static buffers: that is how CPU tests check the decomposition.

A model sharded over ranks (`Model.shard`) has collectives inside the pieces (the MoE dispatch,
the Engram lookups), sized by the bucket: every rank must replay the same bucket in a step (the
engine pads to the bucket of the ranks' agreed row count: `collective_rows`), and a capture
runs each piece's collectives more than once, so all ranks capture every bucket together, at
start (`capture_all`), never one rank alone mid-run. Padded rows are masked out of the EPLB
statistics by a static count of real rows (`valid`).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from deepinfer_kernels import REGISTRY

from .batch import ForwardBatch, ForwardOutput
from .cache import KVCache
from .layers.block import AttentionInputs


class GraphCaptureError(RuntimeError):
    """Capturing a bucket failed (an op in a piece synchronises or copies from the host). It is
    raised before the step touched the cache, so the caller can run that step eagerly."""


def bucket_sizes(max_batch: int) -> list[int]:
    """Padded batch sizes captured: 1, 2, 4, 8, then every multiple of 16 up to `max_batch`
    (and `max_batch` itself)."""
    if max_batch < 1:
        raise ValueError(f"max_batch: must be >= 1, got {max_batch}")
    sizes = [s for s in (1, 2, 4, 8) if s < max_batch]
    sizes += list(range(16, max_batch, 16))
    return sorted({*sizes, max_batch})


@dataclass
class _Bucket:
    """The static buffers and graphs of one padded batch size `size` (n below).

    ids, positions: [n] int64 inputs; hashes: [n, engram layers, cols] int64 (models with
    Engram); o[i]: [n, H, head_dim] layer i's attention output (input of piece i+1); states[i]:
    piece i's output (layer i's `AttentionInputs`); logits: [n, vocab] fp32 (piece L's output);
    valid: [] int64, the real rows of the step being replayed.
    """

    size: int
    ids: torch.Tensor
    positions: torch.Tensor
    hashes: torch.Tensor | None
    o: list[torch.Tensor]
    valid: torch.Tensor
    states: list[AttentionInputs | None] = field(default_factory=list)
    logits: torch.Tensor | None = None
    graphs: list[torch.cuda.CUDAGraph] = field(default_factory=list)


class DecodeGraphs:
    """Runs pure decode steps of `model` (a `deepinfer_model.model.Model`) through piecewise
    CUDA graphs; `forward(batch, cache)` returns what `model.forward` would.

    max_batch: the largest number of sequences a graphed step may have. capture: record CUDA
    graphs (default: the model is on CUDA); without, the pieces run eagerly.
    """

    def __init__(self, model, max_batch: int, capture: bool | None = None) -> None:
        self.model = model
        self.sizes = bucket_sizes(max_batch)
        self.device = model.embed.weight.device
        self.capture = self.device.type == "cuda" if capture is None else capture
        if self.capture and self.device.type != "cuda":
            raise ValueError(f"capture: CUDA graphs need a CUDA model, got {self.device}")
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None
        self.buckets: dict[int, _Bucket] = {}

    @property
    def num_layers(self) -> int:
        return len(self.model.layers)

    def unsupported(self, batch: ForwardBatch) -> str | None:
        """Why `batch` cannot run graphed (None: it can). Host facts only, no device read."""
        if REGISTRY.batch_invariant:
            return "batch-invariant mode evaluates every token alone"
        if batch.return_hidden:
            return "hidden states for DSpark are not captured"
        host = batch.host
        if host is None:
            return "the batch has no host mirror"
        cu = host.cu_seqlens
        b = len(cu) - 1
        if any(cu[i + 1] - cu[i] != 1 for i in range(b)):
            return "not a pure decode step (a sequence brings more than one token)"
        if b > self.sizes[-1]:
            return f"{b} sequences > the largest captured batch {self.sizes[-1]}"
        if (batch.collective_rows or 0) > self.sizes[-1]:
            return f"the ranks' {batch.collective_rows} rows > the largest captured batch"
        if host.yoco_floor is not None:
            window = self.model.config.sliding_window
            pairs = list(zip(host.context_lens, host.yoco_floor, strict=True))
            if any(c < f for c, f in pairs):
                return "a token lies below its YOCO floor"
            # the graphed step reads every layer's window from one context, without the
            # consumer layers' floor (StepContext.consumer_view): exact only above it
            if any(f > 0 and c - window + 1 < f for c, f in pairs):
                return "a token's window reaches below its YOCO floor"
        return None

    # -- pieces --------------------------------------------------------------------------------
    def _piece(self, bk: _Bucket, i: int) -> AttentionInputs | torch.Tensor:
        """Piece i on bucket `bk`'s static inputs (see the module docstring)."""
        m = self.model
        if i == 0:
            h, pre = m.embed_streams(bk.ids)
        else:
            h, pre = m.layers[i - 1].leave(bk.o[i - 1], bk.states[i - 1], bk.positions)
        if i == self.num_layers:
            return m.logits(h, pre)
        layer = m.layers[i]
        if layer.engram is not None:
            h = layer.engram(h, bk.hashes[:, layer.engram.layer_index])
        return layer.enter(h, pre, bk.positions)

    def _store(self, bk: _Bucket, i: int, out: AttentionInputs | torch.Tensor) -> None:
        if i == self.num_layers:
            bk.logits = out
        else:
            bk.states[i] = out

    def _new_bucket(self, size: int) -> _Bucket:
        m, cfg, dev = self.model, self.model.config, self.device
        hashes = None
        if m.engram_hasher is not None:
            cols = cfg.engram_n_hash_cols
            hashes = torch.zeros(size, len(cfg.engram_layer_ids), cols, dtype=torch.int64)
            hashes = hashes.to(dev)
        heads, head_dim = cfg.num_attention_heads, cfg.head_dim
        bk = _Bucket(
            size=size,
            ids=torch.zeros(size, dtype=torch.int64, device=dev),
            positions=torch.zeros(size, dtype=torch.int64, device=dev),
            hashes=hashes,
            o=[
                torch.zeros(size, heads, head_dim, dtype=m.dtype, device=dev)
                for _ in range(self.num_layers)
            ],
            valid=torch.zeros((), dtype=torch.int64, device=dev),
            states=[None] * self.num_layers,
        )
        if self.capture:
            try:
                with self._scope(bk):
                    self._capture(bk)
            except RuntimeError as e:
                raise GraphCaptureError(
                    f"DecodeGraphs: capturing the decode pieces of batch {size} failed "
                    f"(an op in a piece synchronises or allocates on the host?): {e}"
                ) from e
        return bk

    @torch.inference_mode()
    def _capture(self, bk: _Bucket) -> None:
        """Record the L+1 pieces of `bk` in order (piece i reads piece i-1's outputs), in one
        memory pool shared by every bucket."""
        side = torch.cuda.Stream(self.device)
        for i in range(self.num_layers + 1):
            # warm up off the capture: first calls compile kernels and pick implementations
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                self._store(bk, i, self._piece(bk, i))
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                out = self._piece(bk, i)
            self._store(bk, i, out)
            bk.graphs.append(graph)
            # the next piece's warm-up reads these outputs: give them real values (a fresh
            # capture's outputs are uninitialised memory, e.g. NaN routing scores)
            graph.replay()

    def _scope(self, bk: _Bucket):
        """A sharded model's collectives in bucket `bk`'s pieces are sized by the bucket."""
        shard = self.model.shard
        return nullcontext() if shard is None else shard.forward(bk.size, valid=bk.valid)

    def bucket_for(self, n: int) -> int | None:
        """The captured batch size a step of `n` rows replays (None: larger than any)."""
        return next((s for s in self.sizes if s >= n), None)

    def capture_all(self) -> None:
        """Capture every bucket now: a sharded model's ranks all call this at start, in
        lockstep (see the module docstring). Raises GraphCaptureError, before any
        collective, when the model's expert dispatch cannot run inside a graph."""
        experts = self.model.shard.experts if self.model.shard is not None else None
        if experts is not None and not experts.graphable:
            raise GraphCaptureError(
                f"expert dispatch {experts.dispatch.name!r} reads counts on the host and "
                "cannot be captured; decode runs eagerly"
            )
        for size in self.sizes:
            if size not in self.buckets:
                self.buckets[size] = self._new_bucket(size)

    def _run(self, bk: _Bucket, i: int) -> None:
        if self.capture:
            bk.graphs[i].replay()
        else:
            self._store(bk, i, self._piece(bk, i))

    # -- the step ------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, cache: KVCache) -> ForwardOutput:
        """`model.forward(batch, cache)` for a batch `unsupported` accepts: logits [R, vocab]
        fp32 for `batch.logits_indices` (a copy: the static buffers are reused next step)."""
        why = self.unsupported(batch)
        if why is not None:
            raise ValueError(f"DecodeGraphs.forward: {why}")
        m = self.model
        n = len(batch.host.cu_seqlens) - 1  # one token per sequence (`unsupported`)
        size = self.bucket_for(max(n, batch.collective_rows or 0))
        bk = self.buckets.get(size)
        if bk is None:
            if m.shard is not None:
                raise GraphCaptureError(
                    f"bucket {size} of a sharded model was not captured at start (capture_all)"
                )
            bk = self.buckets[size] = self._new_bucket(size)
        ctx, _ = m.prepare(batch, cache)
        bk.ids[:n].copy_(batch.input_ids)
        bk.positions[:n].copy_(batch.positions)
        bk.valid.fill_(n)
        if bk.hashes is not None:
            bk.hashes[:n].copy_(m.engram_hasher(batch.input_ids, ctx, cache))
        with self._scope(bk):
            for i, layer in enumerate(m.layers):
                self._run(bk, i)
                s = bk.states[i]
                o = layer.attn.attend(s.x[:n], s.proj.rows(n), ctx, cache)
                bk.o[i][:n].copy_(o)
            self._run(bk, self.num_layers)
        return ForwardOutput(logits=bk.logits[:n].index_select(0, batch.logits_indices))
