"""What the ZeRO-1/2 bucket order check costs per backward: 2 ranks over gloo.

    python benchmarks/bucket_order_check_cost.py [N ...]    (params in the layouts; default 300 2000 8192)

Times ``BucketOrderCheck.check`` (the fingerprint, the 16-byte all-reduce, reading it back) on
layouts of N params in one bucket, 300 calls per size, one thread per rank; and the
fingerprint's hash alone. Rank 0 prints medians.
"""

import datetime
import os
import random
import statistics
import sys
import time


def _rank(rank, port, n, calls=300):
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    from zero_lifetime.bucket_order_check import BucketOrderCheck

    entries = tuple((0, k, k) for k in range(n))  # (group, index in group, param id), as DeepSpeed's

    class Buckets:  # the adapter's surface the check uses, over a fixed layout
        def data_parallel_group(self):
            return None

        def data_parallel_world_size(self):
            return dist.get_world_size()

        def param_names(self, named_params):
            return {}

        def layouts(self, dtypes):
            return [("torch.float32", entries)]

        def collective_device(self):
            return "cpu"

    check = BucketOrderCheck(Buckets(), (), lambda: None)
    whole, hashing = [], []
    for _ in range(calls):
        check.note_reduction([torch.float32])
        start = time.perf_counter()
        check.check()
        whole.append(time.perf_counter() - start)
        start = time.perf_counter()
        hash(tuple(entries))
        hashing.append(time.perf_counter() - start)
    if rank == 0:
        print(f"{n:6d} params: check per backward {statistics.median(whole) * 1e6:6.0f} us "
              f"(hashing the layout alone {statistics.median(hashing) * 1e6:5.1f} us)", flush=True)
    dist.destroy_process_group()
    # A spawned rank ends in sys.exit and finalizes, where torch 117762 can abort it.
    from zero_lifetime.single_rank import exit_without_finalizing
    exit_without_finalizing()


def main():
    import torch.multiprocessing as mp
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for n in [int(a) for a in sys.argv[1:]] or [300, 2000, 8192]:
        mp.spawn(_rank, args=(random.randint(20000, 40000), n), nprocs=2)


if __name__ == "__main__":
    main()
