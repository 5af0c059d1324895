"""Test-session setup for deepinfer-engine: one torch thread.

The tiny models' ops are microseconds each; on a small shared CI box torch's intra-op thread
pool costs far more than it saves (its threads spin while other processes, such as the rank
processes of the multi-rank tests, want the same cores).
"""

import torch

torch.set_num_threads(1)
