"""The engine: requests in, one scheduled model step at a time, finished sequences out.

Step loop, synchronous (`async_scheduling=False`):
    schedule(n) -> launch forward(n) -> sample(n) -> wait -> update(n)
Async scheduling (the default) runs one step ahead, using placeholders for the tokens in flight
(SGLang's "future tokens", vLLM's "output placeholders"; see reference/peers.md §5):
    schedule(n+1) -> launch forward(n+1) -> wait for step n's tokens -> update(n) (stops,
    detokenize, grammar accept) -> fill bitmasks + sample(n+1), copy to host without waiting
so the host's scheduling, input building, detokenizing and bitmask filling of one step overlap
the device's forward of the next. Outputs are identical either way: a row's token depends only on
the tokens before it (and its seed and position), never on which step or batch computed it. The
price of running ahead is that a sequence that stopped at step n is computed once more in step
n+1; that row is dropped.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from deepinfer_kernels import REGISTRY

from deepinfer_engine.config import EngineConfig
from deepinfer_engine.detokenizer import IncrementalDetokenizer
from deepinfer_engine.engine_model import EngineModel
from deepinfer_engine.kv_cache_manager import KVCacheManager, plan_cache
from deepinfer_engine.model_runner import LaunchedStep, ModelRunner, SampledStep
from deepinfer_engine.output_processor import OutputProcessor
from deepinfer_engine.outputs import CompletionOutput, RequestOutput
from deepinfer_engine.scheduler import Scheduler, SchedulerOutput
from deepinfer_engine.sequence import Sequence
from deepinfer_engine.step_peers import StepPeers
from deepinfer_engine.validation import ValidatedRequest

logger = logging.getLogger("deepinfer.engine")

_MAX_SEED = (1 << 63) - 1


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[Sequence] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)

    def to_output(self) -> RequestOutput:
        outs = [
            CompletionOutput(
                index=s.index,
                text=s.text,
                token_ids=list(s.output_token_ids),
                cumulative_logprob=s.cumulative_logprob,
                logprobs=s.logprobs,
                finish_reason=s.finish_reason,
                stop_reason=s.stop_reason,
                error=s.error,
            )
            for s in self.seqs
        ]
        return RequestOutput(
            self.request_id,
            self.prompt,
            list(self.prompt_token_ids),
            outs,
            self.finished,
            self.seqs[0].prompt_logprobs,
        )


@dataclass
class StepStats:
    """Counters for progress bars and benchmarks."""

    steps: int = 0
    tokens_generated: int = 0
    preemptions: int = 0


@dataclass
class InflightStep:
    """A launched step and its sampling (None when no row of it was sampled)."""

    launched: LaunchedStep
    sampled: SampledStep | None


def grammar_cache(tokenizer, eos_ids: tuple[int, ...], vocab_size: int):
    """The structured-output grammar cache of a tokenizer (`deepinfer_sampling.grammar`)."""
    from deepinfer_sampling.grammar import GrammarCache, tokenizer_info_from_tokenizer

    info = tokenizer_info_from_tokenizer(
        tokenizer.backend, stop_token_ids=list(eos_ids), vocab_size=vocab_size
    )
    return GrammarCache(info)


def check_grammars(reqs: list[ValidatedRequest], grammars) -> None:
    """Compile every structured-output grammar of `reqs` with `grammars()` (a cache), so a bad
    one raises ValueError("prompt {i}: ...") before any work."""
    for i, r in enumerate(reqs):
        if r.params.structured_output is not None:
            try:
                grammars().compile(r.params.structured_output)
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None


class Engine:
    """One model's offline engine: requests in (`add_request`), one `step()` at a time, finished
    sequences out. Parts: `scheduler` (what runs), `runner` (the forward and the sampler),
    `output` (tokens -> outputs and stops).

    peers: this engine is one rank of several (`StepPeers`): every step it agrees with the
    others on the padded row count (its model pads its collectives to it, or runs an idle
    forward when it scheduled nothing) and follows its DP leader's samples."""

    def __init__(
        self, config: EngineConfig, model: EngineModel, peers: StepPeers | None = None
    ) -> None:
        self.peers = peers
        config = config.replaced(use_nextn_decode=self._draft_length(config, model))
        self.config = config
        self.model = model
        # This engine's kernel settings (argument, else DEEPINFER_BATCH_INVARIANT /
        # DEEPINFER_KERNELS): every model call it makes runs under them, whatever other engines
        # use.
        self.kernel_settings = config.kernel_settings()
        REGISTRY.check(self.kernel_settings)
        self.tokenizer = model.tokenizer
        self.device = torch.device(config.device())
        self.dtype = config.torch_dtype(self.device.type)
        spec = model.cache_spec(config.block_size, self.dtype)
        budget = self._kv_budget_bytes()
        max_model_len = config.max_model_len or model.max_position_embeddings
        if max_model_len > model.max_position_embeddings:
            # As in vLLM: positions past the model's limit are outside what its RoPE/YaRN
            # scaling was built for, so generating there would be silently wrong.
            raise ValueError(
                f"max_model_len={max_model_len} is larger than the model's "
                f"max_position_embeddings ({model.max_position_embeddings}); "
                f"allowed: 2..{model.max_position_embeddings}"
            )
        plan = plan_cache(
            budget,
            spec.bytes_per_slot,
            spec.bytes_per_block,
            spec.block_size,
            config.max_num_seqs,
            max_model_len,
        )
        self.max_model_len = plan.max_model_len
        resolved = config.replaced(
            model=model.name,
            dtype=str(self.dtype).removeprefix("torch."),
            max_model_len=self.max_model_len,
        )
        logger.info(
            "engine config: %s; device %s; %s; model: vocab %d, yoco floor %s, dspark stages %s",
            resolved,
            self.device,
            self.kernel_settings,
            model.vocab_size,
            model.supports_yoco_floor,
            model.has_dspark_stages,
        )
        logger.info(
            "KV cache: %d slots, %d blocks of %d tokens = %d tokens (%.1f MiB on %s)",
            plan.num_slots,
            plan.num_blocks,
            plan.block_size,
            plan.capacity_tokens,
            (plan.num_slots * spec.bytes_per_slot + plan.num_blocks * spec.bytes_per_block) / 2**20,
            self.device,
        )
        yoco = self._check_truncation(config, model)
        self.kv = KVCacheManager(plan.num_slots, plan.num_blocks, plan.block_size)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens)
        self.output = OutputProcessor(self.scheduler, model.eos_token_id, self.max_model_len)
        with REGISTRY.configured(self.kernel_settings):
            self.runner = ModelRunner(
                model,
                plan.num_blocks,
                plan.num_slots,
                plan.block_size,
                self.device,
                self.dtype,
                config.seed,
                yoco=yoco,
                graph_max_batch=0 if config.enforce_eager else config.max_num_seqs,
                peers=peers,
            )
        self.eos_ids: tuple[int, ...] = (
            (model.eos_token_id,) if model.eos_token_id is not None else ()
        )
        self._grammar_cache = None
        self._inflight: InflightStep | None = None
        self._next_seq_id = 0
        self._next_request_id = 0
        self.stats = StepStats()

    # ---- set-up ------------------------------------------------------------------------------
    def _kv_budget_bytes(self) -> int:
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = int(total * self.config.gpu_memory_utilization) - (total - free)
            if budget <= 0:
                raise ValueError(
                    f"gpu_memory_utilization={self.config.gpu_memory_utilization} leaves no memory "
                    f"for the KV cache ({(total - free) / 2**30:.1f} GiB of "
                    f"{total / 2**30:.1f} GiB already in use)"
                )
            return budget
        return self.config.kv_cache_bytes

    @staticmethod
    def _draft_length(config: EngineConfig, model: EngineModel) -> int:
        """DEEPINFER_USE_NEXTN_DECODE against what the model's DSpark stages draft: the given
        length, or the model's when none is given; more than the model drafts is an error."""
        most = model.max_draft_tokens
        n = config.use_nextn_decode
        if n is None:
            return most
        if n > most:
            allowed = f"0..{most}" if most else "0 (the model has no DSpark stages)"
            raise ValueError(
                f"use_nextn_decode={n} ({config.origin('use_nextn_decode')}) is more than this "
                f"model drafts: its DSpark stages draft {most} tokens a step; allowed: {allowed}"
            )
        return n

    @staticmethod
    def _check_truncation(config: EngineConfig, model: EngineModel) -> tuple[int, str] | None:
        """SWA bounded replay (YOCO prefill truncation): (K, mode) in `mask` or `compact`
        mode, else None."""
        mode = config.yoco_prefill_truncation_mode
        if mode == "off":
            return None
        k = config.yoco_prefill_keep_tokens
        need = model.sliding_window + config.max_backtrack
        if k < need:
            raise ValueError(
                f"yoco_prefill_keep_tokens (DEEPINFER_YOCO_PREFILL_KEEP_TOKENS)={k} is smaller "
                f"than the window ({model.sliding_window}) + maximum backtracking "
                f"(DEEPINFER_USE_NEXTN_DECODE {config.use_nextn_decode} + 1) = {need}: the decoder "
                "layers' SWA rings would not be full after a truncated prefill"
            )
        if not model.supports_yoco_floor:
            raise NotImplementedError(
                f"yoco_prefill_truncation_mode={mode!r} needs the model to truncate its "
                "consumer layers to each prompt's last K tokens (ForwardBatch.yoco_floor); "
                "this model does not support it (supports_yoco_floor is False). Use 'off'."
            )
        return k, mode

    def _grammars(self):
        if self._grammar_cache is None:
            self._grammar_cache = grammar_cache(self.tokenizer, self.eos_ids, self.model.vocab_size)
        return self._grammar_cache

    # ---- requests ----------------------------------------------------------------------------
    def check_requests(self, reqs: list[ValidatedRequest]) -> None:
        """Compile every structured-output grammar up front, so a bad one fails before work."""
        check_grammars(reqs, self._grammars)

    def add_request(self, req: ValidatedRequest) -> Request:
        """Queue one validated request as `n` sequences (seeded ones get seed + index)."""
        rid = str(self._next_request_id)
        self._next_request_id += 1
        request = Request(rid, req.prompt, req.prompt_token_ids)
        p = req.params
        for i in range(p.n):
            params = p
            if p.seq_seed is not None and p.n > 1:
                # Distinct, reproducible streams per completion.
                params = p.replace(seq_seed=(p.seq_seed + i) % _MAX_SEED, seed=None)
            seq = Sequence(
                seq_id=self._next_seq_id,
                request_id=rid,
                index=i,
                prompt_token_ids=list(req.prompt_token_ids),
                params=params,
                detokenizer=IncrementalDetokenizer(
                    self.tokenizer,
                    req.prompt_token_ids,
                    stop=list(p.stop),
                    skip_special_tokens=p.skip_special_tokens,
                    spaces_between_special_tokens=p.spaces_between_special_tokens,
                ),
                seed=params.seq_seed,
                grammar=self._grammars().matcher(so) if (so := p.structured_output) else None,
            )
            self._next_seq_id += 1
            request.seqs.append(seq)
            self.scheduler.add(seq)
        return request

    def abort_all(self, reason: str) -> None:
        """End every queued, running or in-flight sequence with finish_reason="error".

        Called when a `generate` call is interrupted by an exception (a device error,
        KeyboardInterrupt): its slots and blocks go back to the free lists and the step in
        flight is dropped, so the next call starts from an idle engine and runs only its own
        requests.
        """
        self._inflight = None
        for seq in [*self.scheduler.running, *self.scheduler.waiting]:
            seq.num_inflight = 0
            self.output.finish(seq, "error", error=reason)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._inflight is not None

    # ---- the step ----------------------------------------------------------------------------
    def step(self) -> list[Sequence]:
        """Run one engine iteration; return the sequences that finished in it.

        Schedule step n, launch its forward, resolve step n-1 (with async scheduling, on the host
        while the device runs step n), sample step n, and update from it now (synchronous) or
        in the next iteration (async)."""
        with REGISTRY.configured(self.kernel_settings):
            out = self.scheduler.schedule()
            rows = None
            if self.peers is not None:
                prefill = any(c.start < c.seq.num_prompt_tokens for c in out.chunks)
                plan = self.peers.agree(out.num_tokens, prefill, self.has_unfinished())
                rows = self.runner.collective_rows(plan)
            prev = self._inflight
            launched = self._launch(out, prev, rows)
            self._inflight = None
            finished = self._update(prev) if prev is not None else []
            if launched is not None:
                step = InflightStep(launched, self.runner.sample(launched, self.eos_ids))
                if self.config.async_scheduling:
                    self._inflight = step
                else:
                    finished += self._update(step)
        self.stats.steps += 1
        self.stats.preemptions = self.scheduler.num_preemptions
        return finished

    def _launch(
        self, out: SchedulerOutput, prev: InflightStep | None, rows: int | None = None
    ) -> LaunchedStep | None:
        """Enqueue the forward of `out` (None: nothing was scheduled). `rows`: the step's
        agreed row count when the engine has peers (an idle forward if `out` is empty)."""
        if not out.is_empty:
            return self.runner.launch(out, prev.sampled if prev is not None else None, rows)
        if rows:
            self.runner.idle(rows)
        if prev is None and self.scheduler.has_unfinished():
            raise RuntimeError(
                "scheduler made no progress with nothing in flight (waiting: "
                f"{len(self.scheduler.waiting)}, running: {len(self.scheduler.running)})"
            )
        return None

    def _update(self, step: InflightStep) -> list[Sequence]:
        """Wait for `step`'s sampled tokens and turn them into outputs."""
        results = self.runner.resolve(step.sampled, step.launched)
        finished = self.output.update(step.launched.out, results)
        self.stats.tokens_generated = self.output.num_generated
        return finished
