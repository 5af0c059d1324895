"""The flat batch the engine hands the model for one forward (`ForwardBatch`), its CPU mirror
(`HostBatchInfo`), the result (`ForwardOutput`), and the one builder of batches (`build_batch`,
from per-sequence `SequenceInput`s), used by the engine's runner and by tests alike.

A batch built here carries its CPU mirror, so the forward decides everything on the host and
never reads the device back; the batch itself reaches the device in one pinned, non-blocking
copy, and tokens still in flight are filled in on the device. So on CUDA building and running a
batch only enqueue work (async scheduling overlaps the next step's host work with this step's
kernels).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .staging import upload

YOCO_TRUNCATION_MODES = ("compact", "mask")
"""How a YOCO floor truncates the consumer layers (`ForwardBatch.yoco_truncation`)."""


@dataclass
class SequenceInput:
    """One sequence's share of a step, as `build_batch` takes it.

    token_ids: its new tokens, -1 where a token is still in flight (sampled by the previous
    step, not known on the host yet); start: the position of the first one (= its tokens
    already in the cache); slot: its per-slot state index; block_table: its page ids; sample:
    its last row's logits are wanted; yoco_floor: its YOCO floor (see `ForwardBatch`), None for
    the exact path; prev_row: the row of the previous step's sampled ids that holds its token in
    flight (needed iff a token is -1).
    """

    token_ids: list[int]
    start: int
    slot: int
    block_table: list[int]
    sample: bool = True
    yoco_floor: int | None = None
    prev_row: int | None = None


def build_batch(
    seqs: Sequence[SequenceInput],
    device: torch.device | str,
    *,
    prev_token_ids: torch.Tensor | None = None,
    logits_rows: list[int] | None = None,
    return_hidden: bool = False,
    yoco_truncation: str = "compact",
) -> ForwardBatch:
    """The `ForwardBatch` of `seqs` on `device`, with its host mirror.

    Everything goes to the device in one pinned, non-blocking copy; the -1 placeholders are
    then filled on the device from `prev_token_ids` [S] (the previous step's sampled ids, row
    `prev_row` of each sequence), so building never waits for the device. `logits_rows`: the
    flat rows whose logits are wanted (default: the last row of every sequence with `sample`).
    `yoco_floor` is set for every sequence or for none; `yoco_truncation` says how it
    truncates (see `ForwardBatch`).
    """
    ids: list[int] = []
    pos: list[int] = []
    cu = [0]
    ph_dst: list[int] = []
    ph_src: list[int] = []
    rows: list[int] = []
    for s in seqs:
        if not s.token_ids:
            raise ValueError("build_batch: every sequence needs at least one new token")
        base = len(ids)
        for j, t in enumerate(s.token_ids):
            if t < 0:
                if s.prev_row is None or prev_token_ids is None:
                    raise ValueError(
                        "build_batch: a token in flight (-1) needs prev_row and prev_token_ids"
                    )
                ph_dst.append(base + j)
                ph_src.append(s.prev_row)
                t = 0
            ids.append(t)
        pos.extend(range(s.start, s.start + len(s.token_ids)))
        cu.append(len(ids))
        if s.sample:
            rows.append(len(ids) - 1)
    if logits_rows is not None:
        rows = list(logits_rows)
    floors = [s.yoco_floor for s in seqs]
    floor = None
    if any(f is not None for f in floors):
        if any(f is None for f in floors):
            raise ValueError("build_batch: yoco_floor must be set for every sequence or none")
        floor = [int(f) for f in floors]
    tables = [s.block_table for s in seqs]
    width = max(1, max(len(t) for t in tables))
    # one tensor from padded lists (a torch.tensor per row cost ~5 us each at 64+ rows)
    bt = torch.tensor([list(t) + [-1] * (width - len(t)) for t in tables], dtype=torch.int32)
    ctx_lens = [s.start for s in seqs]
    slots = [s.slot for s in seqs]
    parts = [ids, pos, cu, ctx_lens, slots, rows, floor or [], ph_dst, ph_src]
    flat = torch.cat([torch.tensor(p, dtype=torch.int64) for p in parts] + [bt.flatten().long()])
    flat = upload(flat, torch.device(device))
    views, o = [], 0
    for n in [len(p) for p in parts] + [bt.numel()]:
        views.append(flat[o : o + n])
        o += n
    input_ids, positions, cu_t, ctx_t, slots_t, rows_t, floor_t, dst_t, src_t, bt_t = views
    if ph_dst:
        input_ids[dst_t] = prev_token_ids[src_t]
    return ForwardBatch(
        input_ids=input_ids,
        positions=positions,
        cu_seqlens=cu_t.to(torch.int32),
        context_lens=ctx_t,
        slots=slots_t,
        block_tables=bt_t.view(len(seqs), width).to(torch.int32),
        logits_indices=rows_t,
        return_hidden=return_hidden,
        yoco_floor=floor_t if floor is not None else None,
        yoco_truncation=yoco_truncation,
        host=HostBatchInfo(cu, ctx_lens, slots, bt, rows, floor),
    )


@dataclass
class HostBatchInfo:
    """CPU copies of a `ForwardBatch`'s metadata (`build_batch` makes both from the same lists).

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
    yoco_floor: optional [B] int64 (DeepInfer's YOCO prefill truncation, "decoder SWA bounded
    replay"): the first position of each sequence whose tokens the consumer layers (from
    `config.decoder_start_layer` on) fully run; their windows never reach below it. The producer
    layers before them run every token as without a floor, and so does the decoder start's
    compressor (the compressed KV and index keys of every token). 0 (or None) = exact path.
    Pass the same value for a sequence's whole life (prompt chunks and decode steps) once set.
    yoco_truncation: "compact" (tokens below the floor stop before the consumer layers: their
    logits cannot be requested) or "mask" (every token runs every layer; one below its floor
    sees no window position in the consumer layers, so its logits are approximate too).
    host: optional CPU mirror of the metadata (`HostBatchInfo`). Give it whenever the tensors are
    on an accelerator: without it the forward reads the metadata back (one sync per forward). On
    CUDA the forward then trusts the device tensors to match it and does not re-check
    `input_ids`/`positions` on the device (the engine validates token ids at admission); with CPU
    tensors everything is checked, the mirror included.
    collective_rows: for a model sharded over several ranks (`Model(shard=...)`), the token rows
    every rank of its groups pads the step's collectives to (the step's agreed maximum, >= T);
    None: T. A model held whole has no collectives and needs none.
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
    yoco_truncation: str = "compact"
    host: HostBatchInfo | None = None
    collective_rows: int | None = None

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
        """`build_batch` from per-sequence lists (tests, tools).

        `logits_rows`: "last" (last token of each sequence), "all", or explicit flat rows.
        On a non-CPU device the batch carries its `host` mirror (so set `yoco_floor` through
        `with_yoco_floor`, which keeps the mirror in step); on CPU it has none (tests edit fields).
        """
        if not (len(seqs) == len(context_lens) == len(slots) == len(block_tables)):
            raise ValueError(
                "ForwardBatch.build: seqs, context_lens, slots, block_tables differ in length"
            )
        inputs = [
            SequenceInput(list(t), c, s, list(b))
            for t, c, s, b in zip(seqs, context_lens, slots, block_tables, strict=True)
        ]
        rows = None
        if logits_rows == "all":
            rows = list(range(sum(len(t) for t in seqs)))
        elif logits_rows != "last":
            rows = list(logits_rows)
        batch = build_batch(inputs, device, logits_rows=rows, return_hidden=return_hidden)
        if batch.input_ids.device.type == "cpu":
            batch.host = None
        return batch

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
            yoco_truncation=self.yoco_truncation,
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
