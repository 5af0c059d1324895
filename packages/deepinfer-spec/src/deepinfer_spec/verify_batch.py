"""The flat varlen verify batch (inputs, their checks, the row layout) and the typed result.

A verify step checks ``K_b >= 0`` draft tokens for each of ``B`` sequences at once. Everything is
flat, as in the model's forward pass:

* ``cu_num_draft_tokens [B + 1]``: int64 prefix sums of ``K_b`` (``cu[0] = 0``); sequence ``b``'s
  drafts are rows ``cu[b] .. cu[b+1] - 1`` of the draft tensors.
* ``draft_token_ids [T]`` with ``T = sum K_b``; ``draft_probs [T, V]`` or ``None`` (one-hot drafts).
* ``target_probs [T + B, V]``: ``K_b + 1`` rows per sequence, rows ``cu[b] + b .. cu[b+1] + b``;
  row ``cu[b] + b + k`` is the target's distribution for the token after ``k`` accepted drafts,
  the last one for the bonus token. These are the *final* distributions (after penalties,
  temperature, top-k/top-p and the grammar mask), as the non-speculative sampler would use them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class VerifyResult:
    """Outcome of verifying one flat batch of ``B`` sequences.

    Attributes:
        num_accepted: ``[B]`` int64, how many leading drafts of each sequence were accepted
            (``0 <= num_accepted[b] <= K_b``).
        next_token_ids: ``[B]`` int64, the token emitted after the accepted drafts: the corrected
            token at the first rejection, or the bonus token when all drafts were accepted.
        output_token_ids: ``[B, max_K + 1]`` int64, the accepted drafts followed by the next
            token, padded with ``-1``; row ``b`` holds ``num_accepted[b] + 1`` real tokens.
    """

    num_accepted: torch.Tensor
    next_token_ids: torch.Tensor
    output_token_ids: torch.Tensor

    @property
    def num_emitted(self) -> torch.Tensor:
        """``[B]`` int64 tokens emitted per sequence (accepted drafts + 1)."""
        return self.num_accepted + 1

    def tokens(self, b: int) -> list[int]:
        """The tokens sequence ``b`` emits this step, in order."""
        return self.output_token_ids[b, : int(self.num_accepted[b]) + 1].tolist()


@dataclass(frozen=True)
class DraftLayout:
    """Row bookkeeping derived from ``cu_num_draft_tokens [B + 1]`` (all int64, one device).

    Attributes:
        num_drafts: ``[B]`` ``K_b``.
        seq_of_draft: ``[T]`` the sequence of each draft row.
        index_in_seq: ``[T]`` ``k``, the draft's index inside its sequence.
        target_row_of_draft: ``[T]`` the target row that judges each draft (``t + seq``).
        first_target_row: ``[B]`` ``cu[b] + b``, the target row for ``k = 0``.
    """

    num_drafts: torch.Tensor
    seq_of_draft: torch.Tensor
    index_in_seq: torch.Tensor
    target_row_of_draft: torch.Tensor
    first_target_row: torch.Tensor

    @property
    def batch_size(self) -> int:
        return self.num_drafts.shape[0]

    @property
    def max_drafts(self) -> int:
        return int(self.num_drafts.max()) if self.batch_size else 0

    @staticmethod
    def from_cu(cu_num_draft_tokens: torch.Tensor) -> DraftLayout:
        cu = cu_num_draft_tokens
        device = cu.device
        num_drafts = cu[1:] - cu[:-1]
        batch = num_drafts.shape[0]
        seq_ids = torch.arange(batch, dtype=torch.int64, device=device)
        seq_of_draft = torch.repeat_interleave(seq_ids, num_drafts)
        draft_rows = torch.arange(seq_of_draft.shape[0], dtype=torch.int64, device=device)
        return DraftLayout(
            num_drafts=num_drafts,
            seq_of_draft=seq_of_draft,
            index_in_seq=draft_rows - cu[seq_of_draft],
            target_row_of_draft=draft_rows + seq_of_draft,
            first_target_row=cu[:-1] + seq_ids,
        )

    def to(self, device: torch.device | str) -> DraftLayout:
        """The same layout with every tensor on ``device``."""
        return DraftLayout(
            **{name: getattr(self, name).to(device) for name in self.__dataclass_fields__}
        )

    def count_leading_true(self, ok: torch.Tensor) -> torch.Tensor:
        """``[B]`` length of each sequence's leading run of True in ``ok [T]`` (bool)."""
        # First failing index per sequence; K_b when none fails.
        first_fail = self.num_drafts.clone()
        fail_index = torch.where(ok, self.num_drafts[self.seq_of_draft], self.index_in_seq)
        return first_fail.scatter_reduce_(0, self.seq_of_draft, fail_index, reduce="amin")

    def assemble(
        self,
        draft_token_ids: torch.Tensor,
        num_accepted: torch.Tensor,
        next_token_ids: torch.Tensor,
    ) -> VerifyResult:
        """Build the :class:`VerifyResult` (accepted drafts, then the next token, -1 padded)."""
        batch = self.batch_size
        out = torch.full(
            (batch, self.max_drafts + 1), -1, dtype=torch.int64, device=draft_token_ids.device
        )
        keep = self.index_in_seq < num_accepted[self.seq_of_draft]
        out[self.seq_of_draft[keep], self.index_in_seq[keep]] = draft_token_ids[keep].to(
            torch.int64
        )
        seq_ids = torch.arange(batch, device=out.device)
        out[seq_ids, num_accepted] = next_token_ids
        return VerifyResult(
            num_accepted=num_accepted, next_token_ids=next_token_ids, output_token_ids=out
        )


