"""Engines fed engines with gradient accumulation: how far stock DeepSpeed trains from torch, and
what the fed engine's input handling costs once installed.

    DS_ACCELERATOR=cpu python3 -m benchmarks.chained_engines_stock

The encoder and head of ``tests/test_chained_engines.py`` (1 rank, CPU, SGD lr 0.1), two
windows against torch's ``(loss / GAS).backward()``:
- GAS 2 on both, stages 1-3, each backward path of this DeepSpeed: max |weight - torch| of the
  encoder and the head, and the encoder's update over torch's (summed |change|, per tensor);
- encoder GAS 2, head GAS 4 (ZeRO-3): max |weight - torch|, each model divided by its own GAS;
- installed, GAS 2: microseconds per forward that the head spends on its inputs (2000 calls),
  for an engine output, one three ops after it, data, and a leaf that needs a gradient.
"""

import os
import sys
import timeit

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

import conftest  # noqa: E402,F401  (one gloo rank on the CPU, as the tests run)
import torch  # noqa: E402

import test_chained_engines as chain  # noqa: E402
from harness import full_weights  # noqa: E402
from zero_lifetime.chained_engines import OutputDivision  # noqa: E402


def max_diff(engine, reference) -> float:
    return max((got - want.detach()).abs().max().item()
               for got, want in zip(full_weights(engine), reference.parameters()))


def stock_off_torch():
    initial_encoder = chain._encoder_and_head()[0]
    for stage in (1, 2, 3):
        for path in chain.PATHS:
            engines, references = chain._train_chain(stage, 2, path, "through_head", install=False)
            moves = [((got - start.detach()).abs().sum() / (want.detach() - start.detach()).abs().sum()).item()
                     for got, want, start in zip(full_weights(engines[0]), references[0].parameters(),
                                                 initial_encoder.parameters())]
            print(f"stock, GAS 2, stage {stage}, {path:6}: max |diff| encoder {max_diff(engines[0], references[0]):.1e}, "
                  f"head {max_diff(engines[1], references[1]):.1e}; encoder update / torch's "
                  f"{min(moves):.2f}-{max(moves):.2f}")
            for engine in engines:
                engine.destroy()


def stock_with_different_gas():
    """Encoder GAS 2, head GAS 4, ZeRO-3, loss.backward(), against torch with each model's
    gradients divided by its own GAS (as test_chained_engines_each_divide_by_their_own_...)."""
    engines, references = chain._train_with_each_own_gas(3, (2, 4), install=False)
    print("stock, encoder GAS 2, head GAS 4, ZeRO-3: max |diff| "
          + ", ".join(f"{max_diff(e, r):.1e}" for e, r in zip(engines, references)))


def input_handling_cost(calls=2000):
    encoder, head = chain._encoder_and_head()
    encoder_engine, head_engine = (chain._engine(m, 2, 2, True) for m in (encoder, head))
    chained = head_engine._zero_lifetime_installation.chained
    output = encoder_engine(chain._batch(0))
    data = chain._batch(1)
    plain_mlp = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh()) for _ in range(32)])
    inputs = {"an engine output": output, "three ops after one": torch.tanh(output)[:, :8] * 2,
              "two engine outputs added": output + encoder_engine(data),
              "mixed with a free tensor": output + torch.zeros_like(output, requires_grad=True),
              "data": data, "a leaf needing a gradient": data.clone().requires_grad_(),
              "out of a 32-layer torch MLP (the walk's limit)": plain_mlp(data)}
    for name, tensor in inputs.items():
        seconds = timeit.timeit(lambda: chained.undo_division_on_inputs((tensor,), {}, OutputDivision()),
                                number=calls)
        print(f"installed, GAS 2: head input handling, {name}: {seconds / calls * 1e6:.1f} us per forward")


if __name__ == "__main__":
    stock_off_torch()
    if chain.TORCH_STYLE_BACKWARD:
        stock_with_different_gas()
        input_handling_cost()
