"""Compiling and launching hand-written CUDA kernels: CUDA C++ source -> cubin with NVRTC (the
runtime compiler that ships with torch's CUDA libraries, so no nvcc is needed), loaded and
launched through the CUDA driver on torch's current stream (so CUDA graphs capture them); and
what the kernels' configs share: the SM's shared-memory limit and the check of their fields.

Everything is reached through ctypes inside functions: importing this module loads no library.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path

import torch

MAX_SHARED = 227 * 1024  # shared memory one CTA may take on sm_90 (static + dynamic)


def check_fields(cfg: object, checks: tuple[tuple[str, bool, str], ...]) -> None:
    """Raise ValueError naming the first int field of cfg that holds another type (a float or a
    bool would reach the kernels' compile-time constants), then the first field whose check
    (name, ok, allowed) fails."""
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        if f.type == "int" and type(value) is not int:
            raise ValueError(f"{type(cfg).__name__}.{f.name} must be an int, got {value!r}")
    for name, ok, allowed in checks:
        if not ok:
            raise ValueError(
                f"{type(cfg).__name__}.{name} must be {allowed}, got {getattr(cfg, name)!r}"
            )


class TensorMap:
    """A TMA descriptor (the driver's 128-byte, 64-byte aligned CUtensorMap) for a kernel's
    `const __grid_constant__` parameter: see `tensor_map_2d`."""

    def __init__(self) -> None:
        self._raw = ctypes.create_string_buffer(128 + 64)
        address = (ctypes.addressof(self._raw) + 63) // 64 * 64
        self.words = (ctypes.c_uint64 * 16).from_address(address)


Arg = torch.Tensor | int | float | TensorMap | None
"""A kernel argument: a tensor (its device pointer), an int (int32), a float (fp32), a
TensorMap (by value), None (a null pointer)."""

_TMA_UINT8 = 0  # CUtensorMapDataType: CU_TENSOR_MAP_DATA_TYPE_UINT8
_TMA_L2_256B = 3  # CUtensorMapL2promotion: CU_TENSOR_MAP_L2_PROMOTION_L2_256B
_TMA_SWIZZLE_128B = 3  # CUtensorMapSwizzle: CU_TENSOR_MAP_SWIZZLE_128B


@functools.lru_cache(maxsize=4096)  # pure in its ints; a weight's maps are the same every call
def tensor_map_2d(
    address: int,
    rows: int,
    row_bytes: int,
    box_bytes: int,
    box_rows: int,
    *,
    swizzle_128b: bool = False,
) -> TensorMap:
    """A tile-mode TMA descriptor of the contiguous 2-D bytes [rows, row_bytes] at device
    `address` (row_bytes and the address multiples of 16) whose boxes are box_bytes x box_rows
    (each at most 256; box_bytes a multiple of 16), out-of-bounds bytes read as zero; no swizzle,
    or with swizzle_128b the 16-byte chunks of each box row land XOR-permuted by the row's
    shared-memory address bits 7..9 (what wgmma's 128-byte swizzle layout reads; box_bytes at
    most 128). It holds the address and shape only: valid while that memory is (the same
    arguments give the same map, so it is cached; callers must not change it)."""
    if row_bytes % 16 or address % 16 or box_bytes % 16:
        raise ValueError(
            f"tensor_map_2d: row bytes {row_bytes}, the address and box bytes {box_bytes} must "
            "be multiples of 16"
        )
    if not (0 < box_bytes <= (128 if swizzle_128b else 256) and 0 < box_rows <= 256):
        raise ValueError(
            f"tensor_map_2d: box {box_bytes} x {box_rows} must be at most "
            f"{128 if swizzle_128b else 256} x 256"
        )
    m = TensorMap()
    _cu_check(
        _driver().cuTensorMapEncodeTiled(
            ctypes.byref(m.words), _TMA_UINT8, 2, ctypes.c_void_p(address),
            (ctypes.c_uint64 * 2)(row_bytes, rows), (ctypes.c_uint64 * 1)(row_bytes),
            (ctypes.c_uint32 * 2)(box_bytes, box_rows), (ctypes.c_uint32 * 2)(1, 1),
            0, _TMA_SWIZZLE_128B if swizzle_128b else 0, _TMA_L2_256B, 0,
        ),
        "cuTensorMapEncodeTiled",
    )  # fmt: skip
    return m


def tail_box(m: int, tile: int) -> int:
    """Rows of the boxes the TMA loads per stage for the last tile of `tile` rows over M rows:
    its rows rounded up to 8 (a full tile: the tile). Rows past the tensor are zero-filled by the
    TMA, slowly; the tile's rows past the box are never loaded and only feed sums that are not
    stored."""
    return -(-(m - (-(-m // tile) - 1) * tile) // 8) * 8


@functools.cache
def _find_nvrtc() -> ctypes.CDLL | str:
    """libnvrtc for torch's CUDA major version, or why not (searched once per process): by soname
    first (torch loads it), then in the `nvidia` wheels' and torch's lib folders, then in
    /usr/local/cuda/lib64."""
    major = (torch.version.cuda or "13").split(".")[0]
    name = f"libnvrtc.so.{major}"
    try:
        return ctypes.CDLL(name)
    except OSError:
        pass
    places = []
    spec = importlib.util.find_spec("nvidia")
    for root in spec.submodule_search_locations if spec and spec.submodule_search_locations else []:
        places += sorted(Path(root).glob(f"*/lib/{name}"))
    places += [Path(torch.__file__).parent / "lib" / name, Path("/usr/local/cuda/lib64") / name]
    for path in places:
        if path.exists():
            return ctypes.CDLL(str(path))
    return f"NVRTC not found (tried {name} by soname, {', '.join(map(str, places))})"


def nvrtc() -> ctypes.CDLL:
    """The NVRTC library; OSError naming the places tried if there is none."""
    found = _find_nvrtc()
    if isinstance(found, str):
        raise OSError(found)
    return found


def launch_reason(x: torch.Tensor) -> str | None:
    """Why a cuda kernel cannot run on x's device from here (not a CUDA tensor; no NVRTC), or
    None: the last check of every cuda kernel's call."""
    if x.device.type != "cuda":
        return f"input on {x.device.type}"
    return nvrtc_reason()


def device_index(device: torch.device) -> int:
    """The index of a CUDA device (the current one for a bare ``cuda``)."""
    return device.index if device.index is not None else torch.cuda.current_device()


def sm_count(device: torch.device) -> int:
    """The SMs of a CUDA device, which the GEMMs' configs depend on; 132 (the H200's) for any
    other device, where a call is refused anyway (`launch_reason`)."""
    if device.type != "cuda":
        return 132
    return _sm_count(device_index(device))


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def nvrtc_reason() -> str | None:
    """Why CUDA kernels cannot be compiled here, or None (cheap: the search runs once)."""
    found = _find_nvrtc()
    return found if isinstance(found, str) else None


def _nvrtc_check(lib: ctypes.CDLL, result: int, what: str) -> None:
    if result != 0:
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        raise RuntimeError(f"NVRTC {what}: {lib.nvrtcGetErrorString(result).decode()}")


def compile_cubin(
    source: str,
    name: str,
    arch: str,
    defines: dict[str, int],
    headers: dict[str, str] | None = None,
) -> tuple[bytes, str]:
    """CUDA C++ `source` compiled for `arch` (e.g. "sm_90a") with `-D` `defines` and the
    `#include`-able `headers` (name -> text) -> (cubin bytes, NVRTC's log: the front end's
    warnings and ptxas' remarks, for example C7515, wgmma instructions serialized). A compile
    error raises RuntimeError with the log. Runs on CPU (no GPU needed)."""
    lib = nvrtc()
    prog = ctypes.c_void_p()
    headers = headers or {}
    texts = (ctypes.c_char_p * len(headers))(*(t.encode() for t in headers.values()))
    names = (ctypes.c_char_p * len(headers))(*(n.encode() for n in headers))
    _nvrtc_check(
        lib,
        lib.nvrtcCreateProgram(
            ctypes.byref(prog), source.encode(), name.encode(), len(headers), texts, names
        ),
        "create",
    )
    try:
        opts = [f"--gpu-architecture={arch}", "-std=c++17"]
        opts += [f"-D{k}={v}" for k, v in sorted(defines.items())]
        argv = (ctypes.c_char_p * len(opts))(*(o.encode() for o in opts))
        result = lib.nvrtcCompileProgram(prog, len(opts), argv)
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        if result != 0:
            raise RuntimeError(
                f"NVRTC could not compile {name} ({' '.join(opts)}):\n{log.value.decode()}"
            )
        size = ctypes.c_size_t()
        _nvrtc_check(lib, lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "cubin size")
        cubin = ctypes.create_string_buffer(size.value)
        _nvrtc_check(lib, lib.nvrtcGetCUBIN(prog, cubin), "cubin")
        return cubin.raw, log.value.decode()
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8  # CUfunction_attribute
_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CUlaunchAttributeID


class _LaunchAttribute(ctypes.Structure):
    # CUlaunchAttribute: an id, padding to 8 bytes, a 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int * 16)]


class _LaunchConfig(ctypes.Structure):
    # CUlaunchConfig
    _fields_ = [
        ("grid", ctypes.c_uint * 3),
        ("block", ctypes.c_uint * 3),
        ("shared_bytes", ctypes.c_uint),
        ("stream", ctypes.c_void_p),
        ("attrs", ctypes.POINTER(_LaunchAttribute)),
        ("num_attrs", ctypes.c_uint),
    ]


@functools.cache
def _driver() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


def _cu_check(result: int, what: str) -> None:
    if result != 0:
        msg = ctypes.c_char_p()
        _driver().cuGetErrorString(result, ctypes.byref(msg))
        raise RuntimeError(f"CUDA driver {what}: {(msg.value or b'?').decode()} ({result})")


@dataclass
class Kernel:
    """One `extern "C"` kernel of a loaded cubin, on one device."""

    name: str
    function: ctypes.c_void_p
    module: ctypes.c_void_p  # kept so the module outlives the function handle

    def launch(
        self,
        grid: Sequence[int],
        block: int,
        args: Sequence[Arg],
        shared_bytes: int = 0,
        *,
        programmatic: bool = False,
    ) -> None:
        """Launch on torch's current stream of the current device. grid: 1 to 3 sizes.

        programmatic: a programmatic dependent launch (the driver's programmatic stream
        serialization): the kernel may start once every CTA of the kernel before it on the
        stream has run `griddepcontrol.launch_dependents` (or ended), so it must run
        `griddepcontrol.wait` before it reads what that kernel writes; CUDA graphs keep it as
        a programmatic edge."""
        if any(g <= 0 for g in grid):
            return  # nothing to do (an empty batch)
        gx, gy, gz = (*grid, 1, 1)[:3]
        holders: list[object] = []
        for a in args:
            if isinstance(a, torch.Tensor):
                holders.append(ctypes.c_void_p(a.data_ptr()))
            elif a is None:
                holders.append(ctypes.c_void_p(0))
            elif isinstance(a, bool | int):
                holders.append(ctypes.c_int32(int(a)))
            elif isinstance(a, float):
                holders.append(ctypes.c_float(a))
            elif isinstance(a, TensorMap):
                holders.append(a.words)
            else:
                raise TypeError(f"{self.name}: unsupported kernel argument {type(a).__name__}")
        params = (ctypes.c_void_p * len(holders))(*map(ctypes.addressof, holders))
        stream = ctypes.c_void_p(_current_stream())
        if not programmatic:
            _cu_check(
                _driver().cuLaunchKernel(
                    self.function, gx, gy, gz, block, 1, 1, shared_bytes, stream, params, None
                ),
                f"launch of {self.name}",
            )
            return
        attr = _LaunchAttribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION)
        attr.value[0] = 1
        config = _LaunchConfig(
            (ctypes.c_uint * 3)(gx, gy, gz), (ctypes.c_uint * 3)(block, 1, 1), shared_bytes,
            stream, ctypes.pointer(attr), 1,
        )  # fmt: skip
        _cu_check(
            _driver().cuLaunchKernelEx(ctypes.byref(config), self.function, params, None),
            f"programmatic launch of {self.name}",
        )


# torch's compiled code reads the current stream's handle through this, without building a
# Stream object (cheaper per launch); None where a torch build lacks it
_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _current_stream() -> int:
    """torch's current CUDA stream on the current device (under graph capture: the capturing
    stream), as a CUstream handle."""
    if _RAW_STREAM is None:
        return torch.cuda.current_stream().cuda_stream
    return _RAW_STREAM(torch.cuda.current_device())


def compile_file(path: Path, arch: str, defines: dict[str, int]) -> bytes:
    """The cubin of a .cu file whose `#include "x.cuh"`s are .cuh files beside it."""
    return compile_file_and_log(path, arch, defines)[0]


def compile_file_and_log(path: Path, arch: str, defines: dict[str, int]) -> tuple[bytes, str]:
    """`compile_cubin` of a .cu file (as `compile_file`): the cubin and NVRTC's log."""
    headers = {h.name: h.read_text() for h in sorted(path.parent.glob("*.cuh"))}
    return compile_cubin(path.read_text(), path.name, arch, defines, headers)


def load_kernel(cubin: bytes, name: str, device: torch.device, shared_bytes: int = 0) -> Kernel:
    """The kernel `name` of `cubin`, loaded into `device`'s primary context (the one torch uses),
    allowed `shared_bytes` of dynamic shared memory (above 48 KiB needs the opt-in)."""
    drv = _driver()
    torch.cuda.init()
    with torch.cuda.device(device):
        ctx = ctypes.c_void_p()
        _cu_check(drv.cuCtxGetCurrent(ctypes.byref(ctx)), "current context")
        if not ctx.value:  # torch has not touched this device from this thread yet
            dev = ctypes.c_int()
            _cu_check(drv.cuDeviceGet(ctypes.byref(dev), device.index or 0), "device")
            _cu_check(drv.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "primary context")
            _cu_check(drv.cuCtxSetCurrent(ctx), "set context")
        module = ctypes.c_void_p()
        _cu_check(drv.cuModuleLoadData(ctypes.byref(module), cubin), "module load")
        function = ctypes.c_void_p()
        _cu_check(
            drv.cuModuleGetFunction(ctypes.byref(function), module, name.encode()),
            f"kernel {name}",
        )
        if shared_bytes > 0:  # static + dynamic over 48 KiB needs the opt-in
            _cu_check(
                drv.cuFuncSetAttribute(function, _MAX_DYNAMIC_SHARED_SIZE_BYTES, shared_bytes),
                f"{shared_bytes} bytes of shared memory for {name}",
            )
    return Kernel(name, function, module)


def operand_reason(
    x_fp8: torch.Tensor,
    x_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    out_dtype: torch.dtype,
) -> str | None:
    """What is wrong with the operands of a cuda FP8 GEMM call (dtypes, shapes, layout,
    alignment), or None: the TMA maps are built from these shapes, so a wrong one must not
    pass. Both cuda GEMMs (`decode_gemm.py`, `prefill_gemm.py`) check their calls with it."""
    if x_fp8.dtype != torch.float8_e4m3fn or w.dtype != torch.float8_e4m3fn:
        return f"x_fp8 and w must be float8_e4m3fn, got {x_fp8.dtype} and {w.dtype}"
    if x_fp8.dim() != 2 or w.dim() != 2 or w.shape[1] != x_fp8.shape[1]:
        return f"x_fp8 [M, K] and w [N, K] must share K, got {list(x_fp8.shape)}, {list(w.shape)}"
    (m, k), n = x_fp8.shape, w.shape[0]
    if list(x_scale.shape) != [m, k // 32]:
        return f"x_scale must be [{m}, {k // 32}], got {list(x_scale.shape)}"
    if list(w_scale.shape) != [-(-n // 32), k // 32]:
        return f"w_scale must be [{-(-n // 32)}, {k // 32}], got {list(w_scale.shape)}"
    if out_dtype not in (torch.bfloat16, torch.float32):
        return f"out_dtype {out_dtype}: the cuda GEMM writes bfloat16 or float32"
    if x_scale.dtype != torch.float32:
        return f"x_scale is {x_scale.dtype}, the cuda GEMM reads float32"
    if w_scale.dtype not in (torch.float8_e8m0fnu, torch.float32):
        return f"w_scale is {w_scale.dtype}, the cuda GEMM reads float8_e8m0fnu or float32"
    for name, t in (("x_fp8", x_fp8), ("x_scale", x_scale), ("w", w), ("w_scale", w_scale)):
        if not t.is_contiguous():
            return f"{name} is not contiguous"
        if t.data_ptr() % 16:
            return f"{name} is not 16-byte aligned (the TMA copies it)"
    return None
