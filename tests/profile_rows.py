"""Rows in the shape of benchmarks/profile_ops.py's JSON (what a GPU run writes), for the tests
of the tools that read it: bench.memcpy_route and gpu_check.sh's route phase."""


def profile_row(case: str, way: str, kernel_us: float, wall_us: float, segment_bytes: int,
                segments: int = 16) -> dict:
    """One way of one case: its device time and synced wall time (microseconds here, seconds
    in the row, as profile_ops records them), and its smallest segment's bytes."""
    return {"case": case, "way": way, "kernel_s": kernel_us * 1e-6, "wall_s": wall_us * 1e-6,
            "segment_bytes": segment_bytes, "segments": segments}
