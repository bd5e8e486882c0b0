"""Environment for a one-process DeepSpeed run on the CPU (demo, benchmarks, tests)."""

import atexit
import glob
import os
import socket
import sys

MASTER_ADDR = "127.0.0.1"
_ports_chosen = []  # every port free_port() handed out in this process


def exit_without_finalizing() -> None:
    """End a rank's process, its work written, without finalizing the interpreter.

    Finalizing is where torch issue 117762 strikes a gloo rank: a gloo worker thread that drops
    a tensor's last reference needs the GIL, CPython ends such a thread with a forced unwind,
    and C++ turns that into std::terminate (SIGABRT, exit -6) after the work is done. A rank
    spawned by multiprocessing ends in ``sys.exit`` and finalizes too (docs/reliability.md).
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def free_port() -> str:
    with socket.socket() as s:
        s.bind((MASTER_ADDR, 0))
        port = str(s.getsockname()[1])
    _ports_chosen.append(port)
    return port


def ports_chosen() -> list:
    """The ports free_port() chose in this process, oldest first: the runs this process started
    itself, whose /dev/shm buffers it removes (a caller can check that none is left)."""
    return list(_ports_chosen)


def shm_buffer_paths(port: str, addr: str = MASTER_ADDR) -> list:
    """DeepSpeed's CPU all-reduce files for one run: ``<uid>_<addr>_<port>_<rank>``, one per rank
    (``"*"`` for port and addr: every run of this user)."""
    return glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{addr}_{port}_*")


def remove_shm_buffers(port: str, addr: str = MASTER_ADDR) -> None:
    """Unlink the 66 MB ``/dev/shm`` buffer of every rank of the run on ``addr:port``.

    DeepSpeed's CPU communication (csrc/cpu/comm/shm.cpp) creates one per rank and never
    unlinks it, so each run leaks RAM until reboot. Call this only when every rank of that
    run is done: a rank still starting up would not find its peers' files.
    """
    for path in shm_buffer_paths(port, addr):
        try:
            os.remove(path)
        except FileNotFoundError:  # a concurrent cleanup of the same run got there first
            pass


def single_rank_env() -> None:
    """Rank 0 of 1 over gloo on the CPU accelerator, unless the caller already set otherwise.

    When this picks the port, the run is ours alone: its shared-memory buffer goes at exit.
    """
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    for key, value in (("MASTER_ADDR", MASTER_ADDR), ("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"),
                       ("LOCAL_SIZE", "1")):
        os.environ.setdefault(key, value)
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = free_port()
        atexit.register(remove_shm_buffers, os.environ["MASTER_PORT"], os.environ["MASTER_ADDR"])
