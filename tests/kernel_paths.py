"""Each code path of the fused copy kernels, run once at small sizes and checked bit for bit
against plain torch: the workload of compute-sanitizer on a GPU.

The pytest suite (op tests, fuzz) is too long to finish under racecheck, initcheck and
synccheck within one device call; this covers the same kernel paths in seconds:

* the inline kernel (up to 64 segments in the launch arguments) and the table kernel (the
  metadata in a device buffer), each also with more chunks than one wave of resident blocks,
  so that a block takes a second chunk in the grid-stride loop (no CUDA op test has an
  inline launch that large);
* whole aligned chunks, a partial chunk's vectors and scalar tail, unaligned destinations
  (after odd-sized segments) and unaligned sources (a storage offset of one element);
* every source/destination dtype pair, the bit copy (same dtype, scale 1) and a scaled cast;
* empty and non-contiguous sources (planned as contiguous copies);
* gather_copy_out with 1, 2 and 3 ranks and padded shards;
* the cudaMemcpyAsync route (ops.set_cuda_memcpy_segment_bytes) for a fill and a gather.

Destinations start as a sentinel, so a gap left unwritten or a write past a range shows, and
initcheck sees no read of uninitialized memory in the comparison.

    python tests/kernel_paths.py --device cuda     # exit status 1 on a mismatch
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable, Iterator, List, Tuple

import torch

KERNEL_CHUNK = 8192  # elements per block work item (kChunk in csrc/ops/copy_kernels.cuh)
INLINE_SEGMENTS = 64  # segments passed in the launch arguments (kInlineSegments)
BLOCKS_PER_SM = 8  # resident blocks of 256 threads per SM (resident_blocks in copy_plan_cuda.cu)
SENTINEL = -7.0
DTYPES = (torch.float32, torch.bfloat16, torch.float16)

Case = Tuple[str, Callable[[], Tuple[torch.Tensor, torch.Tensor]]]


def resident_blocks(device: str) -> int:
    """Blocks of one wave on this device; on the CPU the H100's 132 SMs, for the same sizes."""
    if device.startswith("cuda"):
        return torch.cuda.get_device_properties(torch.device(device)).multi_processor_count * BLOCKS_PER_SM
    return 132 * BLOCKS_PER_SM


def expected_fill(buffer: torch.Tensor, tensors, offsets, scale: float) -> torch.Tensor:
    """What bucket_fill must leave: the old buffer, each range the scaled source in fp32, cast."""
    expected = buffer.clone()
    for t, off in zip(tensors, offsets):
        piece = t.reshape(-1)
        if not (piece.dtype == buffer.dtype and scale == 1.0):
            piece = (piece.float() * scale).to(buffer.dtype)
        expected[off:off + t.numel()] = piece
    return expected


def back_to_back(sizes, gap: int = 0) -> Tuple[List[int], int]:
    offsets, position = [], 0
    for n in sizes:
        offsets.append(position)
        position += n + gap
    return offsets, position


def fill_case(device: str, sources, offsets, numel: int, dst_dtype, scale: float):
    def run():
        from zero_lifetime import ops
        buffer = torch.full((numel,), SENTINEL, dtype=dst_dtype, device=device)
        expected = expected_fill(buffer, sources, offsets, scale)
        ops.bucket_fill(buffer, sources, offsets, scale)
        return buffer, expected
    return run


def randn(n: int, dtype, device: str, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=generator).to(dtype).to(device)


