"""The one-rank measurements behind docs/reliability.md's "DeepSpeed 0.18.9" section that no
test asserts directly. Not collected by pytest; run with the Python of the release to probe:

    DS_ACCELERATOR=cpu .venv-ds0189/bin/python tests/probe_stock_0189.py

* flat buffer: whether ZeRO-1's flat 16-bit buffer carries autograd history (0.18.9: yes,
  the cause of its step() failure on 2 gloo ranks; 0.19.8: no);
* legacy hooks: on DeepSpeed's forced torch < 2.1 hook path (stock, ZeRO-2, overlap_comm on),
  how many times its gradient hook ran, and the weights against torch after one step;
* offload GAS bypass: ZeRO-2 + CPU offload + GAS 2 with zero_lifetime's refusal of a second
  backward bypassed, against torch (off torch: the refusal is needed there).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import zero_lifetime.single_rank as single_rank  # noqa: E402

single_rank.single_rank_env()

import deepspeed  # noqa: E402
import deepspeed.utils.torch as ds_torch_utils  # noqa: E402

import multitask as mt  # noqa: E402
import zero_lifetime  # noqa: E402
from harness import losses, make_input, make_pair  # noqa: E402
from test_retain_graph import OFFLOAD  # noqa: E402
from zero_lifetime.adapters import zero12_offload_carry  # noqa: E402


def flat_buffer():
    model, _ = mt.make_models()
    flat = mt.build_engine(model, 1, "summed", False, "fp32").optimizer.bit16_groups_flat[0]
    print(f"flat buffer: requires_grad={flat.requires_grad} grad_fn={type(flat.grad_fn).__name__}")


def legacy_hooks():
    real = ds_torch_utils.required_torch_version
    ds_torch_utils.required_torch_version = lambda min_version=None, max_version=None: (
        False if (min_version == 2.1 and max_version is None) else real(min_version=min_version,
                                                                        max_version=max_version))
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    stock = DeepSpeedZeroOptimizer.process_gradients
    calls = []
    DeepSpeedZeroOptimizer.process_gradients = lambda self, *a, **k: (calls.append(1), stock(self, *a, **k))[1]
    try:
        model, reference = mt.make_models()
        engine = mt.build_engine(model, 2, "summed", False, "fp32")
        params = sum(1 for p in model.parameters() if p.requires_grad)
        try:
            mt.train_engine(engine, "summed", 1)
        except IndexError as exc:  # 0.19.8: the empty buckets (DeepSpeed #7595)
            outcome = f"step raised IndexError: {exc}"
        else:
            mt.train_reference(reference, "summed", 1)
            outcome = f"max |engine - torch| {max(mt.max_differences(engine, reference).values()):.3g}"
        print(f"legacy hooks: overlap_comm={engine.optimizer.overlap_comm} hook calls {len(calls)} "
              f"for {params} params; {outcome}")
    finally:
        DeepSpeedZeroOptimizer.process_gradients = stock
        ds_torch_utils.required_torch_version = real


def offload_gas_bypass():
    stock_init = zero12_offload_carry.Zero12OffloadCarry.__init__

    def summing(self, optimizer):
        stock_init(self, optimizer)
        self.accumulators_sum_backwards = True  # what zero_lifetime refuses on this release

    zero12_offload_carry.Zero12OffloadCarry.__init__ = summing
    try:
        for name, plan in (("two_in_each", [[2, 2], [2, 2]]), ("mixed", [[1, 2], [2, 1]])):
            engine, reference, ref_opt = make_pair("mlp_norm", 2, gas=2, **OFFLOAD)
            zero_lifetime.install(engine)
            seed = 0
            for window in plan:
                for backwards in window:
                    seed += 1
                    x = make_input("mlp_norm", seed)
                    (l1, l2), (r1, r2) = losses(engine(x)), losses(reference(x))
                    if backwards == 2:
                        engine.backward(l1, retain_graph=True)
                        engine.backward(l2)
                        ((r1 + r2) / 2).backward()
                    else:
                        engine.backward(l1)
                        (r1 / 2).backward()
                    engine.step()
                ref_opt.step()
                ref_opt.zero_grad()
            off = max(mt.max_differences(engine, reference).values())
            print(f"offload GAS bypass, {name}: max |engine - torch| {off:.3g}")
    finally:
        zero12_offload_carry.Zero12OffloadCarry.__init__ = stock_init


if __name__ == "__main__":
    print(f"DeepSpeed {deepspeed.__version__}")
    flat_buffer()
    legacy_hooks()
    offload_gas_bypass()
