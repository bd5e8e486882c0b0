"""Engines fed engines, installed, against torch over every combination (a check wider than the
kept tests, not run in CI): stages 1-3, each backward path, one or two retained backwards, GAS 1
or 2, zero_grad() between the backwards or not; the second loss also reads the encoder's output.
Then encoder and head on different stages. Prints OK/BAD per run and the count of BAD ones.

    DS_ACCELERATOR=cpu python3 -m benchmarks.experiments.chained_engines_matrix
"""
import copy
import itertools
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tests"))
import conftest  # noqa: E402,F401  (one gloo rank on the CPU, as the tests run)
import torch  # noqa: E402

import test_chained_engines as t  # noqa: E402
from harness import backward_by, full_weights, released_state  # noqa: E402

def run(stage, path, backwards, gas, zero_grad, head_stage=None):
    encoder, head = t._encoder_and_head()
    refs = copy.deepcopy(encoder), copy.deepcopy(head)
    engines = [t._engine(encoder, stage, gas, True), t._engine(head, head_stage or stage, gas, True)]
    opt = torch.optim.SGD([p for r in refs for p in r.parameters()], lr=t.LR)
    for m in range(2 * gas):
        x = t._batch(m)
        def losses(E, H):
            f = E(x); o = H(f)
            return o.pow(2).mean(), (o * 0.3 + f.sum(-1, keepdim=True) * 0.1).mean()
        l1, l2 = losses(*engines)
        if backwards == 1:
            backward_by(engines[1], l1, path)
        else:
            backward_by(engines[1], l1, path, retain_graph=True)
            if zero_grad:
                for e in engines: e.zero_grad()
            backward_by(engines[1], l2, path)
        for e in engines: e.step()
        r1, r2 = losses(*refs)
        if backwards == 1:
            (r1 / gas).backward()
        else:
            (r1 / gas).backward(retain_graph=True)
            if zero_grad:
                # torch: zero_grad drops the whole window's grads so far
                opt.zero_grad()
            (r2 / gas).backward()
        if (m + 1) % gas == 0:
            opt.step(); opt.zero_grad()
    diff = max(max((a - b.detach()).abs().max().item() for a, b in zip(full_weights(e), r.parameters())) for e, r in zip(engines, refs))
    left = [released_state(e) for e, s in zip(engines, (stage, head_stage or stage)) if s == 3] or None
    for e in engines: e.destroy()
    return diff, left

bad = 0
for stage, path, backwards, gas, zg in itertools.product((1, 2, 3), t.PATHS, (1, 2), (1, 2), (False, True)):
    if backwards == 1 and zg:
        continue
    try:
        d, left = run(stage, path, backwards, gas, zg)
        ok = d < 1e-5 and (left is None or all(l == ([], []) for l in left))
        msg = f"{d:.2e} {left}"
    except Exception as ex:
        ok, msg = False, f"{type(ex).__name__}: {str(ex)[:150]}"
    bad += not ok
    print("OK " if ok else "BAD", stage, path, "backwards", backwards, "gas", gas, "zero_grad", zg, msg, flush=True)
for encoder_stage, head_stage in ((3, 2), (2, 3), (1, 3), (3, 1)):
    for path in t.PATHS:
        d, left = run(encoder_stage, path, 1, 2, False, head_stage=head_stage)
        ok = d < 1e-5 and all(l == ([], []) for l in left)
        bad += not ok
        print("OK " if ok else "BAD", f"encoder stage {encoder_stage}, head stage {head_stage}", path, f"{d:.2e} {left}", flush=True)
print("bad", bad)
