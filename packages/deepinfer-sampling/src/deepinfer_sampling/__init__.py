"""deepinfer_sampling."""
