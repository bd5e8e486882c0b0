"""Real DeepSpeed engines and plain-torch oracles for the tests (CPU, fp32)."""

import contextlib
import copy
import logging

import pytest
import torch
import torch.nn.functional as F

import deepspeed
import zero_lifetime
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from deepspeed.utils import safe_get_full_fp32_param
from zero_lifetime.adapters import UnsupportedDeepSpeedError
from zero_lifetime.bench.step import gathered_bytes  # noqa: F401  (re-exported to the tests)

logging.getLogger("DeepSpeed").setLevel(logging.WARNING)

IN, HIDDEN, OUT, VOCAB = 8, 16, 4, 11


class MLPNorm(torch.nn.Module):
    """Linear + LayerNorm (which saves its weight itself) + Linear."""

    def __init__(self):
        super().__init__()
        self.l1 = torch.nn.Linear(IN, HIDDEN)
        self.ln = torch.nn.LayerNorm(HIDDEN)
        self.l2 = torch.nn.Linear(HIDDEN, OUT)

    def forward(self, x):
        return self.l2(self.ln(torch.relu(self.l1(x))))


class TiedLM(torch.nn.Module):
    """Embedding whose weight is reused as the output projection (tied weights)."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, HIDDEN)
        self.ln = torch.nn.LayerNorm(HIDDEN)
        self.mix = torch.nn.Linear(HIDDEN, HIDDEN)

    def forward(self, tokens):
        h = self.ln(torch.tanh(self.mix(self.emb(tokens))))
        return F.linear(h, self.emb.weight)


class Checkpointed(torch.nn.Module):
    """Two blocks under activation checkpointing (reentrant or not)."""

    def __init__(self, reentrant: bool):
        super().__init__()
        self.reentrant = reentrant
        self.inp = torch.nn.Linear(IN, HIDDEN)
        self.b1 = torch.nn.Sequential(torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.Tanh())
        self.b2 = torch.nn.Sequential(torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.Tanh())
        self.out = torch.nn.Linear(HIDDEN, OUT)

    def forward(self, x):
        h = self.inp(x)
        for block in (self.b1, self.b2):
            h = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=self.reentrant)
        return self.out(h)


class RawAlias(torch.nn.Module):
    """A forward that saves a param's memory without an autograd view of it (``p.data[:]``):
    the tracker can only find it by address. ``alias = False`` saves a copy instead."""

    def __init__(self):
        super().__init__()
        self.alias = True
        self.l1 = torch.nn.Linear(IN, HIDDEN)
        self.gain = torch.nn.Parameter(torch.rand(HIDDEN) + 0.5)
        self.l2 = torch.nn.Linear(HIDDEN, OUT)

    def forward(self, x):
        h = torch.tanh(self.l1(x))
        scale = self.gain.data[:] if self.alias else self.gain.detach().clone()
        # The product saves only `scale` (for h's gradient); gain's own gradient comes through the sum.
        return self.l2(h * scale + self.gain)


class FailingBackward(torch.autograd.Function):
    """Identity forward; its backward raises, half-way through the graph's backward."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise ArithmeticError("loss backward failed")


def make_backward_die_at(module):
    """Every later backward through ``module``'s output raises there; returns the hook handle."""
    return module.register_forward_hook(lambda _module, _args, out: FailingBackward.apply(out))


class SplitHeads(torch.nn.Module):
    """A trunk and two heads, the output a tuple of the heads': with ``losses`` each loss
    reaches the trunk and one head, so a head can get its first gradient in a later backward."""

    def __init__(self):
        super().__init__()
        self.trunk = torch.nn.Linear(IN, HIDDEN)
        self.head_a = torch.nn.Linear(HIDDEN, OUT)
        self.head_b = torch.nn.Linear(HIDDEN, OUT)

    def forward(self, x):
        hidden = torch.tanh(self.trunk(x))
        return self.head_a(hidden), self.head_b(hidden)


