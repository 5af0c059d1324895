"""The triton top-k path (topk_triton.py) draws the same tokens as the torch path.

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

PROBE = """
import torch
from deepinfer_sampling.sampler import _check_topk_draw
from deepinfer_sampling.topk_triton import topk_draw
_check_topk_draw(topk_draw, torch.device("cpu"), chunk=256, vocabs=(300,))
"""


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA runs the compiled kernels instead")
def test_interpreted_kernels_match_torch_path():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]


def test_importing_the_package_does_not_import_triton():
    code = "import sys, deepinfer_sampling; assert 'triton' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_cuda_uses_checked_triton_kernels():
    from deepinfer_sampling.topk_triton import topk_draw

    device = torch.device("cuda")
    sampler_module._check_topk_draw(topk_draw, device, chunk=256, vocabs=(2000, 300))
    sampler_module._check_topk_draw(topk_draw, device)
    assert sampler_module._triton_topk_draw(device) is topk_draw
