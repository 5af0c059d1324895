"""Sampled tokens -> outputs: append, detokenize, stop rules, grammar acceptance, logprobs.

Each step's sampled rows (`RowResult`, one per sampled chunk) resolve that step's placeholders:
the token is accepted by the sequence's grammar, appended with its logprobs, detokenized, and
the stop rules decide whether the sequence is finished. A finished sequence gets its finish
reason here, and the scheduler frees its slot and blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

from deepinfer_engine.outputs import Logprob
from deepinfer_engine.scheduler import Scheduler, SchedulerOutput
from deepinfer_engine.sequence import Sequence, SequenceStatus


@dataclass
class RowResult:
    """What the sampler produced for one sampled chunk.

    `error` (a message) ends that sequence with finish_reason="error" and no token appended.
    `prompt_logprobs`: entries of the sequence's prompt logprobs this step computed (a chunk
    that samples nothing may carry them too).
    """

    token_id: int = -1
    logprob: float | None = None
    top_logprobs: dict[int, Logprob] | None = None
    error: str | None = None
    prompt_logprobs: list[dict[int, Logprob]] | None = None


class OutputProcessor:
    """Turns sampled rows into the sequences' outputs; asks `scheduler` to free what finishes.

    eos_token_id: the model's EOS (None: none); max_model_len: a sequence reaching this many
    tokens finishes with "length".
    """

    def __init__(self, scheduler: Scheduler, eos_token_id: int | None, max_model_len: int) -> None:
        self.scheduler = scheduler
        self.eos_token_id = eos_token_id
        self.max_model_len = max_model_len
        self.num_generated = 0  # tokens appended to outputs
        self._token_text: dict[int, str] = {}  # id -> its text alone (Logprob.decoded_token)

    def update(self, out: SchedulerOutput, results: list[RowResult | None]) -> list[Sequence]:
        """Resolve the placeholders of step `out`: append sampled tokens and apply stop rules.

        `results[i]` belongs to `out.chunks[i]` (None for a chunk with nothing to report).
        Returns the sequences that finished in this update. Rows of sequences that finished
        earlier (async scheduling computes one step past a stop) are dropped.
        """
        finished: list[Sequence] = []
        for chunk, res in zip(out.chunks, results, strict=True):
            seq = chunk.seq
            if res is not None and res.prompt_logprobs and seq.prompt_logprobs is not None:
                seq.prompt_logprobs.extend(self._decoded(seq, e) for e in res.prompt_logprobs)
            if not chunk.sample:
                continue
            seq.num_inflight -= 1
            if seq.is_finished:
                continue
            assert res is not None
            if res.error is not None:
                self.finish(seq, "error", error=res.error)
                finished.append(seq)
                continue
            if seq.grammar is not None and not seq.grammar.accept_token(res.token_id):
                # The token was sampled under this grammar's mask, so a rejection is an engine
                # or grammar bug; it ends this request alone, without the rejected token.
                self.finish(
                    seq, "error", error=f"structured output: grammar rejected token {res.token_id}"
                )
                finished.append(seq)
                continue
            self._append(seq, res)
            if self._check_stop(seq, res.token_id):
                finished.append(seq)
        return finished

    def _append(self, seq: Sequence, res: RowResult) -> None:
        seq.output_token_ids.append(res.token_id)
        self.num_generated += 1
        if res.logprob is not None:
            seq.cumulative_logprob = (seq.cumulative_logprob or 0.0) + res.logprob
        if res.top_logprobs is not None:
            if seq.logprobs is None:
                seq.logprobs = []
            seq.logprobs.append(self._decoded(seq, res.top_logprobs))

    def _decoded(self, seq: Sequence, logprobs: dict[int, Logprob]) -> dict[int, Logprob]:
        """`logprobs` with each `decoded_token` set to its token's text alone, as vLLM gives
        it (special tokens spelled out; a byte of a longer character shows as U+FFFD). A
        sequence without a detokenizer leaves them None."""
        if seq.detokenizer is None:
            return logprobs
        decode = seq.detokenizer.tokenizer.decode
        for tid, lp in logprobs.items():
            text = self._token_text.get(tid)
            if text is None:
                text = self._token_text[tid] = decode([tid], skip_special_tokens=False)
            lp.decoded_token = text
        return logprobs

    def _check_stop(self, seq: Sequence, token: int) -> bool:
        """Apply stop rules after appending `token`; finish the sequence if one fires.

        As in vLLM: EOS (unless ignore_eos) and stop ids end the output, keeping the token in
        `token_ids` but not rendering its text; the sampler masks them for the first
        `min_tokens` tokens. Stop strings must end after the text of the first `min_tokens`
        tokens, and are cut from the text. Then the length limits.
        """
        p = seq.params
        n_out = len(seq.output_token_ids)
        min_tokens = p.min_tokens
        # update() has had the grammar accept the token. A grammar that has matched to its end
        # (its stop token, EOS, accepted) ends the output.
        if seq.grammar is not None and seq.grammar.is_terminated():
            self.finish(seq, "stop")
            return True
        if n_out >= min_tokens:
            if not p.ignore_eos and token == self.eos_token_id:
                self.finish(seq, "stop")
                return True
            if token in p.stop_token_ids:
                self.finish(seq, "stop", stop_reason=token)
                return True
        if seq.detokenizer is not None:
            stop_str = seq.detokenizer.add_token(token, check_stop=n_out > min_tokens)
            if stop_str is not None:
                self.finish(seq, "stop", stop_reason=stop_str)
                return True
        max_tokens = p.max_tokens
        if (max_tokens is not None and n_out >= max_tokens) or (
            seq.num_known_tokens >= self.max_model_len
        ):
            self.finish(seq, "length")
            return True
        return False

    def finish(
        self,
        seq: Sequence,
        reason: str,
        stop_reason: int | str | None = None,
        error: str | None = None,
    ) -> None:
        """End a sequence now (stop rule, error, grammar end, abort) and free its cache."""
        if seq.is_finished:
            return
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        seq.error = error
        # A stop string already cut the text; otherwise emit any held-back partial character.
        if seq.detokenizer is not None and not isinstance(stop_reason, str):
            seq.detokenizer.flush()
        self.scheduler.free(seq)
