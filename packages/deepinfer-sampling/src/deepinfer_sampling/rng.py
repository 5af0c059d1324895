"""Counter-based random numbers: uniforms, pure functions of (seed, position, column, stream).

A seeded request must sample the same token whatever batch it is in, on CPU or CUDA, with or
without speculative decoding. So its randomness is not drawn from a stateful generator: every
uniform is a hash of its coordinates

    seed      the request's `seq_seed` (0 <= seed < 2**63)
    position  index, in the whole sequence (prompt + output), of the token being decided
    column    a vocabulary id (or any other non-negative index < 2**31 the caller chooses)
    stream    which independent family of draws this is (table below)

The hash uses only integer ops that are exact in torch int64 on every device: all intermediate
values stay in [0, 2**63) (32-bit lanes, multipliers below 2**31, so products never overflow and
right shifts are logical), and the 52-bit result k gives (k + 0.5) / 2**52 exactly in float64.
Hence the uniforms are bit-identical on CPU and CUDA. On CUDA the same integer recipe runs as
one fused elementwise kernel (torch's jiterator, compiled on first use) instead of ~30 small
kernels; tests check it against the CPU path bit for bit, and any failure to build it falls
back to the plain torch ops.

Reserved streams (add new ones here so two users never share draws):

    STREAM_SAMPLE        = 0  the Sampler's Gumbel-max draw of the next token (column = token id)
    STREAM_SPEC_ACCEPT   = 1  speculative verification: accept/reject uniform of a drafted token
    STREAM_SPEC_RESIDUAL = 2  speculative verification: draw from the residual distribution
    STREAM_DRAFT         = 3  drafter's own sampling, when a drafter samples rather than argmaxes
    streams >= 16           free for experiments; 4..15 reserved for the sampling/spec packages
"""

from __future__ import annotations

import warnings

import torch

__all__ = [
    "STREAM_DRAFT",
    "STREAM_SAMPLE",
    "STREAM_SPEC_ACCEPT",
    "STREAM_SPEC_RESIDUAL",
    "counter_uniform",
    "row_keys",
    "uniform_from_keys",
]

STREAM_SAMPLE = 0
STREAM_SPEC_ACCEPT = 1
STREAM_SPEC_RESIDUAL = 2
STREAM_DRAFT = 3

_MASK32 = 0xFFFFFFFF
# Multipliers of a 32-bit xorshift-multiply mixer; both are odd and < 2**31, so that a 32-bit
# value times one of them is < 2**63 and never overflows int64.
_MUL_A = 0x21F0AAAD
_MUL_B = 0x735A2D97
# Odd 31-bit constant that spreads consecutive columns across the 32-bit space.
_COLUMN_STEP = 0x6A09E667 >> 1 | 1
# Distinct starting words of the four key lanes.
_LANE_INIT = (0x2545F491, 0x3C6EF372, 0x1B873593, 0x5BE0CD19)
_MAX_COLUMN = 1 << 31
_TWO_POW_MINUS_52 = 2.0**-52


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """32-bit avalanche mixer on int64 tensors holding values in [0, 2**32); returns a new one."""
    x = x ^ (x >> 16)
    x = (x * _MUL_A) & _MASK32
    x ^= x >> 15
    x = (x * _MUL_B) & _MASK32
    x ^= x >> 15
    return x


def row_keys(seeds: torch.Tensor, positions: torch.Tensor, stream: int = 0) -> torch.Tensor:
    """Per-row hash keys of (seed, position, stream).

    Args:
        seeds: LongTensor [R], each in [0, 2**63).
        positions: LongTensor [R], each in [0, 2**63), same device as `seeds`.
        stream: int in [0, 2**32).
    Returns:
        LongTensor [4, R] of 32-bit words (values in [0, 2**32)), on the device of `seeds`.
        Feed it to `uniform_from_keys`. Computing keys once per step (e.g. on CPU while
        building a batch) and reusing them saves device work.
    """
    if seeds.dtype != torch.int64 or positions.dtype != torch.int64:
        raise ValueError(
            f"seeds and positions must be int64, got {seeds.dtype} and {positions.dtype}"
        )
    if seeds.dim() != 1 or seeds.shape != positions.shape:
        raise ValueError(
            f"seeds and positions must be 1-D of the same length, got {tuple(seeds.shape)} "
            f"and {tuple(positions.shape)}"
        )
    if not 0 <= stream < (1 << 32):
        raise ValueError(f"stream must be in [0, 2**32), got {stream}")
    positions = positions.to(seeds.device)
    # The four input words; negative inputs are outside the contract, the mask keeps the
    # arithmetic well defined anyway.
    words = (
        seeds & _MASK32,
        (seeds >> 32) & _MASK32,
        positions & _MASK32,
        (positions >> 32) & _MASK32,
    )
    init = torch.tensor(_LANE_INIT, dtype=torch.int64, device=seeds.device)[:, None]
    state = _mix32(init ^ stream)  # [4, 1]
    state = state.expand(4, seeds.shape[0])
    for word in words:
        state = _mix32(state ^ word)
        # Add the lane index so the four lanes never coincide.
        state = _mix32((state + init) & _MASK32)
    return state


