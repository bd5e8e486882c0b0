# Needs the build of instrumentation.patch (see README.md here); not part of the library.
# Is the 8192 x 1K bf16 fill's extra time in reading scattered sources, or per source whatever
# the layout? Interleaved, 30 rounds: the roofline copy_, one source, 8192 separately made
# sources (scattered between the fp32 temporaries they came from), 8192 views of one tensor
# (sequential memory), 8192 tensors allocated back to back. Prints total and copy ("run" phase).
import statistics, time, torch
from zero_lifetime import ops
import zero_lifetime._C as _C
dtype = torch.bfloat16
n, numel = 8192, 1024
offsets = [i * numel for i in range(n)]
buffer = torch.empty(n * numel)
scattered = [torch.randn(numel).to(dtype) for _ in range(n)]
flat = torch.randn(n * numel).to(dtype)
contiguous_views = list(flat.split(numel))
packed = [torch.empty(numel, dtype=dtype) for _ in range(n)]
for p, s in zip(packed, scattered):
    p.copy_(s)
cases = (("roofline", None), ("one", [flat]), ("scattered", scattered),
         ("contiguous_views", contiguous_views), ("packed", packed))
total = {k: [] for k, _ in cases}
copy = {k: [] for k, _ in cases}
for r in range(30):
    for k, sources in cases:
        s = time.perf_counter()
        if sources is None:
            buffer.copy_(flat)
        else:
            _C._phases()
            ops.bucket_fill(buffer, sources, [0] if len(sources) == 1 else offsets)
        total[k].append(time.perf_counter() - s)
        if sources is not None:
            copy[k].append(_C._phases()[5])
roof = statistics.median(total["roofline"])
for k, _ in cases:
    t = statistics.median(total[k])
    c = statistics.median(copy[k]) if copy[k] else t
    print(f"{k:17s} total {t * 1e6:6.0f} us {t / roof:5.2f}x   copy {c * 1e6:6.0f} us {c / roof:5.2f}x")
