"""DeepSpeed's private names stay in ``zero_lifetime.adapters``.

The runtime layers (what ``install`` runs) reach DeepSpeed's optimizers, IPG buckets,
gather handles and param coordinator only through an adapter, so a DeepSpeed release
that renames one of its internals is handled in one module per concern.

Outside the rule: ``bench/``, whose stock baselines call DeepSpeed's own methods by name
(its own probes fail loudly); and ZeRO-3 params' ``ds_*`` attributes, which the
tracker's hot path (C++ and its Python twin) reads directly.
"""

import ast
import pathlib

import torch
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

import zero_lifetime

PACKAGE = pathlib.Path(zero_lifetime.__file__).parent
# How the runtime layers name DeepSpeed's internal objects (and the adapters' own fields).
DEEPSPEED_OBJECT_NAMES = {"optimizer", "opt", "_optimizer", "bucket", "coalesced", "coordinator"}
TORCH_OPTIMIZER_API = set(dir(torch.optim.Optimizer))  # e.g. the demo's plain torch optimizer


def runtime_modules():
    excluded = {PACKAGE / "adapters", PACKAGE / "bench"}
    modules = [path for path in sorted(PACKAGE.rglob("*.py")) if not any(d in path.parents for d in excluded)]
    assert len(modules) > 10, modules  # the walk found the package
    return modules


def private_optimizer_names():
    """Methods and class attributes of DeepSpeed's ZeRO optimizers that are neither torch's
    Optimizer API nor a public engine method of the same name."""
    names = set(vars(DeepSpeedZeroOptimizer)) | set(vars(DeepSpeedZeroOptimizer_Stage3))
    public = set(dir(torch.optim.Optimizer)) | {n for n in vars(DeepSpeedEngine) if not n.startswith("_")}
    return {n for n in names - public if not (n.startswith("__") and n.endswith("__"))}


def _terminal_name(node):
    """``x`` for ``x`` and for ``a.b.x``."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def test_runtime_layers_touch_no_deepspeed_object_directly():
    found = []
    for path in runtime_modules():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.Attribute) and _terminal_name(node.value) in DEEPSPEED_OBJECT_NAMES
                    and node.attr not in TORCH_OPTIMIZER_API):
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: .{node.attr} of {ast.unparse(node.value)}")
    assert not found, "DeepSpeed internals used outside zero_lifetime/adapters:\n" + "\n".join(found)


def test_runtime_layers_name_no_private_optimizer_member():
    private = private_optimizer_names()
    assert {"reduce_ipg_grads", "independent_gradient_partition_epilogue"} <= private  # the oracle sees them
    found = []
    for path in runtime_modules():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute):
                name = node.attr
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                name = node.value
            else:
                continue
            if name in private:
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: {name}")
    assert not found, "DeepSpeed optimizer internals named outside zero_lifetime/adapters:\n" + "\n".join(found)
