"""Test-session setup for deepinfer-model: one torch thread.

The tiny model's ops are a few microseconds of math each; on a small shared CI box torch's
intra-op thread pool costs far more than it saves (measured 16x slower with 2 cores busy).
"""

import torch

torch.set_num_threads(1)
