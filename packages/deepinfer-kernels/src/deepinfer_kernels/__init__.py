"""deepinfer_kernels: an op registry with torch reference ops and GPU ops in tiers.

``from deepinfer_kernels import ops`` gives the op functions; ``python -m deepinfer_kernels``
prints which implementation each op resolves to on this machine.
"""

from . import ops
from .registry import REGISTRY, Implementation, OpRegistry
from .settings import TIERS, KernelSettings

__all__ = ["REGISTRY", "TIERS", "Implementation", "KernelSettings", "OpRegistry", "ops"]
