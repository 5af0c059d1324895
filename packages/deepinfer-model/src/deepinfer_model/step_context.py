"""The attention metadata of one forward (`StepContext`): the per-step facts every layer derives
from the `ForwardBatch`, the index tensors built from them once per step (windows, ring writes,
compressed entries and their pages), and what source layers hand to later layers (`Compressed`,
top-k ids, `CandidateMasks`).

No device->host reads: everything decided on the host (sequence ranges, which rows close a
compressed group, which pages hold which entries, which ring rows to write) comes from the
batch's CPU mirror (`HostBatchInfo`); the index tensors built from it go to the device in
pinned, non-blocking copies (`staging`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from .batch import YOCO_TRUNCATION_MODES, ForwardBatch, HostBatchInfo
from .staging import HostStaging, upload


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
    first flat row), `slot`, `floor` (the lowest position its window sees: the YOCO floor in
    the consumer layers' context, `consumer_view`, else 0); and `slots` [B] per sequence."""
    compressed: dict[int, Compressed] = field(default_factory=dict)
    topk: dict[int, torch.Tensor] = field(default_factory=dict)
    candidates: CandidateMasks | None = None
    candidate_groups: dict[tuple[int, ...], torch.Tensor] = field(default_factory=dict)
    floor: list[int] | None = None
    """The batch's YOCO floor per sequence (None: the exact path)."""
    truncation: str = "compact"
    """How the floor truncates the consumer layers (`ForwardBatch.yoco_truncation`)."""

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
        if batch.yoco_truncation not in YOCO_TRUNCATION_MODES:
            raise ValueError(
                f"ForwardBatch.yoco_truncation: {batch.yoco_truncation!r} is not one of "
                f"{', '.join(YOCO_TRUNCATION_MODES)}"
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
            False,
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
        floored_windows: bool,
        block_rows: list[int] | None,
        block_tables_cpu: torch.Tensor,
    ) -> StepContext:
        """Build the per-token device tensors from the host facts in one upload; the windows
        stop at `floor` iff `floored_windows`."""
        dev = batch.input_ids.device
        t = int(pos_cpu.shape[0])

        def per_seq(v: list[int]) -> torch.Tensor:
            return torch.tensor(v, dtype=torch.int64)[seq_cpu]

        narrow = floored_windows and floor is not None
        rows = [
            seq_cpu,
            per_seq(ctx),
            per_seq(starts),
            per_seq(slots),
            per_seq(floor) if narrow else torch.zeros(t, dtype=torch.int64),
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
            truncation=batch.yoco_truncation,
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
        ``B*ring_len + row``; positions < 0 (or, in the consumer layers' context, below the
        YOCO floor) are -1.
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
    def consumer_view(self) -> tuple[StepContext, torch.Tensor | None, torch.Tensor | None]:
        """The context of the consumer layers (from the CED decoder start on) under the
        batch's YOCO floor, as DeepInfer's truncation gives them: their windows never reach
        below a sequence's floor, and with `compact` truncation only the tokens at or after it
        run them (`mask`: every token, a token below its floor seeing no window position).

        Returns (context, kept flat rows on the device, the same on the CPU); the rows are None
        when every token runs on, and the context then has this one's rows. Sequences with no
        kept token drop out; what earlier layers handed down (compressed entries, top-k ids,
        candidates) is subset alike. Without a floor: (self, None, None)."""
        if self.floor is None:
            return self, None, None
        floor_tok = torch.tensor(self.floor, dtype=torch.int64)[self.seq_cpu]
        keep = self.pos_cpu >= floor_tok
        if self.truncation == "mask" or bool(keep.all()):
            token = {**self.token, "floor": self.upload(floor_tok)}
            # the windows depend on the floor; every other index tensor is the same
            memo = {
                k: v for k, v in self.memo.items() if not (type(k) is tuple and k[0] == "window")
            }
            return dataclasses.replace(self, token=token, memo=memo, _stage=None), None, None
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
            True,
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
