"""Environment for a one-process DeepSpeed run on the CPU (demo, benchmarks, tests)."""

import os
import socket


def free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def single_rank_env() -> None:
    """Rank 0 of 1 over gloo on the CPU accelerator, unless the caller already set otherwise."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"),
                       ("LOCAL_SIZE", "1")):
        os.environ.setdefault(key, value)
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = free_port()
