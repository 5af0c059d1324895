"""`LLM`: the offline API (`generate`, `chat`), in vLLM's shape."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

from deepinfer_sampling.params import SamplingParams

from deepinfer_engine.config import EngineConfig, resolve_device
from deepinfer_engine.engine import Engine, Request
from deepinfer_engine.engine_model import EngineModel
from deepinfer_engine.outputs import RequestOutput
from deepinfer_engine.validation import validate_requests

logger = logging.getLogger("deepinfer")


class LLM:
    """An offline engine over one model.

    model: a local checkpoint dir or a hub id; None means `DEEPINFER_HF_MODEL_DIR`, else the
        built-in tiny checkpoint (logged). **config: any `EngineConfig` field (max_num_seqs,
        max_num_batched_tokens, max_model_len, block_size, gpu_memory_utilization,
        kv_cache_bytes, async_scheduling, yoco_prefill_truncation_mode, ...); an argument wins
        over the corresponding environment variable.
    Several ranks (data_parallel_size, expert_parallel_size, engram_parallel_size > 1): this
        process starts and owns one process per rank (`executor.MultiprocExecutor`) and ends
        them on `shutdown()`, at exit, or when a rank fails; under torchrun every process is
        one rank (`torchrun_executor.TorchrunExecutor`) and every rank returns all outputs.
    """

    def __init__(self, model: str | None = None, **config: Any) -> None:
        cfg = EngineConfig.from_env(model=model, **config)
        if cfg.launched is not None:
            from deepinfer_engine.torchrun_executor import TorchrunExecutor

            self.engine = TorchrunExecutor(cfg)
            return
        if cfg.layout.world_size > 1:
            from deepinfer_engine.executor import MultiprocExecutor

            self.engine = MultiprocExecutor(cfg)
            return
        from deepinfer_model.loader import load_model
        from deepinfer_model.runtime import ModelRuntime

        if cfg.model is None:
            logger.warning(
                "no model given (model=None, DEEPINFER_HF_MODEL_DIR unset): using the built-in "
                "tiny checkpoint"
            )
        device = resolve_device(cfg.accelerator)
        loaded = load_model(cfg.model, device=device, dtype=cfg.torch_dtype(device))
        self.engine = Engine(cfg, ModelRuntime.from_loaded(loaded))

    @classmethod
    def from_model(cls, model: EngineModel, **config: Any) -> LLM:
        """An LLM over an already-built model (tests, tools, models not on disk)."""
        cfg = EngineConfig.from_env(**config)
        if cfg.layout.world_size > 1 or cfg.launched is not None:
            raise NotImplementedError(
                "LLM.from_model with several ranks: each rank loads its own shard from a "
                "checkpoint; pass the checkpoint path to LLM(...) instead"
            )
        self = cls.__new__(cls)
        self.engine = Engine(cfg, model)
        return self

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def shutdown(self) -> None:
        """End the engine's rank processes (several ranks; also done at exit). A one-rank
        engine runs in this process and has none to end."""
        if not isinstance(self.engine, Engine):
            self.engine.shutdown()

    # ---- generate ----------------------------------------------------------------------------
    def generate(
        self,
        prompts: Any,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs in input order.

        prompts: a string, token ids, {"prompt_token_ids": [...]}, or a list of these.
        sampling_params: one for all prompts, or one per prompt (None: defaults).
        Every request is validated first; a bad one raises ValueError("prompt {i}: ...") and
        nothing runs. A mid-run failure of one request (non-finite logits, a grammar dead end)
        ends only that request, with finish_reason="error" and a message in `.error`.
        """
        eng = self.engine
        reqs = validate_requests(
            prompts,
            sampling_params,
            eng.tokenizer.encode,
            eng.model.vocab_size,
            eng.max_model_len,
        )
        eng.check_requests(reqs)
        try:
            requests = [eng.add_request(r) for r in reqs]
            self._run(requests, use_tqdm)
        except BaseException as e:
            # Leave the engine idle for the next call (no queued sequences, no held cache).
            eng.abort_all(f"generate was interrupted: {type(e).__name__}: {e}")
            raise
        return [r.to_output() for r in requests]

    def _run(self, requests: list[Request], use_tqdm: bool) -> None:
        eng = self.engine
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(requests), desc="Processed prompts", dynamic_ncols=True)
        pending = {r.request_id: r for r in requests}
        t0 = time.perf_counter()
        tok0 = eng.stats.tokens_generated
        try:
            while eng.has_unfinished():
                for seq in eng.step():
                    req = pending.get(seq.request_id)
                    if req is not None and req.finished:
                        del pending[seq.request_id]
                        if bar is not None:
                            bar.update(1)
                if bar is not None:
                    dt = max(time.perf_counter() - t0, 1e-9)
                    bar.set_postfix_str(f"{(eng.stats.tokens_generated - tok0) / dt:.1f} tok/s")
        finally:
            if bar is not None:
                bar.close()

    # ---- chat --------------------------------------------------------------------------------
    def chat(
        self,
        messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        thinking: bool = False,
        reasoning_effort: str | int | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Chat: one conversation (a list of {"role", "content"} dicts) or a list of them.

        Encoded with the model's V4.1 chat encoding (`deepinfer_model.chat.encode_messages`);
        an unknown role raises ValueError naming the conversation's index.
        """
        from deepinfer_model.chat import encode_messages

        convs = [messages] if messages and isinstance(messages[0], Mapping) else list(messages)
        prompts = []
        for i, conv in enumerate(convs):
            try:
                text = encode_messages(conv, thinking=thinking, reasoning_effort=reasoning_effort)
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
            prompts.append({"prompt_token_ids": self.engine.tokenizer.encode(text), "prompt": text})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)
