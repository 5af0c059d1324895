"""The triton top-k path (topk_triton.py) selects the exact top-k and draws the torch path's tokens.

On CPU it runs under the triton interpreter in a subprocess (TRITON_INTERPRET is read when the
kernels are defined); on CUDA it runs compiled, and the Sampler must actually use it.
"""

import importlib.util
import os
import subprocess
import sys

import pytest
import torch
from deepinfer_sampling import sampler as sampler_module

HAS_TRITON = importlib.util.find_spec("triton") is not None

# The K candidates of a row, checked against a plain-Python sort: ids by (logit descending, id
# ascending), as many padding slots as K exceeds the vocabulary. Heavy ties (few distinct
# logits, many -inf, whole -inf rows), k from 1 to MAX_K, vocabularies that are not a multiple
# of the chunk, several chunk and group widths.
KEYS_CHECK = """
import math
import struct

import torch
from hypothesis import given, settings, strategies as st

from deepinfer_sampling.topk_triton import MAX_K, topk_keys

INT64_MIN = -(2**63)


def expected_ids(row, k):
    order = sorted(range(len(row)), key=lambda i: (-row[i], i))
    return order[:k] + [None] * (k - len(order))


def decode(key):
    # key = int32 order key << 32 | (2**32 - 1 - id): back to (float32 value, id).
    high, low = key >> 32, key & 0xFFFFFFFF
    bits = high ^ 0x7FFFFFFF if high < 0 else high
    return struct.unpack("<f", struct.pack("<i", bits))[0], 2**32 - 1 - low


def check(x, max_top_k, chunk, group):
    got = topk_keys(x, max_top_k, chunk=chunk, group=group).tolist()
    k = max(16, 1 << (max_top_k - 1).bit_length())
    assert all(len(r) == k for r in got), (len(got[0]), k)
    for r, keys in enumerate(got):
        row = x[r].tolist()
        for slot, (key, want) in enumerate(zip(keys, expected_ids(row, k))):
            if want is None:
                assert key == INT64_MIN, (r, slot, key)
            else:
                value, token = decode(key)
                assert token == want and value == row[want], (r, slot, token, want, value)


@st.composite
def cases(draw):
    max_top_k = draw(st.sampled_from([1, 2, 16, 17, 50, 64, 100, MAX_K]))
    k = max(16, 1 << (max_top_k - 1).bit_length())
    vocab = draw(st.integers(1, 700))
    chunk = draw(st.sampled_from([c for c in (16, 32, 64, 128, 256, 512) if c >= k]))
    # k * group <= 1024 (not MAX_STAGE2_KEYS): the interpreter sorts slowly.
    groups = [g for g in (1, 2, 4, 8, 16, 32) if g <= chunk and g * k <= 1024]
    group = draw(st.sampled_from(groups))
    rows = draw(st.integers(1, 2))
    levels = draw(st.integers(1, 6))
    neg_inf = draw(st.sampled_from([0.0, 0.5, 0.98, 1.0]))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    # Few distinct values (ties everywhere), a fraction -inf.
    x = torch.randint(0, levels, (rows, vocab), generator=g).float() * 0.75 - 1.0
    x[torch.rand(rows, vocab, generator=g) < neg_inf] = -math.inf
    if draw(st.booleans()):  # distinct values on one row
        x[0] = torch.randperm(vocab, generator=g).float() / 7.0 - 20.0
    return x, max_top_k, chunk, group


@settings(max_examples=20, deadline=None, derandomize=True)
@given(cases())
def prop(case):
    check(*case)


prop()
# Default knobs (one 4096-token chunk) on a row of one repeated value and k = 1; MAX_K.
check(torch.full((1, 600), 0.25), 1, None, None)
check(torch.randn(1, 300, generator=torch.Generator().manual_seed(4)), MAX_K, 256, 4)
"""

DRAW_CHECK = """
import torch
from deepinfer_sampling.sampler import _check_topk_draw
from deepinfer_sampling.topk_triton import topk_draw
_check_topk_draw(topk_draw, torch.device("cpu"), chunk=256, vocabs=(300,))
"""


def _interpret(code: str) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA runs the compiled kernels instead")
def test_interpreted_topk_keys_are_the_exact_topk():
    _interpret(KEYS_CHECK)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA runs the compiled kernels instead")
def test_interpreted_kernels_match_torch_path():
    _interpret(DRAW_CHECK)


def test_importing_the_package_does_not_import_triton():
    code = "import sys, deepinfer_sampling; assert 'triton' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_bad_knobs_raise_value_error_naming_them():
    from deepinfer_sampling.topk_triton import topk_keys

    x = torch.zeros(1, 100)
    with pytest.raises(ValueError, match="max_top_k"):
        topk_keys(x, 0)
    with pytest.raises(ValueError, match="chunk"):
        topk_keys(x, 64, chunk=32)
    with pytest.raises(ValueError, match="group"):
        topk_keys(x, 256, chunk=256, group=32)
    with pytest.raises(ValueError, match="x must be float32"):
        topk_keys(x.double(), 16)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
@pytest.mark.parametrize("max_top_k", [1, 256])  # few: each k compiles both kernels
def test_cuda_topk_keys_are_the_exact_topk(max_top_k):
    from deepinfer_sampling.topk_triton import topk_keys

    g = torch.Generator().manual_seed(max_top_k)
    for vocab in (129280, 1008):  # both multiples of 16: one kernel specialisation
        # Ties everywhere (8 distinct values), a third -inf, one row all -inf, one all distinct.
        x = torch.randint(0, 8, (4, vocab), generator=g).float() - 3.0
        x[torch.rand(4, vocab, generator=g) < 0.3] = float("-inf")
        x[1] = float("-inf")
        x[2] = torch.randperm(vocab, generator=g).float()
        k = max(16, 1 << (max_top_k - 1).bit_length())
        keys = topk_keys(x.cuda(), max_top_k).cpu()
        ids = 2**32 - 1 - (keys & 0xFFFFFFFF)
        # Stable descending sort: equal logits keep ascending token ids.
        want = torch.sort(x, dim=1, descending=True, stable=True).indices[:, :k]
        assert torch.equal(ids, want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_cuda_uses_checked_triton_kernels():
    from deepinfer_sampling.topk_triton import topk_draw

    device = torch.device("cuda")
    sampler_module._check_topk_draw(topk_draw, device, chunk=256, vocabs=(2000, 300))
    sampler_module._check_topk_draw(topk_draw, device)
    assert sampler_module._triton_topk_draw(device) is topk_draw
