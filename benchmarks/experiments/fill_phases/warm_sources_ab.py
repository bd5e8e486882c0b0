# Needs the build of warm_sources.patch (see README.md here); not part of the library.
# python warm_sources_ab.py DTYPE TENSORS ELEMENTS MODES [ROUNDS]: per round and mode, a
# roofline copy_ (which also evicts the sources) then the fused fill; fill / roofline medians
# and interquartile ranges. Mode 0: the library as it is; 1-3: see the patch.
import statistics, time, sys, torch
from zero_lifetime import ops
import zero_lifetime._C as _C
dtype = getattr(torch, sys.argv[1])
n, numel = int(sys.argv[2]), int(sys.argv[3])
modes = [int(v) for v in sys.argv[4].split(",")]
rounds = int(sys.argv[5]) if len(sys.argv) > 5 else 40
grads = [torch.randn(numel).to(dtype) for _ in range(n)]
offsets = [i * numel for i in range(n)]
buffer = torch.empty(n * numel)
flat = torch.randn(n * numel).to(dtype)
res = {m: [] for m in modes}; roof = []
for r in range(rounds):
    for m in modes:
        _C._set_warm(m)
        s = time.perf_counter(); buffer.copy_(flat); roof.append(time.perf_counter() - s)
        s = time.perf_counter(); ops.bucket_fill(buffer, grads, offsets); res[m].append(time.perf_counter() - s)
_C._set_warm(0)
R = statistics.median(roof)
print(f"{dtype} {n}x{numel} roofline {R*1e6:.0f} us", end="  ")
for m in modes:
    q = statistics.quantiles([x / R for x in res[m]], n=4)
    print(f"mode{m}: {statistics.median(res[m])/R:.3f}x [{q[0]:.2f}-{q[2]:.2f}]", end="  ")
print()