def in_float64(model_class):
    """``model_class`` in fp64, its input and outputs fp32 (as make_input and losses use them):
    DeepSpeed accumulates such a model's gradients in fp32, its default accumulation dtype."""

    class Float64(model_class):

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.double()

        def forward(self, x, *args):
            out = super().forward(x.double(), *args)
            return tuple(o.float() for o in out) if isinstance(out, tuple) else out.float()

    Float64.__name__ = Float64.__qualname__ = f"Float64{model_class.__name__}"
    return Float64


Float64MLPNorm = in_float64(MLPNorm)


MODELS = {
    "mlp_norm": MLPNorm,
    "split_heads": SplitHeads,
    "raw_alias": RawAlias,
    "tied_lm": TiedLM,
    "ckpt_reentrant": lambda: Checkpointed(True),
    "ckpt_nonreentrant": lambda: Checkpointed(False),
}


class AdaptersInsideCheckpoints(torch.nn.Module):
    """Every trainable param inside a reentrant checkpoint, the rest frozen: LoRA adapters
    under HF gradient checkpointing. As transformers does for a frozen embedding, the first
    block's input is made to need a gradient, or the checkpoint would give no param one. Each
    checkpoint's backward recomputes its block and backwards it as a nested graph task: the
    outer backward's own graph reaches no trainable param. ``deepspeed_checkpoint``: DeepSpeed's
    checkpoint (deepspeed.checkpointing) instead of torch's."""

    def __init__(self, deepspeed_checkpoint=False):
        super().__init__()
        self.deepspeed_checkpoint = deepspeed_checkpoint
        self.embed = torch.nn.Linear(8, 16).requires_grad_(False)
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.LayerNorm(16),
                                                              torch.nn.Tanh()) for _ in range(2))
        for block in self.blocks:
            block[0].weight.requires_grad_(False)  # its bias and the LayerNorm train
        self.head = torch.nn.Linear(16, 4).requires_grad_(False)

    def forward(self, x):
        from deepspeed.runtime.activation_checkpointing.checkpointing import checkpoint as deepspeed_checkpoint
        h = self.embed(x).requires_grad_(True)
        for block in self.blocks:
            h = (deepspeed_checkpoint(block, h) if self.deepspeed_checkpoint else
                 torch.utils.checkpoint.checkpoint(block, h, use_reentrant=True))
        return self.head(h)


class CheckpointedLlama(torch.nn.Module):
    """A tiny transformers Llama under HF activation checkpointing (reentrant, the Trainer's
    ``gradient_checkpointing`` before transformers 4.35 and still common): token ids in, logits
    out, so ``losses`` applies."""

    def __init__(self):
        import transformers
        super().__init__()
        config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                                          num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                          max_position_embeddings=16)
        self.lm = transformers.LlamaForCausalLM(config)
        kwargs = {"use_reentrant": True}
        if hasattr(self.lm, "activation_checkpointing_enable"):  # transformers >= 5.24
            self.lm.activation_checkpointing_enable(kwargs)
        else:
            self.lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)

    def forward(self, tokens):
        return self.lm(input_ids=tokens).logits


class DeviceMarkedMLPNorm(MLPNorm):
    """MLPNorm with a zero-size param on its root, as some codebases keep one to find the
    model's device (a root's own params come first, where 0.18.9's and 0.17.6's ZeRO-1/2 can
    initialize it), and an output gain beside it (a module whose only params are zero-size
    fails stock ZeRO-3's gather). The forward uses it, so that it gets a (zero-size) gradient
    and DDP's oracle finds every param used."""

    def __init__(self):
        super().__init__()
        self.device_marker = torch.nn.Parameter(torch.empty(0))
        self.gain = torch.nn.Parameter(torch.ones(OUT))

    def forward(self, x):
        return super().forward(x) * self.gain + self.device_marker.sum()


