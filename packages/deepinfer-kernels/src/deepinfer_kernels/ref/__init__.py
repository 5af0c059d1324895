"""The `ref` tier: pure torch (CPU and CUDA). It defines every op's numerics; GPU tiers are tested
against it. One module per topic, named like `ops/<topic>.py`."""
