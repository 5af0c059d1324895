"""Engine configuration: one typed dataclass, and the ONE place the engine reads the environment.

The environment variables are the names users know from DeepInfer; `LLM(...)` keyword arguments
are a second view of the same fields. An argument that is not None wins over the variable. A bad
value (in either) raises `ValueError` naming the variable or argument and the allowed values; there
are no silent defaults for malformed input.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from deepinfer_kernels.settings import KernelSettings, parse_bool, parse_overrides
from deepinfer_parallel.dispatch_backends import DISPATCH_BACKENDS
from deepinfer_parallel.layout import ParallelLayout

logger = logging.getLogger("deepinfer")

ACCELERATORS = ("nvidia", "ascend", "cpu")
TRUNCATION_MODES = ("off", "mask", "compact")
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
"""Set by torchrun (and other launchers) in every rank process: when all are present, this
process is one rank of a launched engine and joins the others at MASTER_ADDR:MASTER_PORT."""

# Environment variable -> EngineConfig field.
ENV_FIELDS: dict[str, str] = {
    "DEEPINFER_ACCELERATOR": "accelerator",
    "DEEPINFER_HF_MODEL_DIR": "model",
    "DEEPINFER_ASYNC_SCHEDULING": "async_scheduling",
    "DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE": "yoco_prefill_truncation_mode",
    "DEEPINFER_YOCO_PREFILL_KEEP_TOKENS": "yoco_prefill_keep_tokens",
    "DEEPINFER_USE_NEXTN_DECODE": "use_nextn_decode",
    "DEEPINFER_ENABLE_MTP_VARLEN": "enable_mtp_varlen",
    "DEEPINFER_BATCH_INVARIANT": "batch_invariant",
    "DEEPINFER_KERNELS": "kernels",
    "DEEPINFER_EXPERT_COUNT_WINDOW_SIZE": "expert_count_window_size",
    "DEEPINFER_EXPERT_REARRANGEMENT_STEP_INTERVAL": "expert_rearrangement_step_interval",
    "DEEPINFER_OVERRIDE_NUM_EXTRA_EXPERTS": "num_extra_experts",
    "DEEPINFER_GLOO_TIMEOUT": "collective_timeout_s",
}


@dataclass(frozen=True)
class LaunchedRank:
    """This process's place in an engine started by a launcher (torchrun): `rank` of
    `world_size`, `local_rank` on its node (its device index)."""

    rank: int
    world_size: int
    local_rank: int


def _parse_int(name: str, value: Any, minimum: int) -> int:
    try:
        if isinstance(value, bool):
            raise TypeError
        out = int(value)
        if isinstance(value, float) and out != value:
            raise TypeError
    except (TypeError, ValueError):
        raise ValueError(f"{name}={value!r} is not an integer >= {minimum}") from None
    if out < minimum:
        raise ValueError(f"{name}={value!r} must be an integer >= {minimum}")
    return out


def _parse_fraction(name: str, value: Any) -> float:
    """A float in (0, 1]; numeric strings are accepted, bools are not."""
    try:
        if isinstance(value, bool):
            raise TypeError
        out = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name}={value!r} is not a number in (0, 1]") from None
    if not 0.0 < out <= 1.0:  # also rejects NaN
        raise ValueError(f"{name}={value!r} must be in (0, 1]")
    return out


def _parse_seconds(name: str, value: Any) -> float:
    """A positive, finite number of seconds; numeric strings are accepted, bools are not."""
    try:
        if isinstance(value, bool):
            raise TypeError
        out = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name}={value!r} is not a number of seconds > 0") from None
    if not 0.0 < out < float("inf"):  # also rejects NaN
        raise ValueError(f"{name}={value!r} must be a number of seconds > 0")
    return out


def _parse_choice(name: str, value: Any, allowed: tuple[str, ...]) -> str:
    v = str(value).strip().lower()
    if v not in allowed:
        raise ValueError(f"{name}={value!r} is not allowed; allowed values: {', '.join(allowed)}")
    return v


@dataclass
class EngineConfig:
    """Every knob of the offline engine.

    Memory: on CUDA the KV cache gets `gpu_memory_utilization` of the device memory minus what is
    in use after loading the model; on CPU it gets `kv_cache_bytes`. Capacity is logged in tokens.
    `max_model_len` None means the model's `max_position_embeddings`, capped by the KV capacity.
    CUDA graphs: on CUDA, pure decode steps of up to `max_num_seqs` sequences replay piecewise
    CUDA graphs (each padded batch size is captured the first time it runs);
    `enforce_eager=True` runs every step eagerly.
    Several ranks (`ParallelLayout`): `data_parallel_size` D (attention DP: each DP rank its own
    requests, scheduler and KV cache), `expert_parallel_size` E (each rank holds 1/E of the
    routed experts, plus `num_extra_experts` / E redundant slots), `engram_parallel_size` G
    (Engram tables split by rows); max(D, E, G) ranks in all, each size dividing it. A single
    `LLM(...)` starts one process per rank on this node; under torchrun (`launched`) every
    process is one rank. `expert_dispatch`: "allgather" (all-gather + reduce-scatter),
    "alltoall" (all_to_all_single with per-rank counts) or "deep_ep"; None = "deep_ep" when it
    imports on CUDA, else "allgather". EPLB online (E > 1): routing statistics over the last
    `expert_count_window_size` steps, a rebalance every `expert_rearrangement_step_interval`
    steps (0 = never). `collective_timeout_s`: how long a rank waits at the rendezvous or in one
    collective before it fails (a hung peer then fails the run instead of blocking it).
    """

    model: str | None = None
    accelerator: str | None = None  # nvidia | ascend | cpu; None = detect
    dtype: str | None = None  # bfloat16 | float16 | float32; None = bfloat16 on GPU, float32 on CPU
    seed: int = 0
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None
    block_size: int = 64
    gpu_memory_utilization: float = 0.9
    kv_cache_bytes: int = 256 << 20  # CPU byte budget for the KV cache
    async_scheduling: bool = True
    yoco_prefill_truncation_mode: str = "off"
    yoco_prefill_keep_tokens: int = 140
    use_nextn_decode: int | None = None
    """Maximum draft length (spec decoding), at most what the model's DSpark stages draft;
    0 = off; None = the model's (5 on V4.1, 0 without stages), set by the engine."""
    enable_mtp_varlen: bool = False
    batch_invariant: bool = False
    kernels: str = ""  # per-op kernel tier overrides, "op=tier,..." (DEEPINFER_KERNELS)
    enforce_eager: bool = False  # True: no CUDA graphs for decode steps (as in vLLM)
    data_parallel_size: int = 1
    expert_parallel_size: int = 1
    engram_parallel_size: int = 1
    expert_dispatch: str | None = None
    expert_count_window_size: int = 100
    expert_rearrangement_step_interval: int = 0
    num_extra_experts: int = 0
    collective_timeout_s: float = 1800.0
    launched: LaunchedRank | None = None  # from RANK, WORLD_SIZE, LOCAL_RANK (torchrun)
    sources: dict[str, str] = field(default_factory=dict, init=False, repr=False, compare=False)
    """Field -> the environment variable it was read from (`from_env`); see `origin`."""

    def __post_init__(self) -> None:
        self.validate()

    def origin(self, name: str) -> str:
        """Where field `name`'s value came from, for error messages: its environment variable
        or "the <name> argument"."""
        return self.sources.get(name, f"the {name} argument")

    def replaced(self, **changes: Any) -> EngineConfig:
        """A copy with `changes` applied (validated again), keeping `sources`."""
        out = dataclasses.replace(self, **changes)
        out.sources = {k: v for k, v in self.sources.items() if k not in changes}
        return out

    def device(self) -> str:
        """The torch device string of `accelerator` (None: detect); errors name where the
        accelerator came from."""
        return resolve_device(self.accelerator, self.origin("accelerator"))

    def validate(self) -> None:
        """Normalise and check every field; errors name the field and the allowed values."""
        if self.model is not None:
            if isinstance(self.model, os.PathLike):
                self.model = os.fspath(self.model)
            if not isinstance(self.model, str) or not self.model.strip():
                raise ValueError(
                    f"model={self.model!r} must be a checkpoint directory or a hub id "
                    "('owner/name'), or None for DEEPINFER_HF_MODEL_DIR / the tiny checkpoint"
                )
        if self.accelerator is not None:
            self.accelerator = _parse_choice("accelerator", self.accelerator, ACCELERATORS)
        if self.dtype is not None and self.dtype not in ("bfloat16", "float16", "float32"):
            raise ValueError(
                f"dtype={self.dtype!r} is not allowed; allowed values: bfloat16, float16, float32"
            )
        self.seed = _parse_int("seed", self.seed, 0)
        self.max_num_seqs = _parse_int("max_num_seqs", self.max_num_seqs, 1)
        self.max_num_batched_tokens = _parse_int(
            "max_num_batched_tokens", self.max_num_batched_tokens, 1
        )
        if self.max_model_len is not None:
            self.max_model_len = _parse_int("max_model_len", self.max_model_len, 2)
        self.block_size = _parse_int("block_size", self.block_size, 1)
        self.gpu_memory_utilization = _parse_fraction(
            "gpu_memory_utilization", self.gpu_memory_utilization
        )
        self.kv_cache_bytes = _parse_int("kv_cache_bytes", self.kv_cache_bytes, 1)
        self.async_scheduling = parse_bool("async_scheduling", self.async_scheduling)
        self.yoco_prefill_truncation_mode = _parse_choice(
            "yoco_prefill_truncation_mode", self.yoco_prefill_truncation_mode, TRUNCATION_MODES
        )
        self.yoco_prefill_keep_tokens = _parse_int(
            "yoco_prefill_keep_tokens", self.yoco_prefill_keep_tokens, 1
        )
        if self.use_nextn_decode is not None:
            self.use_nextn_decode = _parse_int("use_nextn_decode", self.use_nextn_decode, 0)
        self.enable_mtp_varlen = parse_bool("enable_mtp_varlen", self.enable_mtp_varlen)
        self.batch_invariant = parse_bool("batch_invariant", self.batch_invariant)
        self.enforce_eager = parse_bool("enforce_eager", self.enforce_eager)
        if not isinstance(self.kernels, str):
            raise ValueError(f"kernels={self.kernels!r} must be a string 'op=tier,...'")
        parse_overrides(self.kernels, "kernels")
        for name in ("data_parallel_size", "expert_parallel_size", "engram_parallel_size"):
            setattr(self, name, _parse_int(name, getattr(self, name), 1))
        if self.expert_dispatch is not None:
            self.expert_dispatch = _parse_choice(
                "expert_dispatch", self.expert_dispatch, DISPATCH_BACKENDS
            )
        self.expert_count_window_size = _parse_int(
            "expert_count_window_size", self.expert_count_window_size, 1
        )
        self.expert_rearrangement_step_interval = _parse_int(
            "expert_rearrangement_step_interval", self.expert_rearrangement_step_interval, 0
        )
        self.num_extra_experts = _parse_int("num_extra_experts", self.num_extra_experts, 0)
        self.collective_timeout_s = _parse_seconds(
            "collective_timeout_s", self.collective_timeout_s
        )
        layout = self.layout  # raises LayoutError (a ValueError) naming the sizes
        if self.expert_parallel_size == 1 and (
            self.num_extra_experts or self.expert_rearrangement_step_interval
        ):
            raise ValueError(
                f"num_extra_experts={self.num_extra_experts} (DEEPINFER_OVERRIDE_NUM_EXTRA_EXPERTS)"
                f" and expert_rearrangement_step_interval="
                f"{self.expert_rearrangement_step_interval} "
                "(DEEPINFER_EXPERT_REARRANGEMENT_STEP_INTERVAL) place experts over ranks: they "
                "need expert_parallel_size > 1"
            )
        if self.launched is not None:
            if isinstance(self.launched, Mapping):
                self.launched = LaunchedRank(**self.launched)
            if self.launched.world_size != layout.world_size:
                raise ValueError(
                    f"the launcher started {self.launched.world_size} ranks (WORLD_SIZE) but "
                    f"data={self.data_parallel_size}, expert={self.expert_parallel_size}, "
                    f"engram={self.engram_parallel_size} need {layout.world_size}"
                )

    @property
    def layout(self) -> ParallelLayout:
        """The parallel layout of the sizes (one rank when all are 1)."""
        return ParallelLayout(
            self.data_parallel_size, self.expert_parallel_size, self.engram_parallel_size
        )

    def kernel_settings(self) -> KernelSettings:
        """What the kernel registry runs this engine's ops under (`REGISTRY.configured`)."""
        return KernelSettings(
            overrides=parse_overrides(self.kernels, "kernels"),
            batch_invariant=self.batch_invariant,
        )

    def torch_dtype(self, device: str):
        """The compute/cache dtype: `dtype`, else bfloat16 on GPU and float32 on CPU."""
        import torch

        name = self.dtype or ("float32" if device == "cpu" else "bfloat16")
        return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[
            name
        ]

    @property
    def max_backtrack(self) -> int:
        """Tokens a verify step can roll back: max draft length + 1 (spec-and-parallel.md §3.3);
        known once the engine has set `use_nextn_decode`."""
        if self.use_nextn_decode is None:
            raise ValueError("max_backtrack: use_nextn_decode is not resolved against a model yet")
        return self.use_nextn_decode + 1

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> EngineConfig:
        """Build a config from the environment, then apply `overrides` (argument wins).

        `env` defaults to `os.environ`. An override of None means "not given". Unknown override
        names raise `ValueError` listing the accepted ones.
        """
        env = os.environ if env is None else env
        names = {f.name for f in dataclasses.fields(cls) if f.init}
        unknown = sorted(set(overrides) - names)
        if unknown:
            raise ValueError(
                f"unknown engine argument(s) {unknown}; accepted: {', '.join(sorted(names))}"
            )
        values: dict[str, Any] = {}
        sources: dict[str, str] = {}
        for var, name in ENV_FIELDS.items():
            raw = env.get(var)
            if raw is None or raw == "":
                continue
            values[name] = _parse_env(var, name, raw)
            sources[name] = var
        launched = _launched_rank(env)
        if launched is not None:
            values["launched"] = launched
        for k, v in overrides.items():
            if v is not None:
                values[k] = v
                sources.pop(k, None)
        cfg = cls(**values)
        cfg.sources = sources
        if cfg.yoco_prefill_truncation_mode == "off" and "yoco_prefill_keep_tokens" in values:
            logger.warning(
                "%s=%d has no effect: yoco_prefill_truncation_mode is 'off' (set "
                "DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE to mask or compact to truncate)",
                cfg.origin("yoco_prefill_keep_tokens"),
                cfg.yoco_prefill_keep_tokens,
            )
        return cfg