class SelectivelyCheckpointed(torch.nn.Module):
    """Blocks under torch's selective activation checkpointing (torchtitan's way): matmul
    outputs saved, the rest recomputed in the backward."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(IN, HIDDEN)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.LayerNorm(HIDDEN), torch.nn.Linear(HIDDEN, 2 * HIDDEN), torch.nn.GELU(),
                                torch.nn.Linear(2 * HIDDEN, HIDDEN))
            for _ in range(3))
        self.out = torch.nn.Linear(HIDDEN, OUT)

    @staticmethod
    def _save_matmuls(ctx, op, *args, **kwargs):
        from torch.utils.checkpoint import CheckpointPolicy
        if op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    def forward(self, x):
        import functools

        from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts
        context_fn = functools.partial(create_selective_checkpoint_contexts, self._save_matmuls)
        h = self.inp(x)
        for block in self.blocks:
            h = h + checkpoint(block, h, use_reentrant=False, context_fn=context_fn)
        return self.out(h)


# Built by name by a few tests only: the sweeps over MODELS (random programs) leave them out.
MORE_MODELS = {"mlp_norm_fp64": Float64MLPNorm, "llama_ckpt": CheckpointedLlama, "ckpt_adapters": AdaptersInsideCheckpoints,
               "device_marked": DeviceMarkedMLPNorm, "selective_ckpt": SelectivelyCheckpointed}


def make_input(model_name: str, seed: int, batch: int = 4):
    g = torch.Generator().manual_seed(seed)
    if model_name in ("tied_lm", "llama_ckpt"):
        return torch.randint(0, VOCAB, (batch, 5), generator=g)
    return torch.randn(batch, IN, generator=g)


def penalty_loss(model, x, jacobian=False):
    """A loss plus a gradient penalty: autograd.grad(create_graph=True), then a backward through
    it. ``jacobian``: the penalty on the whole input Jacobian, one vmapped backward per output
    (``is_grads_batched``, Jacobian regularization)."""
    x = x.clone().requires_grad_(True)
    out = model(x)
    if jacobian:
        basis = torch.eye(out.shape[-1]).unsqueeze(1).expand(-1, *out.shape).contiguous()
        (grad_x, ) = torch.autograd.grad(out, x, grad_outputs=basis, is_grads_batched=True, create_graph=True)
    else:
        (grad_x, ) = torch.autograd.grad(out.pow(2).sum(), x, create_graph=True)
    return out.mean() + grad_x.pow(2).sum()


def losses(out):
    """Two different losses over one output: the multi-loss pattern. Over a pair of outputs
    (SplitHeads), one loss over each."""
    first, second = out if isinstance(out, tuple) else (out, out)
    return first.pow(2).mean(), (second * torch.linspace(-1, 1, second.shape[-1])).sum()


def ds_config(stage: int, persistence: int = 0, lr: float = 0.1, gas: int = 1, **zero):
    zero_cfg = {"stage": stage}
    if stage == 3:
        zero_cfg["stage3_param_persistence_threshold"] = persistence
    zero_cfg.update(zero)
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "SGD", "params": {"lr": lr}},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": 0.0,  # DeepSpeed's default is 1.0; the oracle is plain SGD
        "zero_optimization": zero_cfg,
    }


def _newton_schulz_in_fp32() -> None:
    """0.19.8 runs Muon's Newton-Schulz (its default method, "gram") in fp16 where the CPU has
    it natively and in fp32 elsewhere (``ns_compute_dtype``: fp16 on an Intel Xeon with
    AVX512-FP16, fp32 on an AMD EPYC). In fp16 it magnifies the float rounding by which two
    backwards' summed gradients differ from one backward of the summed loss (stock two
    backwards too: 1e-5 to 8e-5 after 3 steps, against 3e-8 in fp32), past the 1e-6 the oracle
    tests hold, on some machines only. fp32, DeepSpeed's own fallback, makes the tests judge
    which gradients reach Muon alike on every CPU. 0.18.9 and 0.17.6 have no such choice."""
    from deepspeed.runtime.zero.muon import original_muon
    if hasattr(original_muon, "ns_compute_dtype"):
        original_muon.ns_compute_dtype = lambda ns_method="gram": torch.float32


def muon_engine(stage: int, gas: int = 1, offload: bool = False, fp16: bool = False, model_name: str = "mlp_norm"):
    """A stock engine under DeepSpeed's Muon optimizer (Muon for the matrices, tagged
    ``use_muon``; Adam for the rest). ``fp16``: with a dynamic loss scale (feed it half inputs)."""
    import fp16_scaling  # it imports this module
    _newton_schulz_in_fp32()
    # DeepSpeed 0.18.9 and 0.19.8 torch.compile muon_update, and which compiled variant a call
    # runs (one per shape, then a shape-generic one) depends on every earlier call in the process:
    # the variants round differently, and Newton-Schulz magnifies that (3e-4 after 3 steps here).
    # Each engine starts from an empty cache, so an oracle and the run it judges compile alike.
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = MODELS[model_name]()
    for p in model.parameters():
        p.use_muon = p.ndim == 2
    zero = {"offload_optimizer": {"device": "cpu"}} if offload else {}
    config = dict(ds_config(stage, lr=0.01, gas=gas, **zero), optimizer={"type": "Muon", "params": {"lr": 0.01}})
    if fp16:
        config["fp16"] = dict(fp16_scaling.FP16_SECTION)
    with fp16_scaling.cpu_fp16_allowed() if fp16 else contextlib.nullcontext():
        engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    return engine


def install_or_let_stock_step(engine, install: bool, **install_kwargs):
    """``zero_lifetime.install(engine, **install_kwargs)``; or, for a stock ZeRO-1/2 engine, only
    what install does to its flat buffers: stock 0.18.9's step() fails on 2 or more gloo ranks
    without it (README, DeepSpeed 0.18.9)."""
    if install:
        return zero_lifetime.install(engine, **install_kwargs)
    if engine.zero_optimization_stage() < 3:
        from zero_lifetime.adapters.zero12_flat_buffers import detach_flat_buffers
        detach_flat_buffers(engine.optimizer)
    return None


def make_pair(model_name: str, stage: int, seed: int = 0, persistence: int = 0, gas: int = 1,
              config: dict = None, **zero):
    """A DeepSpeed engine and an identical plain-torch model with its SGD optimizer.

    ``config``: top-level DeepSpeed settings over ds_config's; ``zero``: zero_optimization's."""
    torch.manual_seed(seed)
    model = MODELS[model_name]()
    reference = copy.deepcopy(model)
    cfg = {**ds_config(stage, persistence, gas=gas, **zero), **(config or {})}
    engine, *_ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
    ref_opt = torch.optim.SGD(reference.parameters(), lr=cfg["optimizer"]["params"]["lr"])
    return engine, reference, ref_opt


class CountingBackend:
    """A torch.compile backend that counts the graphs it compiles, so a test knows compiled
    code ran (Dynamo falls back to eager silently, for example past its recompile limit)."""

    def __init__(self, name: str):
        self.inner = torch._dynamo.lookup_backend(name)
        self.graphs = 0

    def __call__(self, graph_module, example_inputs):
        self.graphs += 1
        return self.inner(graph_module, example_inputs)


def graph_has_compiled_code(out) -> bool:
    """Whether the output's autograd graph holds a node of AOTAutograd's compiled function
    (whose saved tensors are what the compiled forward saved, params included)."""
    seen, stack = set(), [out.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if "CompiledFunction" in type(node).__name__:
            return True
        stack.extend(next_node for next_node, _ in node.next_functions)
    return False


def assert_install_refused(engine, error_match=None, warning_match="Continuing without zero_lifetime") -> str:
    """install() raises UnsupportedDeepSpeedError and patches nothing; with strict=False it
    warns, returns None, and patches nothing either. Returns the error's message."""
    with pytest.raises(UnsupportedDeepSpeedError, match=error_match) as refused:
        zero_lifetime.install(engine)
    assert "forward" not in engine.__dict__
    with pytest.warns(RuntimeWarning, match=warning_match):
        assert zero_lifetime.install(engine, strict=False) is None
    assert "forward" not in engine.__dict__
    return str(refused.value)