def check_draft_layout(
    cu_num_draft_tokens: torch.Tensor, draft_token_ids: torch.Tensor
) -> DraftLayout:
    """Validate ``cu_num_draft_tokens [B + 1]`` and ``draft_token_ids [T]``; return the layout.

    Raises:
        ValueError: naming the offending argument and what was expected.
    """
    cu = cu_num_draft_tokens
    if cu.dtype != torch.int64 or cu.dim() != 1 or cu.shape[0] < 1:
        raise ValueError(
            f"cu_num_draft_tokens must be a 1-D int64 tensor [B + 1], got dtype {cu.dtype}, "
            f"shape {list(cu.shape)}"
        )
    if int(cu[0]) != 0 or bool((cu[1:] < cu[:-1]).any()):
        raise ValueError(
            f"cu_num_draft_tokens must start at 0 and be non-decreasing, got {cu.tolist()}"
        )
    total = int(cu[-1])
    if draft_token_ids.dim() != 1 or draft_token_ids.shape[0] != total:
        raise ValueError(
            f"draft_token_ids must be [sum K] = [{total}], got {list(draft_token_ids.shape)}"
        )
    if draft_token_ids.dtype.is_floating_point or draft_token_ids.dtype == torch.bool:
        raise ValueError(f"draft_token_ids must be integer, got dtype {draft_token_ids.dtype}")
    return DraftLayout.from_cu(cu)


def check_verify_inputs(
    cu_num_draft_tokens: torch.Tensor,
    draft_token_ids: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
) -> DraftLayout:
    """Validate the flat verify batch and return its :class:`DraftLayout`.

    Raises:
        ValueError: naming the offending argument and what was expected.
    """
    layout = check_draft_layout(cu_num_draft_tokens, draft_token_ids)
    batch, total = layout.batch_size, draft_token_ids.shape[0]
    if target_probs.dim() != 2 or target_probs.shape[0] != total + batch:
        raise ValueError(
            f"target_probs must be [sum K + B, V] = [{total + batch}, V], got "
            f"{list(target_probs.shape)}"
        )
    if not target_probs.dtype.is_floating_point:
        raise ValueError(f"target_probs must be floating point, got dtype {target_probs.dtype}")
    vocab = target_probs.shape[1]
    if vocab == 0:
        raise ValueError("target_probs must have a vocabulary dimension V >= 1")
    if total:
        lo, hi = torch.stack(torch.aminmax(draft_token_ids)).tolist()  # one host read, not two
        if lo < 0 or hi >= vocab:
            raise ValueError(f"draft_token_ids must lie in [0, V = {vocab})")
    if draft_probs is not None and (
        draft_probs.dim() != 2 or tuple(draft_probs.shape) != (total, vocab)
    ):
        raise ValueError(
            f"draft_probs must be None or [sum K, V] = [{total}, {vocab}], got "
            f"{list(draft_probs.shape)}"
        )
    return layout.to(target_probs.device)


def check_row_keys(
    seeds: torch.Tensor | None, positions: torch.Tensor | None, batch: int, num_target_rows: int
) -> None:
    """Validate per-sequence ``seeds [B]`` and per-target-row ``positions [T + B]`` (both int64)."""
    if seeds is None:
        return
    if seeds.dtype != torch.int64 or tuple(seeds.shape) != (batch,):
        raise ValueError(
            f"seeds must be int64 [B] = [{batch}], got dtype {seeds.dtype}, shape "
            f"{list(seeds.shape)}"
        )
    if positions is None:
        raise ValueError("positions [sum K + B] is required when seeds are given")
    if positions.dtype != torch.int64 or tuple(positions.shape) != (num_target_rows,):
        raise ValueError(
            f"positions must be int64 [sum K + B] = [{num_target_rows}] (the position of the "
            f"token each target row decides), got dtype {positions.dtype}, shape "
            f"{list(positions.shape)}"
        )
