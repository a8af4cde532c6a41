"""Pallas kernels (Triton on GPU, interpret mode on CPU). Each module exports `op`, `op_reference` and one shared
input validation; this package imports jax only."""