def full_weights(engine):
    """Each param's fp32 master, or (a frozen param: the optimizer has none) its own data,
    gathered on ZeRO-3 (collective: every rank calls this alike). A zero-size param has no
    values and, on 0.19.8, no master (ZeRO-3 raises for it): an empty tensor of its shape."""
    weights = []
    for p in engine.module.parameters():
        if (p.ds_numel if hasattr(p, "ds_numel") else p.numel()) == 0:
            weights.append(torch.zeros(p.ds_shape if hasattr(p, "ds_shape") else p.shape))
            continue
        master = safe_get_full_fp32_param(p)
        if master is None:
            with deepspeed.zero.GatheredParameters([p]) if hasattr(p, "ds_id") else contextlib.nullcontext():
                master = p.detach().float()
        weights.append(master.detach().clone())
    return weights


TORCH_FP32_RTOL = 1.3e-6  # torch.testing.assert_close's default for fp32 (its atol, 1e-5, is the one below)


def assert_weights_match(engine, reference, atol=1e-5, rtol=1e-4, equal_nan=False):
    for (name, _), got, (_, want) in zip(engine.module.named_parameters(), full_weights(engine),
                                         reference.named_parameters()):
        torch.testing.assert_close(got, want.detach(), atol=atol, rtol=rtol, equal_nan=equal_nan,
                                   msg=lambda m: f"{name}: {m}")


