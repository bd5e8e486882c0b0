"""never_traced: our hooks run as written outside compilation, and Dynamo never traces them
(the same graph break as torch.compiler.disable). tests/test_compile.py checks it through
engine.compile() with zero_lifetime installed."""

import pytest
import torch
from torch._dynamo.eval_frame import _debug_get_cache_entry_list

from harness import CountingBackend
from zero_lifetime.never_traced import never_traced


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_outside_compilation_it_is_the_function():
    calls = []

    def note(a, b=0):
        calls.append((a, b))
        return a + b

    assert never_traced(note)(1, b=2) == 3
    assert calls == [(1, 2)]


def _compiled_runs(wrap):
    """Graphs compiled at the first call of a compiled step that calls the hook between two
    ops, and the hook's calls seen over two calls."""
    seen = []

    def note(tensor):
        seen.append(tuple(tensor.shape))

    hook = wrap(note)

    def step(x):
        y = x + 1
        hook(y)
        return y * 2

    backend = CountingBackend("eager")
    compiled = torch.compile(step, backend=backend)
    graphs = []
    for _ in range(2):
        x = torch.ones(3)
        assert torch.equal(compiled(x), (x + 1) * 2)
        graphs.append(backend.graphs)
    return graphs[0], seen, _debug_get_cache_entry_list(note.__code__)


def test_a_traced_call_breaks_the_graph_as_disable_does():
    inlined_graphs, inlined_seen, _ = _compiled_runs(lambda fn: fn)
    disabled_graphs, disabled_seen, _ = _compiled_runs(torch.compiler.disable)
    graphs, seen, compiled_code = _compiled_runs(never_traced)
    # Traced, the hook is inlined into one graph; kept out, the step is split around it.
    assert inlined_graphs < disabled_graphs, (inlined_graphs, disabled_graphs)
    assert graphs == disabled_graphs, (graphs, disabled_graphs)
    assert compiled_code == []  # Dynamo compiled nothing of the hook itself
    assert seen == disabled_seen == inlined_seen == [(3,), (3,)]  # it ran at every call
