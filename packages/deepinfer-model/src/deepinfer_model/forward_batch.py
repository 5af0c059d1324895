"""The flat batch one forward call runs (`ForwardBatch`), its result (`ForwardOutput`), and the
per-step facts every layer derives from it (`StepContext`).

No device->host reads: everything the forward decides on the host (sequence ranges, which rows
close a compressed group, which pages hold which entries, which ring rows to write) comes from
the batch's CPU mirror (`HostBatchInfo`); the index tensors built from it go to the device in
pinned, non-blocking copies. So on CUDA a forward only enqueues work and the host can run ahead
(async scheduling overlaps the next step's host work with this step's kernels).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch


@dataclass
class HostBatchInfo:
    """CPU copies of a `ForwardBatch`'s metadata (the runner builds the batch from these).

    cu_seqlens [B+1], context_lens [B], slots [B], logits_indices [R], yoco_floor [B] | None:
    python ints equal to the device tensors of the same name; block_tables: CPU int32
    [B, max_blocks] equal to the device table. Positions are not mirrored: by the contract they
    are ``context_lens[b] ..`` for each sequence.
    """

    cu_seqlens: list[int]
    context_lens: list[int]
    slots: list[int]
    block_tables: torch.Tensor
    logits_indices: list[int]
    yoco_floor: list[int] | None = None

    @classmethod
    def of(cls, batch: ForwardBatch) -> HostBatchInfo:
        """Read the mirror from the batch's tensors (a device->host sync on CUDA tensors)."""
        return cls(
            cu_seqlens=[int(v) for v in batch.cu_seqlens.tolist()],
            context_lens=[int(v) for v in batch.context_lens.tolist()],
            slots=[int(v) for v in batch.slots.tolist()],
            block_tables=batch.block_tables.detach().to("cpu", torch.int32),
            logits_indices=[int(v) for v in batch.logits_indices.tolist()],
            yoco_floor=None
            if batch.yoco_floor is None
            else [int(v) for v in batch.yoco_floor.tolist()],
        )


