# Needs the build of instrumentation.patch (see README.md here); not part of the library.
import statistics, time, sys, torch
from zero_lifetime import ops
import zero_lifetime._C as _C
dtype = getattr(torch, sys.argv[1] if len(sys.argv) > 1 else "bfloat16")
n, numel = 8192, 1024
offsets = [i * numel for i in range(n)]
buffer = torch.empty(n * numel)
sources = [torch.randn(numel).to(dtype) for _ in range(n)]
flat = torch.randn(n * numel).to(dtype)
names = ["tuple", "describe", "offsets", "check", "plan", "run", "after"]
res = {k: [] for k in ("roofline", "one total", "one run", "many total", "many run", "many host")}
for r in range(30):
    s = time.perf_counter(); buffer.copy_(flat); res["roofline"].append(time.perf_counter() - s)
    _C._phases(); s = time.perf_counter(); ops.bucket_fill(buffer, [flat], [0]); t = time.perf_counter() - s
    ph = _C._phases(); res["one total"].append(t); res["one run"].append(ph[5])
    buffer.copy_(flat)
    _C._phases(); s = time.perf_counter(); ops.bucket_fill(buffer, sources, offsets); t = time.perf_counter() - s
    ph = _C._phases(); res["many total"].append(t); res["many run"].append(ph[5]); res["many host"].append(t - ph[5])
roof = statistics.median(res["roofline"])
for k, v in res.items():
    m = statistics.median(v); print(f"{k:12s} {m*1e6:7.0f} us  {m/roof:5.2f}x roofline")
