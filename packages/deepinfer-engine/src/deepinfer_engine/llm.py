"""`LLM`: the offline API (`generate`, `chat`), in vLLM's shape."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

from deepinfer_sampling.params import SamplingParams

from deepinfer_engine.config import EngineConfig
from deepinfer_engine.engine import Engine, Request
from deepinfer_engine.engine_model import EngineModel
from deepinfer_engine.outputs import RequestOutput
from deepinfer_engine.progress import progress_bar
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
        device = cfg.device()
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
        use_tqdm: show the progress on stderr (`progress.progress_bar`: tqdm's bar on a
        terminal, else one line per `LOG_INTERVAL_S` seconds).
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
        bar = progress_bar(len(requests), "Processed prompts") if use_tqdm else None
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
        thinking: bool | None = None,
        reasoning_effort: str | int | None = None,
        use_tqdm: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Chat: one conversation (a list of {"role", "content"} dicts) or a list of them.

        Encoded with the model's V4.1 chat encoding (`deepinfer_model.chat.encode_messages`).
        thinking: thinking mode (default off). reasoning_effort: "low" | "medium" | "high" |
        "xhigh" | "max" or an int 1..100 (V4.1's levels 25/50/50/75/100; "medium" is vLLM's
        name of the default, V4.1's "high"), with thinking only. chat_template_kwargs: the same
        options as vLLM users pass them, {"thinking" (or "enable_thinking"): bool,
        "reasoning_effort": ...}; an option given both ways must agree.
        An empty conversation, a message without content, an unknown role or an effort with
        thinking off raises ValueError naming the conversation's index, before any work.
        """
        from deepinfer_model.chat import encode_messages

        thinking, reasoning_effort = _chat_options(thinking, reasoning_effort, chat_template_kwargs)
        if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
            raise ValueError(
                f"messages must be a conversation (a list of message dicts) or a list of them, "
                f"got {type(messages).__name__}"
            )
        if not messages:
            raise ValueError("messages must not be empty: give a conversation or a list of them")
        convs = [messages] if isinstance(messages[0], Mapping) else list(messages)
        prompts = []
        for i, conv in enumerate(convs):
            try:
                text = encode_messages(conv, thinking=thinking, reasoning_effort=reasoning_effort)
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
            prompts.append({"prompt_token_ids": self.engine.tokenizer.encode(text), "prompt": text})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)


# chat_template_kwargs key -> the chat option it sets
_TEMPLATE_OPTIONS = {
    "thinking": "thinking",
    "enable_thinking": "thinking",
    "reasoning_effort": "reasoning_effort",
}


def _chat_options(
    thinking: bool | None,
    reasoning_effort: str | int | None,
    chat_template_kwargs: Mapping[str, Any] | None,
) -> tuple[bool, str | int | None]:
    """(thinking, reasoning_effort) from `LLM.chat`'s arguments and its `chat_template_kwargs`;
    ValueError on an unknown key or an option the two give differently."""
    given: dict[str, tuple[str, Any]] = {}
    if thinking is not None:
        given["thinking"] = ("thinking", thinking)
    if reasoning_effort is not None:
        given["reasoning_effort"] = ("reasoning_effort", reasoning_effort)
    if chat_template_kwargs is not None:
        if not isinstance(chat_template_kwargs, Mapping):
            raise ValueError(
                "chat_template_kwargs must be a dict such as {'thinking': True, "
                f"'reasoning_effort': 'high'}}, got {type(chat_template_kwargs).__name__}"
            )
        unknown = sorted(set(chat_template_kwargs) - set(_TEMPLATE_OPTIONS))
        if unknown:
            raise ValueError(
                f"chat_template_kwargs has unknown keys {unknown}; the V4.1 chat encoding "
                f"takes {', '.join(_TEMPLATE_OPTIONS)}"
            )
        for key, value in chat_template_kwargs.items():
            option = _TEMPLATE_OPTIONS[key]
            name = f"chat_template_kwargs[{key!r}]"
            if option in given and given[option][1] != value:
                raise ValueError(
                    f"{given[option][0]}={given[option][1]!r} and {name}={value!r} disagree; "
                    f"give {option} once"
                )
            given.setdefault(option, (name, value))
    return (
        given["thinking"][1] if "thinking" in given else False,
        given["reasoning_effort"][1] if "reasoning_effort" in given else None,
    )
