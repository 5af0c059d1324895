"""How our TileLang kernels become CUDA: the sm_90a target, our override of TileLang's wgmma
layout inference for 128-B rows, lowering to source (CPU, no nvcc: inspection and tests), and
compiling each kernel once per process per static shape.

tilelang is imported only inside these functions, so importing this module stays cheap and CPU CI
never needs it.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Hashable, Iterator
from typing import Any

log = logging.getLogger(__name__)

SM90A = {"kind": "cuda", "arch": "sm_90a"}


@contextlib.contextmanager
def row_swizzle_lowering(on: bool) -> Iterator[None]:
    """While a kernel is lowered with 128-B rows (`fp8_gemm.TileConfig.row_swizzle`,
    `decode_gemm.DecodeTileConfig.row_swizzle`), TileLang's wgmma layout
    inference gives shared operands whose rows are 128 B the 128-B swizzle over the whole row
    (it would infer a 32-B swizzle from a 32-wide k-slice). Restored on exit; tied to TileLang
    0.1.15's `GemmWGMMA.infer_layout`, so any other version is refused with the reason."""
    if not on:
        yield
        return
    try:
        from tilelang.cuda.op.gemm.gemm_wgmma import GemmWGMMA
        from tilelang.layout import make_full_bank_swizzled_layout
    except ImportError as e:
        raise NotImplementedError(
            f"the 128-B row swizzle needs TileLang's GemmWGMMA layout inference (0.1.15): {e}"
        ) from e
    inferred = GemmWGMMA.infer_layout

    def infer_layout(self, target, thread_nums):
        layouts = inferred(self, target, thread_nums)
        for buf in (self.A, self.B):
            if buf in layouts and buf.shape[-1] * buf.dtype.bits == 128 * 8:
                layouts[buf] = make_full_bank_swizzled_layout(buf)
        return layouts

    GemmWGMMA.infer_layout = infer_layout
    try:
        yield
    finally:
        GemmWGMMA.infer_layout = inferred


def lower_source(prim_func: Any, row_swizzle: bool) -> str:
    """CUDA source of a TileLang prim_func for sm_90a, lowered without nvcc."""
    import tilelang
    from tvm.target import Target

    target = Target(SM90A)
    with target, row_swizzle_lowering(row_swizzle):
        artifact = tilelang.lower(prim_func, target=target)
    return artifact.kernel_source


class KernelCache:
    """The compiled kernels of one builder, keyed by the builder's static arguments.

    Compiling costs seconds (nvcc), so each key compiles once per process; the run-time
    dimensions (M, routed rows) are dynamic arguments of the kernels, so a weight shape needs
    one compile per configuration.
    """

    def __init__(self, what: str, build: Callable[..., Any]) -> None:
        self.what = what  # for the log line
        self.build = build  # build(*key) -> the TileLang prim_func
        self._kernels: dict[tuple[Hashable, ...], Any] = {}

    def get(self, key: tuple[Hashable, ...], row_swizzle: bool) -> Any:
        """The kernel `build(*key)` compiled for sm_90a (compiled on first use)."""
        kernel = self._kernels.get(key)
        if kernel is None:
            import tilelang

            start = time.perf_counter()
            with row_swizzle_lowering(row_swizzle):
                kernel = tilelang.compile(self.build(*key), target=SM90A)
            self._kernels[key] = kernel
            log.info(
                "compiled the %s for %s in %.1f s (once per process)",
                self.what, key[:-1], time.perf_counter() - start,  # (the key less its config)
            )  # fmt: skip
        return kernel
