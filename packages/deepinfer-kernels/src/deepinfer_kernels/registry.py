"""The op registry: one entry per hot op, implementations in tiers, chosen per call by capability.

An implementation names its function as ``"module:function"`` and is imported only when first
chosen, so importing deepinfer_kernels never imports triton, tilelang or a vendor library.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import importlib.util
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch

from .settings import TIERS, KernelSettings


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def device_capability(device: torch.device) -> tuple[int, int] | None:
    """The CUDA compute capability of `device` (None off CUDA), looked up once per GPU: the
    registry and the tiers' checks ask on every call."""
    if device.type != "cuda":
        return None
    return _capability(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """The SMs of a CUDA device (looked up once per GPU), which GEMM plans depend on; 132 (the
    H200's) off CUDA, where no plan uses it."""
    if device.type != "cuda":
        return 132
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def device_guard(device: torch.device):
    """A block whose kernels launch on `device`: GPU kernels launch on the current CUDA device,
    so a call whose tensors live on another GPU runs under that device."""
    other = device.type == "cuda" and device.index is not None
    if other and device.index != torch.cuda.current_device():
        return torch.cuda.device(device)
    return contextlib.nullcontext()


@dataclass(frozen=True)
class Implementation:
    """One way to compute an op.

    `devices`: torch device types it runs on. `min_capability`: lowest CUDA compute capability.
    `requires`: modules that must be importable (checked without importing them).
    `supports`: optional ``"module:function"`` taking the op's arguments and returning ``None`` when
    it can run them, else a short reason (dtype, shape limit, ...).
    `routing`: how the tier shares its calls among its kernels (by M, mode, ...), for people
    reading `python -m deepinfer_kernels`; empty when it has one kernel.
    """

    op: str
    tier: str
    target: str
    devices: tuple[str, ...] = ("cpu", "cuda")
    min_capability: tuple[int, int] | None = None
    requires: tuple[str, ...] = ()
    supports: str | None = None
    routing: str = ""

    def __post_init__(self) -> None:
        if self.tier not in TIERS:
            raise ValueError(f"{self.op}: tier {self.tier!r} is not one of {', '.join(TIERS)}")


def _load(target: str) -> Callable[..., Any]:
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def _first_tensor(args: tuple[Any, ...]) -> torch.Tensor:
    for a in args:
        if isinstance(a, torch.Tensor):
            return a
    raise TypeError("an op needs at least one tensor argument")


_DEFAULTS = KernelSettings()


class OpRegistry:
    """Maps op names to their implementations and picks one for each call."""

    def __init__(self) -> None:
        self._docs: dict[str, str] = {}
        self._impls: dict[str, list[Implementation]] = {}
        self._active: ContextVar[KernelSettings | None] = ContextVar(
            f"kernel_settings_{id(self)}", default=None
        )
        self._planners: dict[str, str] = {}
        self._loaded: dict[str, Callable[..., Any]] = {}
        # (op, device type, capability, forced tier) -> implementations whose static checks
        # pass, best first
        self._static: dict[tuple[str, str, tuple[int, int] | None, str | None], list] = {}

    # -- building ------------------------------------------------------------------------------
    def declare(self, op: str, doc: str, planner: str | None = None) -> None:
        """Declare an op name with a one-line description (shapes, units). planner: for ops whose
        tiers hold several kernels, ``"module:function"`` taking the op's arguments and returning
        the tier a call runs on (its op module picks the kernel); `resolve` asks it."""
        if op in self._docs:
            raise ValueError(f"op {op!r} is declared twice")
        self._docs[op] = doc
        self._impls[op] = []
        if planner is not None:
            self._planners[op] = planner

    def register(self, impl: Implementation) -> None:
        if impl.op not in self._docs:
            raise ValueError(f"register: op {impl.op!r} is not declared")
        if any(i.tier == impl.tier for i in self._impls[impl.op]):
            raise ValueError(f"op {impl.op!r} already has a {impl.tier!r} implementation")
        self._impls[impl.op].append(impl)
        self._impls[impl.op].sort(key=lambda i: TIERS.index(i.tier))
        self._static.clear()

    # -- settings ------------------------------------------------------------------------------
    @property
    def settings(self) -> KernelSettings:
        """The settings calls run under: those of the innermost `configured` block, else the
        defaults (auto mode, no overrides)."""
        return self._active.get() or _DEFAULTS

    def check(self, settings: KernelSettings) -> None:
        """Raise ValueError naming the problem if `settings` overrides an undeclared op or names
        a tier the op does not have."""
        for op, tier in settings.overrides.items():
            if op not in self._docs:
                raise ValueError(
                    f"DEEPINFER_KERNELS: unknown op {op!r}; ops are {', '.join(sorted(self._docs))}"
                )
            tiers = [i.tier for i in self._impls[op]]
            if tier not in tiers:
                raise ValueError(
                    f"DEEPINFER_KERNELS: op {op!r} has no {tier!r} implementation; "
                    f"it has {', '.join(tiers)}"
                )

    @property
    def batch_invariant(self) -> bool:
        return self.settings.batch_invariant

    @contextmanager
    def configured(self, settings: KernelSettings) -> Iterator[None]:
        """Run the block's calls under `settings` (checked first), restoring the settings after,
        also when the block raises. Scoped to the current thread / context: two engines in one
        process each run their steps under their own settings."""
        self.check(settings)
        token = self._active.set(settings)
        try:
            yield
        finally:
            self._active.reset(token)

    @contextmanager
    def batch_invariant_mode(self, on: bool = True) -> Iterator[None]:
        """`configured` with the current settings' overrides and batch-invariant mode `on`."""
        with self.configured(dataclasses.replace(self.settings, batch_invariant=on)):
            yield

    # -- choosing ------------------------------------------------------------------------------
    def ops(self) -> list[str]:
        return sorted(self._docs)

    def doc(self, op: str) -> str:
        return self._docs[op]

    def implementations(self, op: str) -> list[Implementation]:
        if op not in self._impls:
            raise KeyError(f"unknown op {op!r}; ops are {', '.join(sorted(self._docs))}")
        return list(self._impls[op])

    def static_reason(
        self, impl: Implementation, device_type: str, capability: tuple[int, int] | None
    ) -> str | None:
        """Why `impl` cannot run on this device regardless of arguments, or None."""
        forced = self.settings.overrides.get(impl.op)
        if forced is not None and forced != impl.tier:
            return f"DEEPINFER_KERNELS selects {forced}"
        if device_type not in impl.devices:
            return f"runs on {'/'.join(impl.devices)}, not {device_type}"
        if impl.min_capability is not None and (
            capability is None or capability < impl.min_capability
        ):
            need = ".".join(map(str, impl.min_capability))
            return f"needs compute capability >= {need}"
        for mod in impl.requires:
            if importlib.util.find_spec(mod) is None:
                return f"{mod} is not installed"
        return None

    def _candidates(self, op: str, device: torch.device) -> list[Implementation]:
        capability = device_capability(device)
        key = (op, device.type, capability, self.settings.overrides.get(op))
        found = self._static.get(key)
        if found is None:
            found = [
                i
                for i in self.implementations(op)
                if self.static_reason(i, device.type, capability) is None
            ]
            self._static[key] = found
        return found

    def tiers(self, op: str, device: torch.device | str) -> list[str]:
        """The tiers that can run `op` on `device` before any argument check (device type,
        capability, installed modules, overrides), best first: a call tries them in this order."""
        return [i.tier for i in self._candidates(op, torch.device(device))]

    def _target(self, target: str) -> Callable[..., Any]:
        fn = self._loaded.get(target)
        if fn is None:
            fn = self._loaded[target] = _load(target)
        return fn

    def function(self, impl: Implementation) -> Callable[..., Any]:
        """The implementation's function (imported on first use)."""
        return self._target(impl.target)

    def resolve(self, op: str, *args: Any, **kwargs: Any) -> Implementation:
        """The implementation that a call of `op` with these arguments runs."""
        planner = self._planners.get(op)
        if planner is not None:
            tier = self._target(planner)(*args, **kwargs)
            return next(i for i in self.implementations(op) if i.tier == tier)
        return self._resolve(op, _first_tensor(args).device, args, kwargs)

    def _resolve(
        self, op: str, device: torch.device, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Implementation:
        reasons = []
        candidates = self._candidates(op, device)
        if not candidates:
            capability = device_capability(device)
            reasons = [
                f"{i.tier}: {self.static_reason(i, device.type, capability)}"
                for i in self.implementations(op)
            ]
        for impl in candidates:
            if impl.supports is not None:
                why = self._target(impl.supports)(*args, **kwargs)
                if why is not None:
                    reasons.append(f"{impl.tier}: {why}")
                    continue
            return impl
        raise NotImplementedError(
            f"no implementation of {op!r} runs these arguments on {device}: "
            + ("; ".join(reasons) or "no tier is available on this device")
        )

    def call(self, op: str, *args: Any, **kwargs: Any) -> Any:
        """Run `op` with the implementation `resolve` picks, on the device of its tensors (ops
        with a planner are called through their op module instead)."""
        if op in self._planners:
            raise TypeError(f"{op!r} picks its kernels in its op module: call ops.{op}")
        device = _first_tensor(args).device
        impl = self._resolve(op, device, args, kwargs)
        with device_guard(device):
            return self.function(impl)(*args, **kwargs)


REGISTRY = OpRegistry()
"""The process-wide registry that `deepinfer_kernels.ops` registers into and calls through."""
