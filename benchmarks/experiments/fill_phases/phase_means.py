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
for mode in ("warm", "after roofline", "warm", "after roofline"):
    for v in (False, True):
        _C._set_staged(v)
        _C._phases()
        tot = 0
        for _ in range(60):
            if mode != "warm": buffer.copy_(flat)
            s = time.perf_counter(); ops.bucket_fill(buffer, sources, offsets); tot += time.perf_counter() - s
        ph = _C._phases(); k = ph[7]
        print(f"{mode:15s} staged={v!s:5s} total {tot/60*1e6:7.0f} us | " + " ".join(f"{nm} {x/k*1e6:6.0f}" for nm, x in zip(names, ph)))
