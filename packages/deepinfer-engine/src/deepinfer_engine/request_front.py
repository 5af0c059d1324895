"""The driver side of `LLM.generate` for a multi-rank engine (`RequestFront`): what the
single-node executor and the torchrun one share.

Before any rank starts or loads: the checkpoint's config is read and the layout checked against
its experts and the visible devices (`ParallelLayout.check`, errors name the numbers), and what
ranks cannot do yet is refused (`rank_engine.check_rank_features`). Then the tokenizer and the
model's facts for validation, the structured-output grammar checks, and the queue of requests
(`RemoteRequest`: a request whose output comes back from a rank) with their DP assignment by
load (`dp_balance.assign_requests`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from deepinfer_model.loader import checkpoint_config
from deepinfer_model.tokenizer import Tokenizer
from deepinfer_parallel.dp_balance import RankLoad, assign_requests

from deepinfer_engine.config import EngineConfig, resolve_device
from deepinfer_engine.engine import StepStats, check_grammars, grammar_cache
from deepinfer_engine.outputs import CompletionOutput, RequestOutput
from deepinfer_engine.rank_engine import check_rank_features
from deepinfer_engine.step_messages import RankRequest
from deepinfer_engine.validation import ValidatedRequest


@dataclass
class ModelFacts:
    """What the driver knows of the model (it loads no weights)."""

    name: str
    vocab_size: int
    eos_token_id: int | None


@dataclass
class RemoteRequest:
    """A request running on a rank: its output once finished."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: object
    output: RequestOutput | None = None

    @property
    def finished(self) -> bool:
        return self.output is not None

    def to_output(self) -> RequestOutput:
        if self.output is None:
            return RequestOutput(self.request_id, self.prompt, list(self.prompt_token_ids))
        return self.output

    def fail(self, reason: str) -> None:
        outs = [
            CompletionOutput(index=i, text="", token_ids=[], finish_reason="error", error=reason)
            for i in range(getattr(self.params, "n", 1))
        ]
        self.output = RequestOutput(
            self.request_id, self.prompt, list(self.prompt_token_ids), outs, True
        )


class RequestFront:
    """See the module docstring: `path` (the checkpoint directory), `device` ("cuda" or
    "cpu"), `tokenizer`, `model` (`ModelFacts`), `stats`, and the DP ranks' last `loads`."""

    def __init__(self, config: EngineConfig) -> None:
        layout = config.layout
        path, model_config = checkpoint_config(config.model)
        device = resolve_device(config.accelerator)
        layout.check(
            num_experts=model_config.n_routed_experts,
            extra_experts=config.num_extra_experts,
            num_devices=torch.cuda.device_count() if device == "cuda" else None,
        )
        check_rank_features(config, device)
        self.config, self.path, self.device = config, path, device
        self.tokenizer = Tokenizer.from_dir(path)
        self.model = ModelFacts(str(path), model_config.vocab_size, model_config.eos_token_id)
        self.stats = StepStats()
        self.loads = [RankLoad() for _ in range(layout.data_parallel_size)]
        self._grammar_cache = None
        self._queued: list[RemoteRequest] = []
        self._next_request_id = 0

    def check_requests(self, reqs: list[ValidatedRequest]) -> None:
        check_grammars(reqs, self._grammars)

    def _grammars(self):
        if self._grammar_cache is None:
            eos = (self.model.eos_token_id,) if self.model.eos_token_id is not None else ()
            self._grammar_cache = grammar_cache(self.tokenizer, eos, self.model.vocab_size)
        return self._grammar_cache

    def add_request(self, req: ValidatedRequest) -> RemoteRequest:
        rid = str(self._next_request_id)
        self._next_request_id += 1
        r = RemoteRequest(rid, req.prompt, list(req.prompt_token_ids), req.params)
        self._queued.append(r)
        return r

    def take_queued(self) -> tuple[list[RemoteRequest], list[RankRequest], list[int]]:
        """The queued requests (the queue empties), as rank messages, and the DP rank of each
        (least waiting + KV tokens first)."""
        queued, self._queued = self._queued, []
        wire = [RankRequest(r.request_id, r.prompt, r.prompt_token_ids, r.params) for r in queued]
        costs = [len(r.prompt_token_ids) * getattr(r.params, "n", 1) for r in queued]
        return queued, wire, assign_requests(costs, self.loads)

    def fail_queued(self, reason: str) -> None:
        for r in self._queued:
            r.fail(reason)
        self._queued = []