@dataclass
class ForwardBatch:
    """New tokens of B sequences, flat. Sequence b's tokens sit at positions
    ``context_lens[b] .. context_lens[b] + n_b - 1`` (n_b from `cu_seqlens`).

    input_ids: [T] int64; positions: [T] int64; cu_seqlens: [B+1] int32; context_lens: [B] int64
    (tokens already in the cache); slots: [B] int64 (per-slot state index); block_tables:
    [B, max_blocks] int32 page ids (-1 padded); logits_indices: [R] int64 flat rows whose logits
    are wanted; return_hidden: also return the DSpark target-layer hidden states of all T rows.
    yoco_floor: optional [B] int64 (YOCO compact prefill, "decoder SWA bounded replay"): the
    first position of each sequence that runs the layers after the CED split layer (layers
    > `config.decoder_start_layer`); tokens before it stop after that layer, and those layers'
    windows never reach below it. 0 (or None) = exact path. Pass the same value for a sequence's
    whole life (prompt chunks and decode steps) once set.
    host: optional CPU mirror of the metadata (`HostBatchInfo`). Give it whenever the tensors are
    on an accelerator: without it the forward reads the metadata back (one sync per forward). On
    CUDA the forward then trusts the device tensors to match it and does not re-check
    `input_ids`/`positions` on the device (the engine validates token ids at admission); with CPU
    tensors everything is checked, the mirror included.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    cu_seqlens: torch.Tensor
    context_lens: torch.Tensor
    slots: torch.Tensor
    block_tables: torch.Tensor
    logits_indices: torch.Tensor
    return_hidden: bool = False
    yoco_floor: torch.Tensor | None = None
    host: HostBatchInfo | None = None

    @classmethod
    def build(
        cls,
        seqs: list[list[int]],
        context_lens: list[int],
        slots: list[int],
        block_tables: list[list[int]],
        logits_rows: str | list[int] = "last",
        return_hidden: bool = False,
        device: torch.device | str = "cpu",
    ) -> ForwardBatch:
        """Convenience constructor from per-sequence token lists (tests, tools).

        `logits_rows`: "last" (last token of each sequence), "all", or explicit flat rows.
        On a non-CPU device the batch carries its `host` mirror (so set `yoco_floor` through
        `with_yoco_floor`, which keeps the mirror in step); on CPU it has none (tests edit fields).
        """
        if not (len(seqs) == len(context_lens) == len(slots) == len(block_tables)):
            raise ValueError(
                "ForwardBatch.build: seqs, context_lens, slots, block_tables differ in length"
            )
        ids, pos, cu = [], [], [0]
        for toks, c in zip(seqs, context_lens, strict=True):
            if not toks:
                raise ValueError("ForwardBatch.build: every sequence needs at least one new token")
            ids += toks
            pos += range(c, c + len(toks))
            cu.append(cu[-1] + len(toks))
        width = max(1, max(len(b) for b in block_tables))
        bt = torch.full((len(seqs), width), -1, dtype=torch.int32)
        for i, b in enumerate(block_tables):
            bt[i, : len(b)] = torch.tensor(b, dtype=torch.int32)
        if logits_rows == "last":
            rows = [c - 1 for c in cu[1:]]
        elif logits_rows == "all":
            rows = list(range(cu[-1]))
        else:
            rows = list(logits_rows)
        dev = torch.device(device)
        host = None
        if dev.type != "cpu":
            host = HostBatchInfo(
                list(cu), list(context_lens), list(slots), bt.clone(), list(rows), None
            )
        return cls(
            input_ids=torch.tensor(ids, dtype=torch.int64).to(dev),
            positions=torch.tensor(pos, dtype=torch.int64).to(dev),
            cu_seqlens=torch.tensor(cu, dtype=torch.int32).to(dev),
            context_lens=torch.tensor(context_lens, dtype=torch.int64).to(dev),
            slots=torch.tensor(slots, dtype=torch.int64).to(dev),
            block_tables=bt.to(dev),
            logits_indices=torch.tensor(rows, dtype=torch.int64).to(dev),
            return_hidden=return_hidden,
            host=host,
        )

    def with_yoco_floor(self, floor: list[int]) -> ForwardBatch:
        """Set `yoco_floor` [B] (tensor and host mirror alike); returns self."""
        self.yoco_floor = torch.tensor(floor, dtype=torch.int64).to(self.input_ids.device)
        if self.host is not None:
            self.host.yoco_floor = list(floor)
        return self

    def token_alone(self, host: HostBatchInfo, b: int, row: int, logits: bool) -> ForwardBatch:
        """Flat row `row` (of sequence `b`) as a one-token batch of its own, for the
        batch-invariant per-token mode: the token at its position with its sequence's slot,
        pages and YOCO floor; its logits row requested iff `logits`. `host`: this batch's
        `host_info()`."""
        dev = self.input_ids.device
        return ForwardBatch(
            input_ids=self.input_ids[row : row + 1],
            positions=self.positions[row : row + 1],
            cu_seqlens=torch.tensor([0, 1], dtype=torch.int32).to(dev),
            context_lens=self.positions[row : row + 1].to(self.context_lens.dtype),
            slots=self.slots[b : b + 1],
            block_tables=self.block_tables[b : b + 1],
            logits_indices=torch.zeros(1 if logits else 0, dtype=torch.int64).to(dev),
            return_hidden=self.return_hidden,
            yoco_floor=None if self.yoco_floor is None else self.yoco_floor[b : b + 1],
            host=HostBatchInfo(
                [0, 1],
                [host.context_lens[b] + row - host.cu_seqlens[b]],
                [host.slots[b]],
                host.block_tables[b : b + 1],
                [0] if logits else [],
                None if host.yoco_floor is None else [host.yoco_floor[b]],
            ),
        )

    def host_info(self) -> HostBatchInfo:
        """The CPU mirror: `host` if given (checked against CPU tensors), else read back."""
        if self.host is None:
            return HostBatchInfo.of(self)
        if self.cu_seqlens.device.type == "cpu":
            real = HostBatchInfo.of(self)
            for name in ("cu_seqlens", "context_lens", "slots", "logits_indices", "yoco_floor"):
                if getattr(real, name) != getattr(self.host, name):
                    raise ValueError(f"ForwardBatch.host.{name}: differs from ForwardBatch.{name}")
            if not torch.equal(real.block_tables, self.host.block_tables.to(torch.int32)):
                raise ValueError("ForwardBatch.host.block_tables: differs from block_tables")
        return self.host


@dataclass
class ForwardOutput:
    """logits: [R, vocab] fp32 for `logits_indices`; hidden: [T, D * n_targets] (the mean over
    streams of the inputs of the DSpark target layers, concatenated) when requested, else None."""

    logits: torch.Tensor
    hidden: torch.Tensor | None = None


@dataclass
class Compressed:
    """What a kv-source layer published this step, read back from the pages for every sequence.

    kv: [N, head_dim], index_k: [N, index_head_dim], the entries of all sequences back to back;
    sequence b's entries 0 .. counts[b]-1 are rows offsets[b] .. offsets[b]+counts[b]-1.
    """

    kv: torch.Tensor
    index_k: torch.Tensor
    offsets: list[int]
    counts: list[int]

    def subset(self, seqs: list[int]) -> Compressed:
        """The same rows, for the sequences `seqs` only (no copy)."""
        return Compressed(
            self.kv, self.index_k, [self.offsets[b] for b in seqs], [self.counts[b] for b in seqs]
        )


class HostStaging:
    """Pinned host and device int64 buffers that carry a step's host-built index tensors to the
    device in one non-blocking copy (`StepContext.staged`) instead of one pinned allocation and
    copy each (~70 us of host time apiece on the H200 host).

    `depth` buffer pairs are used in turn; a host buffer is refilled only once the copy that
    last read it has run (an event; with async scheduling at most two steps are in flight, so
    with depth 4 that wait never blocks), and the device buffer's next copy is ordered after
    every kernel of the step that read it (one stream). Owned by the model (`Model.staging`).
    """

    def __init__(self, device: torch.device, capacity: int = 1 << 20, depth: int = 4) -> None:
        self.cuda = torch.device(device).type == "cuda"
        self.pairs = [
            (
                torch.empty(capacity, dtype=torch.int64, pin_memory=self.cuda),
                torch.empty(capacity, dtype=torch.int64, device=device),
            )
            for _ in range(depth)
        ]
        self.events: list[torch.cuda.Event | None] = [None] * depth
        self.next = 0

    def acquire(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next (host, device) pair, its previous copy finished."""
        ev = self.events[self.next]
        if ev is not None and not ev.query():
            ev.synchronize()
        return self.pairs[self.next]

    def release(self, used: int) -> None:
        """Enqueue the copy of the first `used` elements of the acquired pair."""
        host, dev = self.pairs[self.next]
        if used:
            dev[:used].copy_(host[:used], non_blocking=True)
            if self.cuda:
                ev = torch.cuda.Event()
                ev.record()
                self.events[self.next] = ev
        self.next = (self.next + 1) % len(self.pairs)


