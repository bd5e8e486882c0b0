"""Tensor-count x elements sweeps: from many small tensors to few large ones (8M elements each; 16 x 1M is 16M, as in the earlier kernels tables)."""

SWEEP = [(8192, 1024), (2000, 4096), (512, 16384), (128, 65536), (16, 1 << 20), (2, 1 << 22)]
QUICK = [(256, 1024), (16, 16384)]  # CI and the demo: well under a second per case


def shapes(quick: bool):
    return QUICK if quick else SWEEP
LARGE_GPU = [(16, 1 << 22)]  # 64M elements, 256 MB of fp32: the >= 64 MB GPU target on more than one size


def kernel_shapes(quick: bool, device: str):
    """The kernel-level sweep: on CUDA (full runs) also a size well above 64 MB."""
    return shapes(quick) + (LARGE_GPU if device == "cuda" and not quick else [])