def _launched_rank(env: Mapping[str, str]) -> LaunchedRank | None:
    """This process's rank when a launcher set all of `LAUNCHER_VARS`, else None."""
    if not all(env.get(v) for v in LAUNCHER_VARS):
        return None
    rank = _parse_int("RANK", env["RANK"], 0)
    world = _parse_int("WORLD_SIZE", env["WORLD_SIZE"], 1)
    local = _parse_int("LOCAL_RANK", env["LOCAL_RANK"], 0)
    if rank >= world:
        raise ValueError(f"RANK={rank} must be < WORLD_SIZE={world}")
    return LaunchedRank(rank, world, local)


def _parse_env(var: str, name: str, raw: str) -> Any:
    """Parse one environment variable; the error names the variable, not the field."""
    if name in ("async_scheduling", "enable_mtp_varlen", "batch_invariant"):
        return parse_bool(var, raw)
    if name == "accelerator":
        return _parse_choice(var, raw, ACCELERATORS)
    if name == "yoco_prefill_truncation_mode":
        return _parse_choice(var, raw, TRUNCATION_MODES)
    if name == "yoco_prefill_keep_tokens":
        return _parse_int(var, raw, 1)
    if name in ("use_nextn_decode", "expert_rearrangement_step_interval", "num_extra_experts"):
        return _parse_int(var, raw, 0)
    if name == "expert_count_window_size":
        return _parse_int(var, raw, 1)
    if name == "collective_timeout_s":
        return _parse_seconds(var, raw)
    if name == "kernels":
        parse_overrides(raw, var)
    return raw  # the model directory, the kernel overrides


def resolve_device(accelerator: str | None, origin: str = "the accelerator argument") -> str:
    """Map an accelerator name (or None = detect) to a torch device string; `origin` (where the
    name came from: an argument or DEEPINFER_ACCELERATOR) is named in the errors."""
    import torch

    if accelerator is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if accelerator == "nvidia":
        if not torch.cuda.is_available():
            raise ValueError(
                f"accelerator='nvidia' ({origin}) but CUDA is not available on this machine; "
                "use 'cpu', or leave it unset to detect"
            )
        return "cuda"
    if accelerator == "ascend":
        raise NotImplementedError(
            f"accelerator='ascend' ({origin}): the engine's NPU device path (torch_npu) is "
            "not built yet"
        )
    return "cpu"
