# Needs the build of instrumentation.patch (see README.md here); not part of the library.
import statistics, time, sys, torch
from zero_lifetime import ops
import zero_lifetime._C as _C
dtype = getattr(torch, sys.argv[1] if len(sys.argv) > 1 else "bfloat16")
n, numel = 8192, 1024
offsets = [i * numel for i in range(n)]
buffer = torch.empty(n * numel)
ones = [torch.randn(1).to(dtype) for _ in range(n)]
sources = [torch.randn(numel).to(dtype) for _ in range(n)]
flat = torch.randn(n * numel).to(dtype)
res = {(k, v): [] for k in ("host cold", "fill after roofline", "roofline") for v in (False, True)}
for r in range(40):
    for v in (False, True):
        _C._set_staged(v)
        buffer.copy_(flat)  # like the bench: roofline right before
        s = time.perf_counter(); ops.bucket_fill(buffer, ones, offsets); res[("host cold", v)].append(time.perf_counter() - s)
        s = time.perf_counter(); buffer.copy_(flat); res[("roofline", v)].append(time.perf_counter() - s)
        s = time.perf_counter(); ops.bucket_fill(buffer, sources, offsets); res[("fill after roofline", v)].append(time.perf_counter() - s)
for k, v in res.items():
    print(f"{k[0]:22s} staged={k[1]!s:5s} median {statistics.median(v)*1e3:.3f} ms")