class CandidateMasks:
    """The candidate source's masks per sequence b ([n_b, n_c] bool), indexed like a list.

    A batched group's masks stay stacked ([g, n, width], `set_group`) and are cut per sequence
    only when read: a decode step would otherwise build B views no later layer may read."""

    def __init__(self, num_seqs: int) -> None:
        self._masks: list[torch.Tensor | None] = [None] * num_seqs
        self._stacked: dict[int, tuple[torch.Tensor, int, int]] = {}

    def set(self, b: int, mask: torch.Tensor) -> None:
        self._masks[b] = mask

    def set_group(self, group: list[int], stacked: torch.Tensor, counts: list[int]) -> None:
        """Masks `stacked` [g, n, width] of sequences `group`; sequence b has counts[b] entries."""
        for i, b in enumerate(group):
            self._stacked[b] = (stacked, i, counts[b])

    def __len__(self) -> int:
        return len(self._masks)

    def __getitem__(self, b: int) -> torch.Tensor:
        mask = self._masks[b]
        if mask is None:
            stacked, i, count = self._stacked[b]
            mask = self._masks[b] = stacked[i, :, :count]
        return mask


def segment_ids(offsets: list[int], total: int) -> torch.Tensor:
    """CPU int64 [total]: the segment of each of `total` rows, segment b starting at row
    `offsets[b]` (non-decreasing, offsets[0] = 0; empty segments allowed). The same as
    ``repeat_interleave(arange(B), counts)``, which took ~0.75 ms per call on the H200 host
    (cProfile of tools/bench_engine.py, three calls per decode step)."""
    marks = torch.zeros(total + 1, dtype=torch.int64)
    if len(offsets) > 1:
        starts = torch.tensor(offsets[1:], dtype=torch.int64)
        marks.index_add_(0, starts, torch.ones_like(starts))
    return marks[:total].cumsum(0)


