"""Tensor-count x elements sweeps: from many small tensors to few large ones (8M elements each; 16 x 1M is 16M, as in the earlier kernels tables)."""

SWEEP = [(8192, 1024), (2000, 4096), (512, 16384), (128, 65536), (16, 1 << 20), (2, 1 << 22)]
QUICK = [(256, 1024), (16, 16384)]  # CI and the demo: well under a second per case


def shapes(quick: bool):
    return QUICK if quick else SWEEP
