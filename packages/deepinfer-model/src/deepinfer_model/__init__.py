"""deepinfer_model."""
