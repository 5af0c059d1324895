"""vLLM's `prompt_logprobs` from a step's prefill logits.

A chunk whose `prompt_logits` is (a, b) asks the forward for the logits rows of positions
a .. b-1 (`ForwardBatch.logits_indices`, after the sampled rows); row j gives the logprob of
prompt token j+1 and the top N there (`deepinfer_sampling.logprobs.token_logprobs`, computed on
the device right after the forward, copied to the host without waiting). The scheduler asks
for each position once in a sequence's life (`Sequence.prompt_logit_positions`), so chunked
prefill spreads the entries over steps and a recompute after preemption does not repeat them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from deepinfer_sampling.logprobs import token_logprobs

from deepinfer_engine.outputs import Logprob, logprob_entry
from deepinfer_engine.scheduler import ScheduledChunk


@dataclass
class PromptLogits:
    """A step's prompt-logprob rows: `spans[i]` = (chunk index in the step, a, b), in the
    order of the rows; `host`: their `token_logprobs` tensors, on the host once `event` (None
    on CPU) has completed."""

    spans: list[tuple[int, int, int]]
    host: dict[str, torch.Tensor]
    event: torch.cuda.Event | None


def prompt_rows(chunks: list[ScheduledChunk]) -> list[int]:
    """The flat batch rows whose logits the chunks' prompt logprobs need, in chunk order."""
    rows, base = [], 0
    for c in chunks:
        if c.prompt_logits is not None:
            a, b = c.prompt_logits
            rows.extend(range(base + a - c.start, base + b - c.start))
        base += c.num_tokens
    return rows


def start(logits: torch.Tensor, chunks: list[ScheduledChunk]) -> PromptLogits:
    """Enqueue the logprobs of `logits` [R, V], the rows of `prompt_rows(chunks)`, and their
    copy to the host."""
    spans, targets = [], []
    for i, c in enumerate(chunks):
        if c.prompt_logits is not None:
            a, b = c.prompt_logits
            spans.append((i, a, b))
            targets.extend(c.seq.prompt_token_ids[a + 1 : b + 1])
    num_top = max(chunks[i].seq.params.prompt_logprobs for i, _, _ in spans)
    ids = torch.tensor(targets, dtype=torch.int64)
    if logits.device.type == "cuda":
        ids = ids.pin_memory()
    lp = token_logprobs(logits, ids.to(logits.device, non_blocking=True), num_top)
    host = {
        "logprobs": lp.logprobs,
        "ranks": lp.ranks,
        "top_logprobs": lp.top_logprobs,
        "top_token_ids": lp.top_token_ids,
    }
    event = None
    if logits.device.type == "cuda":
        host = {k: v.to("cpu", non_blocking=True) for k, v in host.items()}
        event = torch.cuda.Event()
        event.record()
    return PromptLogits(spans, host, event)


def resolve(
    prompt: PromptLogits, chunks: list[ScheduledChunk]
) -> dict[int, list[dict[int, Logprob]]]:
    """Wait for the host copy; per chunk index, its entries ({token: Logprob} for each prompt
    token of its span: the token itself, then its sequence's top N)."""
    if prompt.event is not None:
        prompt.event.synchronize()
    h = prompt.host
    lp, ranks = h["logprobs"].tolist(), h["ranks"].tolist()
    top_lp, top_ids = h["top_logprobs"].tolist(), h["top_token_ids"].tolist()
    out: dict[int, list[dict[int, Logprob]]] = {}
    row = 0
    for i, a, b in prompt.spans:
        c = chunks[i]
        n = c.seq.params.prompt_logprobs
        entries = []
        for j in range(a, b):
            token = c.seq.prompt_token_ids[j + 1]
            entries.append(
                logprob_entry(token, lp[row], ranks[row], top_ids[row][:n], top_lp[row][:n])
            )
            row += 1
        out[i] = entries
    return out
