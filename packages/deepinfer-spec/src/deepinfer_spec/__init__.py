"""deepinfer_spec."""
