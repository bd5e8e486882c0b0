"""From which segment size the CUDA ``cudaMemcpyAsync`` route beats the fused kernel, read
from a ``benchmarks/profile_ops.py --device cuda --json`` run.

    python -m zero_lifetime.bench.memcpy_route PROFILE.json

Prints each case that ran both ways (to stderr) and then, alone on stdout, the smallest
segment size in bytes from which the route won in every case, or ``never``: the value for
``ops.set_cuda_memcpy_segment_bytes`` and ``bench --cuda-memcpy-segment-bytes``. A case counts
as won when the route took less device time and no more synced wall time than the kernel
("memcpy" against "direct"). A GPU session's one device call uses it to run the bench a
second time with the route on (``scripts/gpu_check.sh route``), so that both answers come back
from the same machine.
"""

from __future__ import annotations

import json
import sys
from typing import Dict, List, Optional, Tuple

NEVER = "never"


def comparisons(rows: List[dict]) -> List[Tuple[str, int, dict, dict]]:
    """(case, its smallest segment's bytes, the "direct" row, the "memcpy" row) for every case
    that ran both ways, smallest segments first."""
    by_case: Dict[str, Dict[str, dict]] = {}
    for row in rows:
        by_case.setdefault(row["case"], {})[row["way"]] = row
    pairs = [(case, ways["direct"]["segment_bytes"], ways["direct"], ways["memcpy"])
             for case, ways in by_case.items() if "direct" in ways and "memcpy" in ways]
    return sorted(pairs, key=lambda pair: pair[1])


def route_wins(direct: dict, memcpy: dict) -> bool:
    return memcpy["kernel_s"] < direct["kernel_s"] and memcpy["wall_s"] <= direct["wall_s"]


def threshold(rows: List[dict]) -> Optional[int]:
    """The smallest segment bytes from which the route won every case at or above it; None when
    it lost the case with the largest segments, or no case ran both ways."""
    return _threshold_of(comparisons(rows))


def _threshold_of(pairs) -> Optional[int]:
    found = None
    for _, segment_bytes, direct, memcpy in reversed(pairs):
        if not route_wins(direct, memcpy):
            break
        found = segment_bytes
    return found


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        rows = json.load(f)["rows"]
    pairs = comparisons(rows)
    if not pairs:
        print(f"{argv[0]}: no case ran both the kernel and the memcpy route (a CUDA run of profile_ops.py has them)",
              file=sys.stderr)
    for case, segment_bytes, direct, memcpy in pairs:
        verdict = "route wins" if route_wins(direct, memcpy) else "kernel wins"
        print(f"{case:<30} segments of {segment_bytes:>10} B: kernel {direct['kernel_s'] * 1e6:8.1f} us device, "
              f"{direct['wall_s'] * 1e6:8.1f} us wall; route {memcpy['kernel_s'] * 1e6:8.1f} / "
              f"{memcpy['wall_s'] * 1e6:8.1f} us: {verdict}", file=sys.stderr)
    found = _threshold_of(pairs)
    print(NEVER if found is None else found)
    return 0


if __name__ == "__main__":
    sys.exit(main())
