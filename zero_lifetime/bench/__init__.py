"""Benchmarks of zero_lifetime (run as modules, e.g. ``python -m zero_lifetime.bench.kernels``)."""
