# Scratch A/B (2026-11-28, dropped): the fused fill (every source described and checked, then
# one copy) against fills that describe each source as they copy it (describe_while_copying.cpp,
# no checks: the best case of giving up "the buffer is untouched when a check fails").
# Usage: python benchmarks/experiments/fill_phases/describe_while_copying_ab.py [N NUMEL]
import os, statistics, sys, time, torch
from torch.utils.cpp_extension import load
from zero_lifetime import ops
ext = load("pipe_fill", [os.path.join(os.path.dirname(os.path.abspath(__file__)), "describe_while_copying.cpp")], extra_cflags=["-O3"], verbose=False)
n, numel = (int(sys.argv[1]), int(sys.argv[2])) if len(sys.argv) > 2 else (8192, 1024)
rounds = 40
sources = [torch.randn(numel).to(torch.bfloat16) for _ in range(n)]
flat = torch.cat(sources)
offsets = [i * numel for i in range(n)]
buffer = torch.empty(n * numel)
evict = torch.empty(64 << 20, dtype=torch.uint8)
ref = flat.float()
def roofline(): buffer.copy_(flat)
def fused(): ops.bucket_fill(buffer, sources, offsets)
def piped(): ext.fill_pipelined(buffer, tuple(sources), offsets, 256)
def piped1k(): ext.fill_pipelined(buffer, tuple(sources), offsets, 1024)
def la(a):
    return lambda: ext.fill_lookahead(buffer, tuple(sources), offsets, 1024, a)
methods = {"lookahead 4": la(4), "lookahead 8": la(8), "lookahead 16": la(16), "roofline": roofline, "fused": fused, "pipelined g256": piped, "pipelined g1024": piped1k}
for f in methods.values():
    buffer.zero_(); f(); assert torch.equal(buffer, ref)
times = {k: [] for k in methods}
for r in range(rounds):
    for k, f in methods.items():
        evict.fill_(r & 0xff)
        s = time.perf_counter(); f(); times[k].append(time.perf_counter() - s)
base = statistics.median(times["roofline"])
for k, v in times.items():
    m = statistics.median(v)
    print(f"{k:18s} {m*1e3:7.3f} ms  {m/base:5.2f}x")
