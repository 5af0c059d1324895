"""tilelang/lowering.py: the per-process compile cache (needs tilelang and nvcc; no GPU)."""

from __future__ import annotations

import importlib.util
import shutil

import pytest
from deepinfer_kernels.tilelang import decode_gemm as dg
from deepinfer_kernels.tilelang import lowering

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("tilelang") is None or shutil.which("nvcc") is None,
    reason="needs tilelang and nvcc",
)


def test_kernel_cache_compiles_each_key_once():
    builds = []

    def build(*key):
        builds.append(key)
        return dg.build_kernel(*key)

    cache = lowering.KernelCache("test kernel", build)
    cfg = dg.pick_tile_config(16, 256, 512)
    key = (256, 512, dg.decode_tile_split(256, 512), "float32", cfg)
    first = cache.get(key, cfg.row_swizzle)
    assert cache.get(key, cfg.row_swizzle) is first and builds == [key]
    other = (256, 512, key[2], "bfloat16", cfg)
    assert cache.get(other, cfg.row_swizzle) is not first and builds == [key, other]