def released_state(engine):
    """(pinned-or-gathered non-persistent params, params with non-empty data while NOT_AVAILABLE)."""
    gathered, inconsistent = [], []
    for name, p in engine.module.named_parameters():
        if getattr(p, "ds_persist", False):
            continue
        if p.ds_status != ZeroParamStatus.NOT_AVAILABLE:
            gathered.append(name)
        elif p.data.numel() != 0:
            inconsistent.append(name)
    return gathered, inconsistent


def two_backwards(engine, out, path: str, zero_grad: bool):
    """Backward two losses of one forward through the engine, the manual or the scale path."""
    backward_both(engine, *losses(out), path, zero_grad)


def grad_and_backward(model, backward, weight, x, wrt: str):
    """One step's two passes through one graph, for an engine (``backward=engine.backward``)
    or a torch model (``torch.Tensor.backward``). wrt "input": a training backward (graph
    retained), then torch.autograd.grad(second loss, x); wrt "param": torch.autograd.grad(first
    loss, weight) (retained, GradNorm-style), then the training backward of both losses.
    Returns what autograd.grad gave."""
    first, second = losses(model(x))
    if wrt == "input":
        backward(first, retain_graph=True)
        return torch.autograd.grad(second, [x])[0]
    grad = torch.autograd.grad(first, [weight], retain_graph=True)[0]
    backward(first + second)
    return grad


# Each way a user clears every gradient of an engine (all torch's zero_grad() installed).
CLEARS = {
    "engine": lambda engine: engine.zero_grad(),
    "optimizer": lambda engine: engine.optimizer.zero_grad(),  # the one deepspeed.initialize returns
    "optimizer_keep_tensors": lambda engine: engine.optimizer.zero_grad(set_to_none=False),
    "model": lambda engine: engine.module.zero_grad(),  # torch's Module.zero_grad
    "model_keep_tensors": lambda engine: engine.module.zero_grad(set_to_none=False),
}


def backward_both(engine, l1, l2, path: str, zero_grad):
    """Backward l1 (graph retained), then l2, through the engine, the manual or the scale path.
    ``zero_grad`` between them: False, True (engine.zero_grad()) or a name in CLEARS."""
    backward_by(engine, l1, path, retain_graph=True)
    if zero_grad:
        CLEARS["engine" if zero_grad is True else zero_grad](engine)
    backward_by(engine, l2, path)


def backward_separately_or_summed(engine, first, second, separately: bool):
    """``separately``: engine.backward of each loss over one retained graph (what install makes
    right); else one engine.backward of their sum (stock's way, the oracle)."""
    if separately:
        engine.backward(first, retain_graph=True)
        engine.backward(second)
    else:
        engine.backward(first + second)


def engine_micro_batch(engine, kind: str, x):
    """One micro-batch on ``engine``, then ``engine.step()`` (DeepSpeed steps the optimizer at
    every GAS-th call). ``kind``: "single" (one backward of the first loss), "two" (both losses
    through the retained graph), "dropped" (the retained graph dropped without its second
    backward) or "manual" (``loss.backward()``: DeepSpeed divides by GAS at the outputs)."""
    l1, l2 = losses(engine(x))
    if kind == "manual":
        l1.backward()
    else:
        engine.backward(l1, retain_graph=kind != "single")
        if kind == "two":
            engine.backward(l2)
    engine.step()


