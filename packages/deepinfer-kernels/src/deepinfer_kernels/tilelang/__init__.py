"""The `tilelang` tier (NVIDIA Hopper). Modules here import tilelang only inside the functions that
build or launch a kernel, so importing them (the registry does, to run a `supports` check) never
imports tilelang; nothing else in the package imports this subpackage."""