def uniform_from_keys(keys: torch.Tensor, columns: int | torch.Tensor) -> torch.Tensor:
    """Uniforms in (0, 1) for every (row, column), from `row_keys`.

    Args:
        keys: LongTensor [4, R] from `row_keys`.
        columns: int C (columns 0..C-1), LongTensor [C] (the same columns for every row) or
            LongTensor [R, C] (per-row columns, e.g. candidate token ids). Values in [0, 2**31).
    Returns:
        float64 [R, C], each value (k + 0.5) / 2**52 for an integer k in [0, 2**52): never 0 or 1.
    """
    num_rows = keys.shape[1]
    device = keys.device
    if isinstance(columns, int):
        if columns < 0 or columns > _MAX_COLUMN:
            raise ValueError(f"columns must be in [0, 2**31], got {columns}")
        cols = torch.arange(columns, dtype=torch.int64, device=device)[None, :]
    else:
        if columns.dtype != torch.int64:
            raise ValueError(f"columns must be an int or an int64 tensor, got {columns.dtype}")
        if columns.dim() == 1:
            cols = columns.to(device)[None, :]
        elif columns.dim() == 2 and columns.shape[0] == num_rows:
            cols = columns.to(device)
        else:
            raise ValueError(
                f"columns tensor must be [C] or [R={num_rows}, C], got {tuple(columns.shape)}"
            )
    k = keys[:, :, None]  # [4, R, 1]
    # One fused kernel on CUDA; the same integer recipe as plain torch ops elsewhere.
    bits52 = _bits52_cuda(k[0], k[1], k[2], k[3], cols) if cols.is_cuda else _bits52_torch(k, cols)
    return (bits52.to(torch.float64) + 0.5) * _TWO_POW_MINUS_52


def _bits52_torch(k: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """int64 [R, C] in [0, 2**52): two output lanes, each a two-round keyed hash of the column.

    k: int64 [4, R, 1] key words; cols: int64 [R or 1, C]. Lane 0 (key words 0, 1) gives the
    high 32 bits, lane 1 (key words 2, 3) the low 20.
    """
    spread = (cols * _COLUMN_STEP) & _MASK32
    x = spread ^ k[0::2]  # [2, R, C]
    x = _mix32(x)
    x ^= k[1::2]
    x = _mix32(x)
    return (x[0] << 20) | (x[1] >> 12)


def _mix32_cuda_source(var: str) -> str:
    return (
        f"{var} ^= {var} >> 16; {var} = ({var} * {_MUL_A}ull) & {_MASK32}ull; "
        f"{var} ^= {var} >> 15; {var} = ({var} * {_MUL_B}ull) & {_MASK32}ull; "
        f"{var} ^= {var} >> 15;"
    )


# The same recipe as _bits52_torch, in unsigned 64-bit CUDA arithmetic (values stay < 2**63,
# so signed and unsigned give the same bits): statements over the jiterator arguments k0..k3 and
# col that leave the two mixed 32-bit words in `hi` and `lo`; the 52 bits are
# (hi << 20) | (lo >> 12). Shared by counter_bits52 here and the fused Gumbel score.
BITS52_CUDA_STATEMENTS = f"""
    unsigned long long spread = ((unsigned long long)col * {_COLUMN_STEP}ull) & {_MASK32}ull;
    unsigned long long hi = spread ^ (unsigned long long)k0;
    unsigned long long lo = spread ^ (unsigned long long)k2;
    {_mix32_cuda_source("hi")} {_mix32_cuda_source("lo")}
    hi ^= (unsigned long long)k1;
    lo ^= (unsigned long long)k3;
    {_mix32_cuda_source("hi")} {_mix32_cuda_source("lo")}
"""
_BITS52_CUDA_SOURCE = f"""
template <typename T> T counter_bits52(T k0, T k1, T k2, T k3, T col) {{{BITS52_CUDA_STATEMENTS}
    return (T)((hi << 20) | (lo >> 12));
}}
"""
# Lazily built fused kernel (a cache, not state: its output equals _bits52_torch's).
_cuda_kernel: dict[str, object] = {}


def _bits52_cuda(k0, k1, k2, k3, cols: torch.Tensor) -> torch.Tensor:
    fn = _cuda_kernel.get("fn")
    if fn is None and "failed" not in _cuda_kernel:
        try:
            from torch.cuda import jiterator

            fn = jiterator._create_jit_fn(_BITS52_CUDA_SOURCE)
            # Compile and check once against the torch ops before trusting it.
            probe_k = torch.tensor([[1], [2], [3], [4]], dtype=torch.int64, device=cols.device)
            probe_c = torch.arange(0, 1 << 31, 1 << 20, dtype=torch.int64, device=cols.device)
            got = fn(probe_k[0], probe_k[1], probe_k[2], probe_k[3], probe_c[None])
            want = _bits52_torch(probe_k[:, :, None], probe_c[None])
            if not torch.equal(got, want):
                raise RuntimeError("jiterator counter_bits52 disagrees with the torch ops")
            _cuda_kernel["fn"] = fn
        except Exception as e:  # any failure to build: use the plain torch ops, say so once
            warnings.warn(
                f"deepinfer_sampling: fused CUDA RNG kernel unavailable ({e!r}); using torch ops",
                stacklevel=3,
            )
            _cuda_kernel["failed"] = True
            fn = None
    if fn is None:
        return _bits52_torch(torch.stack((k0, k1, k2, k3)), cols)
    return fn(k0, k1, k2, k3, cols)


def counter_uniform(
    seeds: torch.Tensor,
    positions: torch.Tensor,
    columns: int | torch.Tensor,
    stream: int = 0,
) -> torch.Tensor:
    """Uniforms in the open interval (0, 1), a pure function of (seed, position, column, stream).

    Bit-identical on CPU and CUDA, independent of batch order and size.

    Args:
        seeds: LongTensor [R], each in [0, 2**63).
        positions: LongTensor [R], each in [0, 2**63): index of the decided token in the sequence.
        columns: int C (columns 0..C-1), LongTensor [C], or LongTensor [R, C]; values in [0, 2**31).
        stream: which independent family of draws (see the module docstring for reserved ones).
    Returns:
        float64 Tensor [R, C] on the device of `seeds`.
    """
    return uniform_from_keys(row_keys(seeds, positions, stream), columns)
