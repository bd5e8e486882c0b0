# Needs the build of instrumentation.patch (see README.md here); not part of the library.
import statistics, time, sys, torch
from zero_lifetime import ops
import zero_lifetime._C as _C
_C._set_staged(False)
dtype = getattr(torch, sys.argv[1] if len(sys.argv) > 1 else "bfloat16")
n, numel = 8192, 1024
offsets = [i * numel for i in range(n)]
buffer = torch.empty(n * numel)
sources = [torch.randn(numel).to(dtype) for _ in range(n)]
flat = torch.randn(n * numel).to(dtype)
gaps = [sources[i+1].data_ptr() - sources[i].data_ptr() for i in range(50)]
print("address gaps (first 50):", sorted(set(gaps))[:10])
variants = [int(v) for v in (sys.argv[2] if len(sys.argv) > 2 else "0,4,8,16").split(",")]  # lines to prefetch
res = {v: {"total": [], "run": []} for v in variants}
roof = []
for r in range(40):
    s = time.perf_counter(); buffer.copy_(flat); roof.append(time.perf_counter() - s)
    for v in variants:
        _C._set_prefetch_next(v)
        buffer.copy_(flat)
        _C._phases(); s = time.perf_counter(); ops.bucket_fill(buffer, sources, offsets); t = time.perf_counter() - s
        ph = _C._phases(); res[v]["total"].append(t); res[v]["run"].append(ph[5])
R = statistics.median(roof)
print(f"roofline {R*1e6:.0f} us")
for v in variants:
    print(f"prefetch {v:2d} lines: total {statistics.median(res[v]['total'])/R:.3f}x  run {statistics.median(res[v]['run'])*1e6:.0f} us")
