"""deepinfer_parallel."""
