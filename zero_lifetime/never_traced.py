"""Hooks with side effects (bookkeeping, DeepSpeed's gathers): run as written, never traced.

Under ``engine.compile()`` (or a ``torch.compile``'d model) module hooks run inside the
compiled call; traced, ours would be guarded on the params' state and recompiled. Wrapping
them in ``torch.compiler.disable`` keeps them out, but its wrapper switches Dynamo's frame
evaluation off and back on at every call, compiling or not (~0.2 us more a call than this
wrapper's check), and three of ours run per module per forward
(``benchmarks/experiments/per_module_hooks.py``). Outside compilation there is nothing to switch
off: only a call that Dynamo traces takes the disabled function (a graph break there, as with
``torch.compiler.disable`` alone).
"""

import torch


def never_traced(fn):
    """``fn``, called as is when nothing compiles, and through ``torch.compiler.disable(fn)``
    when Dynamo traces the call."""
    disabled = torch.compiler.disable(fn)
    is_compiling = torch.compiler.is_compiling

    def call(*args, **kwargs):
        if is_compiling():  # constant True while Dynamo traces this frame
            return disabled(*args, **kwargs)
        return fn(*args, **kwargs)

    call.__qualname__ = f"never_traced({getattr(fn, '__qualname__', type(fn).__name__)})"
    return call
