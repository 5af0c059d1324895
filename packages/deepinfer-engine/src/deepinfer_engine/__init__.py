"""deepinfer_engine."""
