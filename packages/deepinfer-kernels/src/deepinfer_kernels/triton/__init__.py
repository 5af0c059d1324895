"""The `triton` tier (NVIDIA). Modules here import triton at import time, so only the registry
imports them, on the first call that selects this tier; nothing else in the package does."""
