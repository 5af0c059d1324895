"""The `vendor` tier: adapters to DeepSeek's kernel libraries, imported only when an op chooses
them (the registry checks that the library is importable without importing it)."""
