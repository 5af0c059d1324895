"""Counter-based RNG: exact against a pure-Python reference, pure in its coordinates, uniform."""

import math

import pytest
import torch
from deepinfer_sampling.rng import counter_uniform, row_keys, uniform_from_keys
from hypothesis import given, settings
from hypothesis import strategies as st

M32 = 0xFFFFFFFF


def py_mix32(x: int) -> int:
    # Same mixer written with Python's unbounded ints (the reference the tensor code must match).
    x ^= x >> 16
    x = (x * 0x21F0AAAD) & M32
    x ^= x >> 15
    x = (x * 0x735A2D97) & M32
    x ^= x >> 15
    return x


def py_uniform(seed: int, position: int, column: int, stream: int) -> float:
    init = (0x2545F491, 0x3C6EF372, 0x1B873593, 0x5BE0CD19)
    words = (seed & M32, seed >> 32, position & M32, position >> 32)
    keys = []
    for lane in range(4):
        s = py_mix32(init[lane] ^ stream)
        for w in words:
            s = py_mix32(s ^ w)
            s = py_mix32((s + init[lane]) & M32)
        keys.append(s)
    spread = (column * ((0x6A09E667 >> 1) | 1)) & M32
    hi = py_mix32(py_mix32(keys[0] ^ spread) ^ keys[1])
    lo = py_mix32(py_mix32(keys[2] ^ spread) ^ keys[3])
    return ((hi << 20) | (lo >> 12)) / 2.0**52 + 2.0**-53


seeds_st = st.integers(0, 2**63 - 1)
pos_st = st.integers(0, 2**40)


@settings(max_examples=40, deadline=None)
@given(seed=seeds_st, pos=pos_st, col=st.integers(0, 2**31 - 1), stream=st.integers(0, 2**32 - 1))
def test_matches_python_reference(seed, pos, col, stream):
    u = counter_uniform(torch.tensor([seed]), torch.tensor([pos]), torch.tensor([col]), stream)
    assert u.dtype == torch.float64 and u.shape == (1, 1)
    assert u.item() == py_uniform(seed, pos, col, stream)
    assert 0.0 < u.item() < 1.0


@settings(max_examples=30, deadline=None)
@given(
    rows=st.lists(st.tuples(seeds_st, pos_st), min_size=1, max_size=6),
    perm_seed=st.integers(0, 1000),
)
def test_pure_function_of_coordinates(rows, perm_seed):
    seeds = torch.tensor([s for s, _ in rows])
    pos = torch.tensor([p for _, p in rows])
    full = counter_uniform(seeds, pos, 50)
    # Reordering rows and choosing columns in any order gives the same values per coordinate.
    g = torch.Generator().manual_seed(perm_seed)
    perm = torch.randperm(len(rows), generator=g)
    cols = torch.randperm(50, generator=g)[:17]
    sub = counter_uniform(seeds[perm], pos[perm], cols)
    assert torch.equal(sub, full[perm][:, cols])
    per_row_cols = torch.stack([torch.randperm(50, generator=g)[:9] for _ in rows])
    sub2 = uniform_from_keys(row_keys(seeds, pos), per_row_cols)
    assert torch.equal(sub2, full.gather(1, per_row_cols))


def test_streams_and_positions_differ():
    seeds = torch.tensor([7, 7, 7])
    pos = torch.tensor([3, 4, 3])
    a = counter_uniform(seeds, pos, 1000, stream=0)
    b = counter_uniform(seeds, pos, 1000, stream=1)
    assert not torch.equal(a[0], a[1]) and torch.equal(a[0], a[2])
    assert (a != b).float().mean() > 0.99


def test_uniformity_chi_square_fixed_seeds():
    # 64 rows x 20000 columns, 100 equal bins: chi-square with 99 dof; deterministic inputs.
    u = counter_uniform(torch.arange(64), torch.arange(64) * 3 + 11, 20000)
    counts = torch.histc(u, bins=100, min=0.0, max=1.0)
    expected = u.numel() / 100
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 148.0  # 99.99th percentile of chi2(99) is ~ 148
    # Neighbouring columns and rows are uncorrelated.
    flat_pairs = torch.stack([u[:, :-1].flatten(), u[:, 1:].flatten()])
    assert abs(torch.corrcoef(flat_pairs)[0, 1].item()) < 0.01
    assert abs(torch.corrcoef(u[:2])[0, 1].item()) < 0.03
    # Tail: the smallest value is not suspiciously far from 1/n.
    assert u.min().item() > 0.0 and u.max().item() < 1.0
    assert math.isclose(u.mean().item(), 0.5, abs_tol=0.002)


def test_bad_inputs_name_parameter():
    with pytest.raises(ValueError, match="int64"):
        counter_uniform(torch.tensor([1.0]), torch.tensor([1]), 3)
    with pytest.raises(ValueError, match="stream"):
        counter_uniform(torch.tensor([1]), torch.tensor([1]), 3, stream=-1)
    with pytest.raises(ValueError, match="columns"):
        counter_uniform(
            torch.tensor([1]), torch.tensor([1]), torch.zeros(2, 2, 2, dtype=torch.long)
        )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cpu_and_cuda_bit_identical():
    seeds = torch.tensor([0, 1, 2**62 + 12345, 99])
    pos = torch.tensor([0, 2**33 + 5, 17, 100000])
    cpu = counter_uniform(seeds, pos, 129280, stream=2)
    gpu = counter_uniform(seeds.cuda(), pos.cuda(), 129280, stream=2)
    assert torch.equal(cpu, gpu.cpu())
