"""The command line both fill host-work probes take (fill_host_cost.py, fill_host_cold.py)."""

import argparse

import torch

from zero_lifetime import ops


def parse_fill_args(script: str, description: str, add_more=None):
    """``--tensors``, ``--numel``, ``--dtype`` (and what ``add_more(parser)`` adds); exits
    when the compiled extension is missing, since these probes measure it alone."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--tensors", type=int, default=8192)
    parser.add_argument("--numel", type=int, default=1024)
    if add_more is not None:
        add_more(parser)
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    args = parser.parse_args()
    if not ops.native_available():
        raise SystemExit(f"{script}: the compiled extension is not available (python -m zero_lifetime.env_report)")
    return args, getattr(torch, args.dtype)