def fill_cases(device: str) -> Iterator[Case]:
    # Sizes at the kernel's chunk boundaries: whole chunks, a partial chunk with a vector
    # body and a scalar tail, less than one vector, empty.
    sizes = [2 * KERNEL_CHUNK, KERNEL_CHUNK + 13, 8, 7, 1, 0]
    for src in DTYPES:
        for dst in DTYPES:
            sources = [randn(n, src, device, seed=i) for i, n in enumerate(sizes)]
            offsets, numel = back_to_back(sizes, gap=8)  # multiples of 8: aligned destinations
            for scale in (1.0, 0.37):
                yield (f"fill inline aligned {_name(src)}->{_name(dst)} scale {scale}",
                       fill_case(device, sources, offsets, numel, dst, scale))
    odd = [KERNEL_CHUNK + 3, 5, 2 * KERNEL_CHUNK + 1, 9]
    sources = [randn(n, torch.bfloat16, device, seed=10 + i) for i, n in enumerate(odd)]
    offsets, numel = back_to_back(odd, gap=1)
    yield "fill inline unaligned destinations", fill_case(device, sources, offsets, numel, torch.float32, 1.0)
    bases = [randn(n + 1, torch.float32, device, seed=20 + i) for i, n in enumerate(sizes)]
    shifted = [base[1:] for base in bases]  # data pointer 4 B past an aligned allocation
    offsets, numel = back_to_back(sizes, gap=8)
    yield "fill inline unaligned sources", fill_case(device, shifted, offsets, numel, torch.float32, 1.0)
    yield "fill inline unaligned sources, cast", fill_case(device, shifted, offsets, numel, torch.bfloat16, 0.5)
    matrix = randn(64 * 48, torch.float32, device, seed=30).view(64, 48)
    strided = [matrix.t(), matrix[::3, 1:40], randn(1, torch.float16, device, seed=31).expand(10)]
    offsets, numel = back_to_back([t.numel() for t in strided], gap=3)
    yield "fill inline non-contiguous sources", fill_case(device, strided, offsets, numel, torch.float16, 0.5)

    count = INLINE_SEGMENTS + 1
    mixed = [randn(sizes[i % len(sizes)] + i % 3, DTYPES[i % 3], device, seed=40 + i) for i in range(count)]
    offsets, numel = back_to_back([t.numel() for t in mixed], gap=1)
    yield "fill table mixed dtypes, 65 segments", fill_case(device, mixed, offsets, numel, torch.float32, 1.5)

    # More chunks than resident blocks: the grid-stride loop's second turn.
    waves = resident_blocks(device) + 3
    big = [randn(waves * KERNEL_CHUNK + 5, torch.float32, device, seed=50)]
    yield "fill inline grid-stride", fill_case(device, big, [0], big[0].numel(), torch.float32, 1.0)
    per_segment = -(-waves // count) * KERNEL_CHUNK
    many = [randn(per_segment + i, DTYPES[i % 2], device, seed=60 + i) for i in range(count)]
    offsets, numel = back_to_back([t.numel() for t in many], gap=1)
    yield "fill table grid-stride", fill_case(device, many, offsets, numel, torch.bfloat16, 0.25)


def expected_unshard(gathered, shard_numels, numels, world_size, out):
    """DeepSpeed's AllGatherCoalescedHandle.wait: one torch.cat of the shards per param."""
    segment, offset, position = sum(shard_numels), 0, 0
    expected = out.clone()
    for shard, n in zip(shard_numels, numels):
        pieces = [gathered[r * segment + offset:r * segment + offset + shard] for r in range(world_size)]
        expected[position:position + n] = torch.cat(pieces)[:n].to(out.dtype)
        offset += shard
        position += n
    return expected


def gather_case(device: str, world_size: int, numels, src, dst, seed: int):
    def run():
        from zero_lifetime import ops
        shard_numels = [-(-n // world_size) + (i % 2) for i, n in enumerate(numels)]  # some padded
        gathered = randn(world_size * sum(shard_numels), src, device, seed)
        out = torch.full((sum(numels),), SENTINEL, dtype=dst, device=device)
        expected = expected_unshard(gathered, shard_numels, numels, world_size, out)
        ops.gather_copy_out(gathered, out, shard_numels, numels, world_size)
        return out, expected
    return run


def gather_cases(device: str) -> Iterator[Case]:
    numels = [3 * KERNEL_CHUNK + 5, 1, 0, 1001, 2 * KERNEL_CHUNK]
    for world_size in (1, 2, 3):
        for src, dst in ((torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                         (torch.float16, torch.float32)):
            yield (f"gather inline world {world_size} {_name(src)}->{_name(dst)}",
                   gather_case(device, world_size, numels, src, dst, seed=70 + world_size))
    many = [(i * 37) % 3000 + 1 for i in range(40)]  # 40 params x 2 ranks: 80 segments
    yield "gather table world 2", gather_case(device, 2, many, torch.float32, torch.float32, seed=80)


def with_memcpy_route(run):
    """``run`` with the memcpy route forced (CPU copies ignore the setting)."""
    def forced():
        from zero_lifetime import ops
        with ops.cuda_memcpy_route():
            return run()
    return forced


def memcpy_route_cases(device: str) -> Iterator[Case]:
    sizes = [2 * KERNEL_CHUNK, KERNEL_CHUNK + 13, 7, 1]
    bases = [randn(n + 1, torch.float32, device, seed=90 + i) for i, n in enumerate(sizes)]
    shifted = [base[1:] for base in bases]  # unaligned sources, odd offsets below
    offsets, numel = back_to_back(sizes, gap=1)
    yield ("fill memcpy route, unaligned",
           with_memcpy_route(fill_case(device, shifted, offsets, numel, torch.float32, 1.0)))
    yield ("gather memcpy route world 2 bfloat16",
           with_memcpy_route(gather_case(device, 2, [3 * KERNEL_CHUNK + 5, 1, 1001], torch.bfloat16,
                                         torch.bfloat16, seed=95)))


def cases(device: str) -> Iterator[Case]:
    yield from fill_cases(device)
    yield from gather_cases(device)
    yield from memcpy_route_cases(device)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def check_all(device: str) -> List[Tuple[str, bool]]:
    """Each case's name and whether its result equals torch's, bit for bit."""
    results = []
    for name, run in cases(device):
        actual, expected = run()
        results.append((name, actual.dtype == expected.dtype and torch.equal(actual.cpu(), expected.cpu())))
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    from zero_lifetime import ops
    if not ops.native_available():
        print("the compiled extension is unavailable: no kernel would run")
        return 2
    results = check_all(args.device)
    for name, same in results:
        print(f"{'ok  ' if same else 'FAIL'} {name}")
    failed = sum(not same for _, same in results)
    print(f"{len(results) - failed}/{len(results)} kernel paths match torch on {args.device}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
