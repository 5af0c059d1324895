"""The public op functions. Each topic module declares its ops and registers their tiers.

Call these (never a tier directly): ``from deepinfer_kernels import ops; ops.rms_norm(x, w, eps)``.
"""
