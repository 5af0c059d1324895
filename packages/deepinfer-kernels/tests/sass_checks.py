"""Compiling a lowered TileLang kernel as TileLang does (nvcc, sm_90a) and reading ptxas' report
and the SASS, for the CPU tests that check registers, spills and instruction counts (skipped
where nvcc or triton's cuobjdump is missing)."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
from pathlib import Path


def cuda_tools() -> tuple[str, str] | None:
    """(nvcc, cuobjdump) if both are on this machine (cuobjdump ships with triton), else None."""
    nvcc = shutil.which("nvcc")
    spec = importlib.util.find_spec("triton")
    if nvcc is None or spec is None or spec.origin is None:
        return None
    cuobjdump = os.path.join(os.path.dirname(spec.origin), "backends", "nvidia", "bin", "cuobjdump")
    return (nvcc, cuobjdump) if os.path.exists(cuobjdump) else None


def compile_sass(source: str, tmp_path: Path) -> tuple[str, list[str]]:
    """CUDA source -> (ptxas' verbose report, the SASS opcodes in order), with TileLang's flags."""
    import tilelang.env as tl_env

    nvcc, cuobjdump = cuda_tools()
    cu = tmp_path / "k.cu"
    cu.write_text(source)
    cubin = tmp_path / "k.cubin"
    flags = ["-std=c++20", "-O3", "-gencode", "arch=compute_90a,code=sm_90a", "--cubin", "-w"]
    flags += [f"-I{tl_env.TILELANG_TEMPLATE_PATH}", f"-I{tl_env.CUTLASS_INCLUDE_DIR}"]
    flags += ["-DENABLE_BF16", "--ptxas-options=--verbose", "-o", str(cubin), str(cu)]
    built = subprocess.run([nvcc, *flags], capture_output=True, text=True, check=False)
    assert built.returncode == 0, built.stderr[-2000:]
    sass = subprocess.run(
        [cuobjdump, "-sass", str(cubin)], capture_output=True, text=True, check=True
    ).stdout
    ops = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\d\s+)?([A-Z][A-Za-z0-9_.]*)", sass)
    return built.stdout + built.stderr, ops


def cubin_report(flag: str, cubin: bytes, tmp_path: Path) -> str:
    """cuobjdump's `flag` report (-sass, -res-usage) of a cubin; skips the test without
    cuobjdump (and nvcc: `cuda_tools`)."""
    import pytest

    tools = cuda_tools()
    if tools is None:
        pytest.skip("no cuobjdump here (it ships with triton)")
    path = tmp_path / "k.cubin"
    path.write_bytes(cubin)
    return subprocess.run(
        [tools[1], flag, str(path)], capture_output=True, text=True, check=True
    ).stdout


def unspilled_sass(cubin: bytes, tmp_path: Path) -> str:
    """The SASS of a cubin (`cubin_report`), asserting that the kernel keeps nothing in local
    memory (no LDL / STL)."""
    sass = cubin_report("-sass", cubin, tmp_path)
    assert not re.search(r"\b(LDL|STL)\b", sass), "the kernel spills to local memory"
    return sass
