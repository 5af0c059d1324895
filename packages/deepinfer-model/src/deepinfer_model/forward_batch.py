"""The flat batch one forward call runs (`ForwardBatch`), its result (`ForwardOutput`), and the
per-step facts every layer derives from it (`StepContext`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


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
        return cls(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=dev),
            positions=torch.tensor(pos, dtype=torch.int64, device=dev),
            cu_seqlens=torch.tensor(cu, dtype=torch.int32, device=dev),
            context_lens=torch.tensor(context_lens, dtype=torch.int64, device=dev),
            slots=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_tables=bt.to(dev),
            logits_indices=torch.tensor(rows, dtype=torch.int64, device=dev),
            return_hidden=return_hidden,
        )


@dataclass
class ForwardOutput:
    """logits: [R, vocab] fp32 for `logits_indices`; hidden: [T, D * n_targets] (the mean over
    streams of the inputs of the DSpark target layers, concatenated) when requested, else None."""

    logits: torch.Tensor
    hidden: torch.Tensor | None = None


@dataclass
class StepContext:
    """Per-forward facts shared by all layers, plus what source layers hand to later layers.

    seq_of: [T] sequence index of each row; starts/lens/ctx/ends: python ints per sequence.
    `compressed[src]`: per sequence (kv [n_c, head_dim], index_k [n_c, index_head_dim]) read back
    from the pages after kv-source layer `src` wrote them; `topk[src]`: [T, index_topk] entry ids
    chosen by index source `src`; `candidates`: per sequence [n_b, n_c] bool masks.
    """

    batch: ForwardBatch
    positions: torch.Tensor
    seq_of: torch.Tensor
    starts: list[int]
    lens: list[int]
    ctx: list[int]
    slots: list[int]
    compressed: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=dict)
    topk: dict[int, torch.Tensor] = field(default_factory=dict)
    candidates: list[torch.Tensor] | None = None
    floor: list[int] | None = None

    block_rows: list[int] | None = None
    """Rows of `batch.block_tables` per sequence of this context (None: 0..B-1)."""

    def block_table(self, b: int) -> torch.Tensor:
        return self.batch.block_tables[b if self.block_rows is None else self.block_rows[b]]

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    @property
    def num_seqs(self) -> int:
        return len(self.lens)

    @classmethod
    def from_batch(cls, batch: ForwardBatch) -> StepContext:
        """Check the batch's shapes and consistency; raise ValueError naming the field."""
        t = int(batch.input_ids.shape[0])
        cu = [int(v) for v in batch.cu_seqlens.tolist()]
        b = len(cu) - 1
        if batch.input_ids.dim() != 1 or t == 0:
            raise ValueError("ForwardBatch.input_ids: must be a non-empty [T] tensor")
        if batch.positions.shape != (t,):
            raise ValueError(f"ForwardBatch.positions: must be [{t}]")
        if b < 1 or cu[0] != 0 or cu[-1] != t or any(cu[i] >= cu[i + 1] for i in range(b)):
            raise ValueError(f"ForwardBatch.cu_seqlens: must rise strictly from 0 to {t}, got {cu}")
        for name in ("context_lens", "slots"):
            if getattr(batch, name).shape != (b,):
                raise ValueError(f"ForwardBatch.{name}: must be [{b}]")
        if batch.block_tables.dim() != 2 or batch.block_tables.shape[0] != b:
            raise ValueError(f"ForwardBatch.block_tables: must be [{b}, max_blocks]")
        ctx = [int(v) for v in batch.context_lens.tolist()]
        pos = batch.positions.tolist()
        for i in range(b):
            want = list(range(ctx[i], ctx[i] + cu[i + 1] - cu[i]))
            if pos[cu[i] : cu[i + 1]] != want:
                raise ValueError(
                    f"ForwardBatch.positions: sequence {i} must be {ctx[i]}..{want[-1]} "
                    "(context_lens[b] onwards)"
                )
        lens = [cu[i + 1] - cu[i] for i in range(b)]
        floor = None
        if batch.yoco_floor is not None:
            if batch.yoco_floor.shape != (b,):
                raise ValueError(f"ForwardBatch.yoco_floor: must be [{b}]")
            floor = [int(v) for v in batch.yoco_floor.tolist()]
            if min(floor) < 0:
                raise ValueError("ForwardBatch.yoco_floor: positions must be >= 0")
        seq_of = torch.repeat_interleave(
            torch.arange(b, device=batch.input_ids.device),
            torch.tensor(lens, device=batch.input_ids.device),
        )
        return cls(
            batch=batch,
            positions=batch.positions,
            seq_of=seq_of,
            starts=cu[:-1],
            lens=lens,
            ctx=ctx,
            slots=[int(s) for s in batch.slots.tolist()],
            floor=floor,
        )

    def late_subset(self) -> tuple[StepContext, torch.Tensor] | None:
        """The context of the tokens at or after each sequence's YOCO floor (None when every
        token is kept), and the kept flat rows [T']. Sequences with no kept token drop out;
        per-sequence and per-token state handed down by earlier layers is subset alike."""
        if self.floor is None:
            return None
        dev = self.positions.device
        floor_t = torch.tensor(self.floor, device=dev)
        keep = self.positions >= floor_t[self.seq_of]
        if bool(keep.all()):
            return None
        rows = torch.nonzero(keep).flatten()
        seqs = [b for b in range(self.num_seqs) if self.ctx[b] + self.lens[b] > self.floor[b]]
        starts, lens, ctxs = [], [], []
        for b in seqs:
            first = max(self.ctx[b], self.floor[b])
            starts.append(sum(lens))
            lens.append(self.ctx[b] + self.lens[b] - first)
            ctxs.append(first)
        remap = {b: i for i, b in enumerate(seqs)}
        seq_of = torch.tensor(
            [remap[int(b)] for b in self.seq_of[rows].tolist()], device=dev, dtype=torch.int64
        )
        sub = StepContext(
            batch=self.batch,
            positions=self.positions[rows],
            seq_of=seq_of,
            starts=starts,
            lens=lens,
            ctx=ctxs,
            slots=[self.slots[b] for b in seqs],
            compressed={k: [v[b] for b in seqs] for k, v in self.compressed.items()},
            topk={k: v[rows] for k, v in self.topk.items()},
            candidates=None,
            floor=[self.floor[b] for b in seqs],
            block_rows=[b if self.block_rows is None else self.block_rows[b] for b in seqs],
        )
        if self.candidates is not None:
            sub.candidates = [
                self.candidates[b][ctxs[i] - self.ctx[b] :] for i, b in enumerate(seqs)
            ]
        return sub, rows