def backward_by(engine, loss, path: str, retain_graph: bool = False):
    """One backward of ``loss`` on ``path``: "engine" (engine.backward), "manual"
    (loss.backward()) or "scale" (engine.scale(loss).backward())."""
    kwargs = {"retain_graph": True} if retain_graph else {}
    if path == "engine":
        engine.backward(loss, **kwargs)
    elif path == "manual":
        loss.backward(**kwargs)
    else:
        engine.scale(loss, **kwargs).backward(**kwargs)


def assert_moved(engine, initial_model, by: float = 1e-3):
    """The engine's weights moved away from ``initial_model``'s (it trained)."""
    moved = max((got - start.detach()).abs().max().item()
                for got, start in zip(full_weights(engine), initial_model.parameters()))
    assert moved > by, moved


def train_step(engine, reference, ref_opt, model_name: str, step: int, backwards: int, path: str, zero_grad: bool):
    """One training step on the engine and on the torch reference, on step's input: one
    backward of the first loss, or (backwards == 2) both losses' through the retained graph."""
    x = make_input(model_name, seed=step)
    if backwards == 1:
        loss = losses(engine(x))[0]
        engine.backward(loss) if path == "engine" else loss.backward()
        losses(reference(x))[0].backward()
        ref_opt.step()
        ref_opt.zero_grad()
    else:
        two_backwards(engine, engine(x), path, zero_grad)
        reference_two_backwards(reference, ref_opt, x, zero_grad)
    engine.step()


def two_backwards_step_like_torch(engine, out, reference, ref_opt, ref_out):
    """engine.backward of ``out``'s two losses through the retained graph, then step(); torch's
    step on ``ref_out``'s summed losses; the weights must match after it, and on ZeRO-3 nothing
    stays gathered."""
    l1, l2 = losses(out)
    engine.backward(l1, retain_graph=True)
    engine.backward(l2)
    engine.step()
    sum(losses(ref_out)).backward()
    ref_opt.step()
    ref_opt.zero_grad()
    assert_weights_match(engine, reference)
    if engine.zero_optimization_stage() == 3:
        assert released_state(engine) == ([], [])


def reference_two_backwards(reference, ref_opt, x, zero_grad: bool):
    reference_step_both(ref_opt, *losses(reference(x)), zero_grad)


def reference_step_both(ref_opt, l1, l2, zero_grad: bool):
    """What backward_both then step() does, in plain torch."""
    l1.backward(retain_graph=True)
    if zero_grad:
        ref_opt.zero_grad()
    l2.backward()
    ref_opt.step()
    ref_opt.zero_grad()


# The installed DeepSpeed release (the suite runs on 0.19.8, 0.18.9 and 0.17.6, see README).
DS_VERSION = deepspeed.__version__.split("+")[0]
# DeepSpeed 0.18+ reduces gradients for a plain loss.backward() (and has engine.scale());
# 0.17.6 only inside engine.backward(loss), and zero_lifetime refuses the plain path there.
TORCH_STYLE_BACKWARD = hasattr(deepspeed.runtime.engine.DeepSpeedEngine, "scale")
# The two-backward paths to test on this release (0.17.6 refuses loss.backward()).
BACKWARD_PATHS = ["engine", "manual"] if TORCH_STYLE_BACKWARD else ["engine"]


def linear_saves_params() -> bool:
    """ZeRO-3's F.linear replacement saves weight and bias for backward; aten's linear saves
    no bias, and no weight when its input needs no grad. DeepSpeed 0.19.8 installs it at
    initialize, 0.17.6 only inside zero.Init (not used here)."""
    from deepspeed.runtime.zero.linear import zero3_linear_wrap
    return F.linear is zero3_linear_wrap


def params_saved_by_forward(model_name: str, module) -> list:
    """Names of the params a forward of ``module`` keeps for backward (pinned under "pin")."""
    names = [name for name, _ in module.named_parameters()]
    if linear_saves_params() or model_name != "mlp_norm":
        return names
    return ["ln.weight", "ln.bias", "l2.weight"]  # l1's input needs no grad; biases are not saved
