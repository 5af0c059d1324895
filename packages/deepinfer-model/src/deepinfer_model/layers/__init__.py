"""The V4.1 layers, one concept per module (shapes in each module's docstrings)."""