def upload(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU tensor on `device` without making the host wait: pinned + non-blocking on CUDA
    (the caching host allocator keeps the pinned buffer alive until the copy has run)."""
    if device.type == "cpu":
        return x
    if device.type == "cuda":
        return x.pin_memory().to(device, non_blocking=True)
    return x.to(device)


@dataclass
class StepContext:
    """Per-forward facts shared by all layers, plus what source layers hand to later layers.

    Host side (python ints / CPU tensors): starts/lens/ctx/slots per sequence, `pos_cpu` and
    `seq_cpu` [T] (position and sequence of each flat row), `block_tables_cpu`. Device side:
    `positions`, `seq_of` [T] and the per-token tensors of `token` (built once per forward, one
    copy). `compressed[src]`: what kv-source layer `src` published (`Compressed`); `topk[src]`:
    [T, index_topk] entry ids chosen by index source `src`; `candidates`: per sequence
    [n_b, n_c] bool masks (`candidate_groups`: the same, stacked for a group of sequences).
    """

    batch: ForwardBatch
    positions: torch.Tensor
    seq_of: torch.Tensor
    starts: list[int]
    lens: list[int]
    ctx: list[int]
    slots: list[int]
    pos_cpu: torch.Tensor
    seq_cpu: torch.Tensor
    block_tables_cpu: torch.Tensor
    token: dict[str, torch.Tensor]
    """Device [T] int64 per token: `ctx` (its sequence's context_len), `start` (its sequence's
    first flat row), `slot`, `floor` (YOCO floor, 0 without); and `slots` [B] per sequence."""
    compressed: dict[int, Compressed] = field(default_factory=dict)
    topk: dict[int, torch.Tensor] = field(default_factory=dict)
    candidates: CandidateMasks | None = None
    candidate_groups: dict[tuple[int, ...], torch.Tensor] = field(default_factory=dict)
    floor: list[int] | None = None

    block_rows: list[int] | None = None
    """Rows of `batch.block_tables` per sequence of this context (None: 0..B-1)."""

    memo: dict = field(default_factory=dict)
    """Index tensors built once per forward and shared by the layers (keyed by what they are)."""

    _stage: list | None = None
    """(pinned host buffer, device buffer, used) while inside `staged`."""

    @property
    def device(self) -> torch.device:
        return self.positions.device

    @property
    def num_tokens(self) -> int:
        return int(self.pos_cpu.shape[0])

    @property
    def num_seqs(self) -> int:
        return len(self.lens)

    # -- construction --------------------------------------------------------------------------
    @classmethod
    def from_batch(cls, batch: ForwardBatch, host: HostBatchInfo | None = None) -> StepContext:
        """Check the batch's shapes and consistency; raise ValueError naming the field.

        `host`: the batch's `host_info()` if the caller already has it."""
        t = int(batch.input_ids.shape[0])
        if batch.input_ids.dim() != 1 or t == 0:
            raise ValueError("ForwardBatch.input_ids: must be a non-empty [T] tensor")
        if batch.positions.shape != (t,):
            raise ValueError(f"ForwardBatch.positions: must be [{t}]")
        host = host or batch.host_info()
        cu = host.cu_seqlens
        b = len(cu) - 1
        if b < 1 or cu[0] != 0 or cu[-1] != t or any(cu[i] >= cu[i + 1] for i in range(b)):
            raise ValueError(f"ForwardBatch.cu_seqlens: must rise strictly from 0 to {t}, got {cu}")
        for name in ("context_lens", "slots"):
            if getattr(batch, name).shape != (b,) or len(getattr(host, name)) != b:
                raise ValueError(f"ForwardBatch.{name}: must be [{b}]")
        if batch.block_tables.dim() != 2 or batch.block_tables.shape[0] != b:
            raise ValueError(f"ForwardBatch.block_tables: must be [{b}, max_blocks]")
        ctx = host.context_lens
        if min(ctx) < 0:
            raise ValueError("ForwardBatch.context_lens: must be >= 0")
        lens = [cu[i + 1] - cu[i] for i in range(b)]
        seq_cpu = segment_ids(cu[:-1], t)
        ctx_cpu = torch.tensor(ctx, dtype=torch.int64)
        start_cpu = torch.tensor(cu[:-1], dtype=torch.int64)
        pos_cpu = ctx_cpu[seq_cpu] + torch.arange(t) - start_cpu[seq_cpu]
        if batch.positions.device.type == "cpu" and not torch.equal(
            batch.positions.long(), pos_cpu
        ):
            wrong = batch.positions.long() != pos_cpu
            bad = int(seq_cpu[torch.nonzero(wrong).flatten()[0]])
            raise ValueError(
                f"ForwardBatch.positions: sequence {bad} must be {ctx[bad]}.."
                f"{ctx[bad] + lens[bad] - 1} (context_lens[b] onwards)"
            )
        floor = None
        if batch.yoco_floor is not None or host.yoco_floor is not None:
            if batch.yoco_floor is None or host.yoco_floor is None:
                raise ValueError(
                    "ForwardBatch.yoco_floor: set in the tensors and the host mirror alike"
                )
            if batch.yoco_floor.shape != (b,) or len(host.yoco_floor) != b:
                raise ValueError(f"ForwardBatch.yoco_floor: must be [{b}]")
            floor = list(host.yoco_floor)
            if min(floor) < 0:
                raise ValueError("ForwardBatch.yoco_floor: positions must be >= 0")
        return cls._make(
            batch,
            batch.positions,
            pos_cpu,
            seq_cpu,
            cu[:-1],
            lens,
            list(ctx),
            list(host.slots),
            floor,
            None,
            host.block_tables,
        )

    @classmethod
    def _make(
        cls,
        batch: ForwardBatch,
        positions: torch.Tensor | None,
        pos_cpu: torch.Tensor,
        seq_cpu: torch.Tensor,
        starts: list[int],
        lens: list[int],
        ctx: list[int],
        slots: list[int],
        floor: list[int] | None,
        block_rows: list[int] | None,
        block_tables_cpu: torch.Tensor,
    ) -> StepContext:
        """Build the per-token device tensors from the host facts in one upload."""
        dev = batch.input_ids.device
        t = int(pos_cpu.shape[0])

        def per_seq(v: list[int]) -> torch.Tensor:
            return torch.tensor(v, dtype=torch.int64)[seq_cpu]

        rows = [
            seq_cpu,
            per_seq(ctx),
            per_seq(starts),
            per_seq(slots),
            per_seq(floor) if floor is not None else torch.zeros(t, dtype=torch.int64),
            pos_cpu,
        ]
        packed = torch.cat([torch.stack(rows).flatten(), torch.tensor(slots, dtype=torch.int64)])
        packed = upload(packed, dev)
        per_tok = packed[: len(rows) * t].view(len(rows), t)
        token = {
            "ctx": per_tok[1],
            "start": per_tok[2],
            "slot": per_tok[3],
            "floor": per_tok[4],
            "slots": packed[len(rows) * t :],
        }
        return cls(
            batch=batch,
            positions=per_tok[5] if positions is None else positions,
            seq_of=per_tok[0],
            starts=starts,
            lens=lens,
            ctx=ctx,
            slots=slots,
            pos_cpu=pos_cpu,
            seq_cpu=seq_cpu,
            block_tables_cpu=block_tables_cpu,
            token=token,
            floor=floor,
            block_rows=block_rows,
        )

    # -- shared index tensors ------------------------------------------------------------------
    def memoized(self, key: object, build: Callable[[], object]):
        """`build()` once per forward (per context) under `key`."""
        if key not in self.memo:
            self.memo[key] = build()
        return self.memo[key]

    def upload(self, x: torch.Tensor) -> torch.Tensor:
        """`x` (CPU) on the step's device without a host wait. Inside `staged`, an int64 tensor
        becomes a view of the staging buffer instead, valid for kernels enqueued after the
        `staged` block (which is when the one copy is enqueued)."""
        if self._stage is not None and x.dtype == torch.int64:
            host, dev, used = self._stage
            n = x.numel()
            if used + n <= host.numel():
                host[used : used + n].copy_(x.flatten())
                self._stage[2] = used + n
                return dev[used : used + n].view(x.shape)
        return upload(x, self.device)

    @contextmanager
    def staged(self, staging: HostStaging | None) -> Iterator[None]:
        """Uploads inside the block go through one staging buffer pair of `staging` (on this
        step's device) and one non-blocking copy at its end (None: plain uploads). The block
        may only build index tensors: nothing run inside it may read an upload."""
        if staging is None:
            yield
            return
        host, dev = staging.acquire()
        self._stage = [host, dev, 0]
        try:
            yield
        finally:
            used = self._stage[2]
            self._stage = None
            staging.release(used)

    def last_positions_cpu(self) -> torch.Tensor:
        """[B] CPU int64: each sequence's newest position in this step."""
        return torch.tensor([c + n - 1 for c, n in zip(self.ctx, self.lens, strict=True)])

    def ring_write(self, ring_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Where this step's rows go in a per-slot ring of `ring_len` rows indexed by position:
        (flat rows [T'], slot [T'], ring row [T']) on the device, only the newest `ring_len`
        positions of each sequence (so no two rows hit the same ring row)."""

        def build():
            last = self.last_positions_cpu()[self.seq_cpu]
            rows = torch.nonzero(self.pos_cpu > last - ring_len).flatten()
            slot = torch.tensor(self.slots, dtype=torch.int64)[self.seq_cpu[rows]]
            packed = self.upload(torch.stack([rows, slot, self.pos_cpu[rows] % ring_len]))
            return packed[0], packed[1], packed[2]

        return self.memoized(("ring_write", ring_len), build)

    def window(self, window: int, ring_len: int) -> torch.Tensor:
        """[T, window] rows into ``cat([rings of the batch's slots [B*ring], this step's kv [T]])``.

        Token at position p of sequence b sees positions p-window+1 .. p; positions before the
        step come from ring row ``b*ring_len + q % ring_len``, the step's own from
        ``B*ring_len + row``; positions < 0 (or below the YOCO floor) are -1.
        """

        def build():
            dev = self.device
            ctx_t = self.token["ctx"].unsqueeze(1)
            q = self.positions.unsqueeze(1) - window + 1 + torch.arange(window, device=dev)
            from_step = self.num_seqs * ring_len + self.token["start"].unsqueeze(1) + q - ctx_t
            from_ring = self.seq_of.unsqueeze(1) * ring_len + q.remainder(ring_len)
            idx = torch.where(q >= ctx_t, from_step, from_ring)
            lowest = self.token["floor"].unsqueeze(1).clamp_min(0)
            return torch.where(q < lowest, -1, idx)

        return self.memoized(("window", window, ring_len), build)

    def _pages(self, seq: torch.Tensor, entry: torch.Tensor, ratio: int, block_size: int):
        """CPU (page ids, rows) of compressed entries `entry` of sequences `seq` (both [M])."""
        tok = entry * ratio
        col = tok // block_size
        bt = self.block_tables_cpu
        brow = seq if self.block_rows is None else torch.tensor(self.block_rows)[seq]
        if col.numel() and int(col.max()) >= bt.shape[1]:
            raise ValueError(
                f"block_tables: entry {int(entry.max())} needs page column {int(col.max())} "
                f"but the table has {bt.shape[1]}"
            )
        pages = bt[brow, col].long()
        if pages.numel() and int(pages.min()) < 0:
            raise ValueError("block_tables: a needed page id is -1 (unallocated)")
        return pages, (tok % block_size) // ratio

    def completed_entries(self, ratio: int, block_size: int) -> dict[str, torch.Tensor]:
        """The compressed entries whose group of `ratio` positions closes in this step.

        Device [M] int64: `rows` (flat row of the closing token), `seq`, `entry` (entry id in
        its sequence), `page`, `page_row` (where the entry lives); `count`: M as a python int.
        """

        def build():
            rows = torch.nonzero((self.pos_cpu + 1) % ratio == 0).flatten()
            seq = self.seq_cpu[rows]
            entry = (self.pos_cpu[rows] + 1) // ratio - 1
            pages, prow = self._pages(seq, entry, ratio, block_size)
            packed = self.upload(torch.stack([rows, seq, entry, pages, prow]))
            out = dict(zip(("rows", "seq", "entry", "page", "page_row"), packed, strict=True))
            out["count"] = int(rows.shape[0])
            return out

        return self.memoized(("completed", ratio, block_size), build)

    def group_sources(
        self, ratio: int, state_len: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Where the `ratio` positions of each entry closing this step (`completed_entries`'
        order) are: device (flat row [M, r], state slot [M, r], state row [M, r] in a per-slot
        ring of `state_len` rows, in_chunk [M, r] int64: 1 if the position is a row of this
        step, 0 if it is in the state ring)."""

        def build():
            rows = torch.nonzero((self.pos_cpu + 1) % ratio == 0).flatten()
            seq = self.seq_cpu[rows]
            gpos = self.pos_cpu[rows].unsqueeze(1) - (ratio - 1) + torch.arange(ratio)
            ctx_m = torch.tensor(self.ctx, dtype=torch.int64)[seq].unsqueeze(1)
            start = torch.tensor(self.starts, dtype=torch.int64)[seq].unsqueeze(1)
            slot = torch.tensor(self.slots, dtype=torch.int64)[seq].unsqueeze(1).expand_as(gpos)
            in_chunk = (gpos >= ctx_m).long()
            flat_row = (start + gpos - ctx_m).clamp_min(0)
            packed = self.upload(torch.stack([flat_row, slot, gpos % state_len, in_chunk]))
            return packed[0], packed[1], packed[2], packed[3]

        return self.memoized(("group_sources", ratio, state_len), build)

    def all_entries(self, ratio: int, block_size: int):
        """Every compressed entry of every sequence up to this step's last token: device
        (page ids [N], rows [N]), per sequence (offsets, counts) into that list, and device
        [T] each token's sequence offset (what `entry_offsets` gives once published)."""

        def build():
            counts = [(c + n) // ratio for c, n in zip(self.ctx, self.lens, strict=True)]
            offsets = [0]
            for c in counts[:-1]:
                offsets.append(offsets[-1] + c)
            total = offsets[-1] + counts[-1]
            seq = segment_ids(offsets, total)
            entry = torch.arange(total) - torch.tensor(offsets)[seq]
            pages, prow = self._pages(seq, entry, ratio, block_size)
            token_offsets = torch.tensor(offsets, dtype=torch.int64)[self.seq_cpu]
            packed = self.upload(torch.cat([pages, prow, token_offsets]))
            return packed[:total], packed[total : 2 * total], offsets, counts, packed[2 * total :]

        return self.memoized(("all_entries", ratio, block_size), build)

    def entry_offsets(self, src: int) -> torch.Tensor:
        """[T] device: the first row of each token's sequence in `compressed[src]`."""
        comp = self.compressed[src]
        return self.memoized(
            ("entry_offsets", src),
            lambda: self.upload(torch.tensor(comp.offsets, dtype=torch.int64)[self.seq_cpu]),
        )

    def equal_length_groups(self, max_len: int) -> list[list[int]]:
        """Sequences grouped by number of new tokens (n <= max_len share a group, in order);
        longer ones alone. Groups of decode/verify rows run the indexer batched."""
        by_len: dict[int, list[int]] = {}
        alone = []
        for b, n in enumerate(self.lens):
            if n <= max_len:
                by_len.setdefault(n, []).append(b)
            else:
                alone.append([b])
        return list(by_len.values()) + alone

    # -- YOCO ----------------------------------------------------------------------------------
    def late_subset(self) -> tuple[StepContext, torch.Tensor, torch.Tensor] | None:
        """The context of the tokens at or after each sequence's YOCO floor (None when every
        token is kept), and the kept flat rows [T'] (device, CPU). Sequences with no kept token
        drop out; per-sequence and per-token state handed down by earlier layers is subset
        alike."""
        if self.floor is None:
            return None
        floor_tok = torch.tensor(self.floor, dtype=torch.int64)[self.seq_cpu]
        keep = self.pos_cpu >= floor_tok
        if bool(keep.all()):
            return None
        rows_cpu = torch.nonzero(keep).flatten()
        rows = self.upload(rows_cpu)
        seqs = [b for b in range(self.num_seqs) if self.ctx[b] + self.lens[b] > self.floor[b]]
        starts, lens, ctxs = [], [], []
        for b in seqs:
            first = max(self.ctx[b], self.floor[b])
            starts.append(sum(lens))
            lens.append(self.ctx[b] + self.lens[b] - first)
            ctxs.append(first)
        remap = torch.full((self.num_seqs,), -1, dtype=torch.int64)
        remap[torch.tensor(seqs, dtype=torch.int64)] = torch.arange(len(seqs))
        sub = StepContext._make(
            self.batch,
            None,
            self.pos_cpu[rows_cpu],
            remap[self.seq_cpu[rows_cpu]],
            starts,
            lens,
            ctxs,
            [self.slots[b] for b in seqs],
            [self.floor[b] for b in seqs],
            [b if self.block_rows is None else self.block_rows[b] for b in seqs],
            self.block_tables_cpu,
        )
        sub.compressed = {k: v.subset(seqs) for k, v in self.compressed.items()}
        sub.topk = {k: v[rows] for k, v in self.topk.items()}
        if self.candidates is not None:
            sub.candidates = CandidateMasks(len(seqs))
            for i, b in enumerate(seqs):
                sub.candidates.set(i, self.candidates[b][ctxs[i] - self.ctx[b] :])
        return sub, rows, rows_cpu
