"""Random programs of autograd operations on an installed engine and on plain torch, side by side.

A program is a seeded sequence of what users do with graphs: forwards (with or without grad,
input gradients wanted or not), backwards of either loss of any live graph (retained or not,
through ``engine.backward`` or ``loss.backward()``), ``torch.autograd.grad`` for the input or
for a weight, graphs dropped in any order, ``zero_grad()`` and ``step()``, with up to
``MAX_LIVE`` graphs alive at once. Each operation runs on the engine and on a plain-torch copy
of the model; what torch returns is the oracle:

* every forward output, every ``autograd.grad`` result and, after every ``step()``, every
  weight must match torch;
* where torch raises, the engine must raise too: a backward through a graph saved before a
  ``step()`` (torch: "modified by an inplace operation"), ``autograd.grad`` through reentrant
  checkpointing; and a ``step()`` with no backward since the last one raises
  ``StepWithoutBackwardError``, leaving the weights as they are; any operation may follow
  one that raised (a plain backward included: the cleanup runs as the pass dies);
* after every operation no ZeRO-3 param may be released with memory still attached; under
  ``regather`` nothing stays gathered; under ``pin`` nothing stays gathered or pinned once no
  graph is alive.

With ``gas`` > 1 (gradient accumulation) a step() that does not close the window changes
nothing, torch's reference backwards each loss divided by ``gas`` and steps when the engine's
window closes; a closing step() with no backward since the last step() may raise or apply the
window (ZeRO-3 without offload), and must match torch either way.

On several ranks (tests/two_rank_programs_worker.py) every rank runs the same program on its
own inputs; torch's reference averages its gradients over the ranks before each step, as
DeepSpeed reduces them, and everything else (outputs, ``autograd.grad`` results) is local.

Used by tests/test_lifetime_programs.py (1 rank, stages 1-3, both policies) and
tests/test_two_rank_programs.py (2 ranks over gloo).
"""

import gc
import math
import random
import time
from dataclasses import dataclass, field
from typing import List, Optional

import torch
import torch.distributed as dist

import zero_lifetime
from harness import MODELS, TORCH_STYLE_BACKWARD, assert_weights_match, losses, make_input, make_pair, released_state
from two_rank_worker import average_over_ranks

MAX_LIVE = 3
# How the engine must match torch. A program can run torch's own training away to inf and then
# NaN (the second loss is unbounded): tied_lm's autograd.grad on 0.17.6, seed 72, and its weights
# in 3 of 12000 programs of seeds 1000-2299. The engine must then be NaN exactly where torch is.
CLOSE = {"atol": 1e-5, "rtol": 1e-4, "equal_nan": True}
FLOAT_INPUT_MODELS = ("mlp_norm", "raw_alias", "ckpt_nonreentrant", "split_heads")


def assert_gradient_norm_overflows(reference: torch.nn.Module) -> None:
    """DeepSpeed skips a float32 step whose global gradient norm is not finite (ZeRO-1/2 on
    0.19.8: ``is_invalid_grad_norm``) where torch's SGD applies it. A program whose training ran
    away can get there (NaN or huge gradients); the engine may skip only then. The norm is taken
    in float64 here: float32's squares overflow when the true sum of squares reaches its maximum."""
    squares = sum(p.grad.double().pow(2).sum().item() for p in reference.parameters() if p.grad is not None)
    limit = torch.finfo(torch.float32).max
    assert not math.isfinite(squares) or squares >= 0.99 * limit, (
        f"the engine skipped a step whose gradients torch has as finite (sum of squares {squares:.3g}, "
        f"float32 max {limit:.3g})")


@dataclass
class Graph:
    """One forward's two losses on the engine and on the reference, and its input."""
    label: str
    engine_losses: tuple
    reference_losses: tuple
    engine_x: torch.Tensor
    reference_x: torch.Tensor
    stale: bool = False  # a step() ran since its forward
    # That step came after zero_grad() with no backward since: torch's optimizer skipped every
    # param (no .grad), so torch still runs this graph; DeepSpeed rewrote every weight (with
    # Adam they move), so the engine refuses it, as after any applied step.
    stale_on_engine_only: bool = False
    # That step skipped some params in torch (no .grad: no backward reached them), which
    # DeepSpeed rewrote too: the engine refuses the graph where torch may still run it (when
    # its backward needs only skipped params' saved weights, or none).
    stale_params_skipped_by_torch: bool = False


@dataclass
class Program:
    model_name: str
    stage: int
    policy: Optional[str]
    seed: int
    length: int
    # ZeRO-3 windows: "eager" (no reuse distance, no prefetch) or DeepSpeed's "default" ones.
    windows: str = "eager"
    offload: bool = False  # CPU optimizer offload
    # False: ZeRO-1 with contiguous_gradients and overlap_comm off, where DeepSpeed makes no
    # gradient hooks and reduces .grad in the boundary backward's epilogue.
    gradient_hooks: bool = True
    gas: int = 1  # gradient_accumulation_steps: step() applies every gas-th call
    lr: float = 0.1  # SGD's, on the engine and the reference
    log: List[str] = field(default_factory=list)

    def describe(self) -> str:
        head = (f"program model={self.model_name} stage={self.stage} policy={self.policy} seed={self.seed} "
                f"windows={self.windows} offload={self.offload} gradient_hooks={self.gradient_hooks} gas={self.gas} "
                f"lr={self.lr}")
        return head + "\n  " + "\n  ".join(self.log[-40:])


class ProgramRunner:
    def __init__(self, program: Program):
        self.p = program
        self.rng = random.Random(program.seed)
        # Eager windows (no reuse distance, no prefetch): ZeRO-3 releases each module's params
        # when it is done with them, so whatever stays gathered is the lifetime's doing. With
        # DeepSpeed's default windows it keeps what its recorded trace expects to use again
        # soon: the trace and its release decisions then decide, and only they are checked.
        eager = program.stage == 3 and program.windows == "eager"
        zero = dict(stage3_max_reuse_distance=0, stage3_prefetch_bucket_size=0) if eager else {}
        if program.offload:
            zero["offload_optimizer"] = {"device": "cpu"}
        if not program.gradient_hooks:
            zero.update(contiguous_gradients=False, overlap_comm=False)
        self.engine, self.reference, self.ref_opt = make_pair(
            program.model_name, program.stage, seed=program.seed, gas=program.gas,
            config={"optimizer": {"type": "SGD", "params": {"lr": program.lr}}}, **zero)
        zero_lifetime.install(self.engine, policy=program.policy)
        # check_invariants collects garbage after every operation: leave what exists now (the
        # engine, its model, what earlier tests and lazy imports made) out of those collections,
        # which then walk only this program's objects (0.17 s a collection otherwise, 97% of a
        # program's time). The engine leaks when the program ends: a small one, once per program.
        gc.collect()
        gc.freeze()
        self.graphs: List[Graph] = []
        self.forwards = 0
        self.backward_since_step = False
        self.operations = 0
        self.weight_name = next(name for name, _ in self.engine.module.named_parameters())
        self.backward_since_zero_grad = False
        self.window_may_be_lost = False  # see _note_dead_backward
        # ZeRO-1: earlier micro-steps of the window wait, unreduced, in param.grad (set after a
        # backward that does not close the window, as zero1_window_sums does)
        self.window_summed = False
        self.rank, self.world = dist.get_rank(), dist.get_world_size()

    # -- operations -------------------------------------------------------------------------

    def forward(self):
        self.forwards += 1
        # Each rank its own inputs; rank 0's are those of the same program on 1 rank.
        seed = 1000 * self.p.seed + self.forwards + 1_000_003 * self.rank
        wants_input_grad = self.p.model_name in FLOAT_INPUT_MODELS and self.rng.random() < 0.5
        no_grad = self.rng.random() < 0.15
        x_e = make_input(self.p.model_name, seed).requires_grad_(wants_input_grad)
        x_r = make_input(self.p.model_name, seed).requires_grad_(wants_input_grad)
        if no_grad:
            # inference_mode: ZeRO-3's releases there leave inference tensors in the params
            context = torch.inference_mode if self.rng.random() < 0.5 else torch.no_grad
            self.p.log.append(f"forward #{self.forwards} under {context.__name__}")
            with context():
                torch.testing.assert_close(self.engine(x_e), self.reference(x_r), **CLOSE)
            return
        label = f"g{self.forwards}"
        self.p.log.append(f"forward {label} (input grad {wants_input_grad})")
        out_e, out_r = self.engine(x_e), self.reference(x_r)
        torch.testing.assert_close(out_e, out_r, **CLOSE)
        self.graphs.append(Graph(label, losses(out_e), losses(out_r), x_e, x_r))

    def backward(self, graph: Graph):
        which = self.rng.randrange(2)
        retain = self.rng.random() < 0.7
        manual = TORCH_STYLE_BACKWARD and self.rng.random() < 0.4
        self.p.log.append(f"backward {graph.label} loss {which} retain={retain} "
                          f"{'loss.backward()' if manual else 'engine.backward'}{' (stale)' if graph.stale else ''}")
        loss_e, loss_r = graph.engine_losses[which], graph.reference_losses[which]

        def on_engine():
            loss_e.backward(retain_graph=retain) if manual else self.engine.backward(loss_e, retain_graph=retain)

        def on_reference():
            # DeepSpeed divides a training backward by gradient_accumulation_steps (the loss in
            # engine.backward, the outputs' gradients in loss.backward(); these losses reach the
            # params only through the outputs, so both are the same).
            (loss_r / self.p.gas if self.p.gas > 1 else loss_r).backward(retain_graph=retain)

        if not self._run_both(graph, on_engine, on_reference, keeps_graph=retain, accumulates=True):
            return
        if not graph.stale:
            self.backward_since_step = True
            self.backward_since_zero_grad = True

    def autograd_grad(self, graph: Graph):
        wrt_input = graph.engine_x.requires_grad and self.rng.random() < 0.6
        which = self.rng.randrange(2)
        retain = self.rng.random() < 0.7
        self.p.log.append(f"autograd.grad {graph.label} loss {which} wrt "
                          f"{'input' if wrt_input else self.weight_name} retain={retain}"
                          f"{' (stale)' if graph.stale else ''}")
        if wrt_input:
            wrt_e, wrt_r = graph.engine_x, graph.reference_x
        else:
            wrt_e = dict(self.engine.module.named_parameters())[self.weight_name]
            wrt_r = dict(self.reference.named_parameters())[self.weight_name]
        got = []
        want = []
        self._run_both(
            graph,
            lambda: got.append(torch.autograd.grad(graph.engine_losses[which], [wrt_e], retain_graph=retain)[0]),
            lambda: want.append(torch.autograd.grad(graph.reference_losses[which], [wrt_r], retain_graph=retain)[0]),
            keeps_graph=retain)
        if want and got:  # neither raised
            torch.testing.assert_close(got[0], want[0], **CLOSE)

    def drop(self, graph: Graph):
        self.p.log.append(f"drop {graph.label}")
        self.graphs.remove(graph)

    def zero_grad(self):
        self.backward_since_zero_grad = False
        self.window_may_be_lost = self.window_summed = False
        self.p.log.append("zero_grad")
        self.engine.zero_grad()
        self.ref_opt.zero_grad()

    def step(self):
        if not self.engine.is_gradient_accumulation_boundary():
            self._step_inside_window()
            return
        if not self.backward_since_step:
            self.p.log.append("step without a backward since the last step: must raise"
                              + (" or apply the window's gradients" if self.p.gas > 1 else ""))
            try:
                if not self._engine_step():
                    return
            except zero_lifetime.StepWithoutBackwardError:
                assert_weights_match(self.engine, self.reference, **CLOSE)
                return
            if self.p.gas == 1:
                raise AssertionError("step() with no backward since the last step did not raise")
            # GAS > 1, ZeRO-3 without offload: the window's earlier micro-steps are applied, as
            # torch's optimizer applies what .grad holds.
            self.p.log.append("  applied the window's gradients")
        else:
            self.p.log.append("step" + ("" if self.backward_since_zero_grad else " (nothing since zero_grad)"))
            if not self._engine_step():
                return
        self._check_boundary_step()

    def _engine_step(self) -> bool:
        """The engine's step() at a boundary; False where it refused on a lost window."""
        try:
            self.engine.step()
        except RuntimeError as error:
            if not self._window_lost(error):
                raise
            assert_weights_match(self.engine, self.reference, **CLOSE)
            return False
        return True

    def _step_inside_window(self):
        """GAS > 1, a step() that does not close the window: nothing changes, the gradients
        stay for the next micro-step (torch: nothing to do)."""
        self.p.log.append("step inside the accumulation window")
        self.engine.step()
        self.backward_since_step = False
        assert_weights_match(self.engine, self.reference, **CLOSE)

    def _check_boundary_step(self):
        self.window_summed = False
        self._average_reference_grads_over_ranks()
        applied = self.engine.was_step_applied()
        skipped_by_torch = any(p.grad is None for p in self.reference.parameters())
        if applied:
            self.ref_opt.step()
        else:
            assert_gradient_norm_overflows(self.reference)
            self.p.log.append("  skipped by DeepSpeed: the gradient norm overflows float32 (torch would step)")
        self.ref_opt.zero_grad()
        self.backward_since_step = False
        for graph in self.graphs if applied else ():  # a skipped step changed no weight
            if not graph.stale:
                graph.stale_on_engine_only = not self.backward_since_zero_grad
                graph.stale_params_skipped_by_torch = skipped_by_torch
            graph.stale = True
        self.backward_since_zero_grad = False
        assert_weights_match(self.engine, self.reference, **CLOSE)

    # -- shared -----------------------------------------------------------------------------

    def _run_both(self, graph: Graph, on_engine, on_reference, keeps_graph: bool, accumulates: bool = False) -> bool:
        """Run on the reference first: where torch raises, the engine must raise as well, and
        the gradients torch accumulated before raising are taken back (the engine's dead
        backward adds nothing on a model this small: every gradient still waits in a bucket),
        except on ZeRO-1 in a micro-step that does not close the window once an earlier one has
        summed into param.grad: the engine keeps what the dead backward reached there, as torch.
        Returns whether both ran."""
        closing = self.engine.is_gradient_accumulation_boundary()
        if graph.stale_on_engine_only:
            try:
                on_engine()
            except RuntimeError as error:
                self.p.log.append(f"  the engine raised: {str(error).splitlines()[0][:90]}")
            else:
                raise AssertionError("a graph saved before an applied step() ran on the engine")
            self.graphs.remove(graph)
            self._note_dead_backward(accumulates, closing)
            return False
        saved_grads = [None if p.grad is None else p.grad.clone() for p in self.reference.parameters()]
        try:
            on_reference()
        except RuntimeError as reference_error:
            # ZeRO-1 keeps what a dead backward reached where param.grad already holds the
            # window's earlier micro-steps (the two cannot be told apart), as torch does. Unless
            # torch's last step skipped params DeepSpeed rewrote: the engine's backward then dies
            # at the first node that saved a param, before any gradient reached a param here,
            # and torch's later.
            if not (accumulates and self.p.stage == 1 and not closing and self.window_summed
                    and not graph.stale_params_skipped_by_torch):
                self._restore_reference_grads(saved_grads)
            try:
                on_engine()
            except RuntimeError:
                pass
            else:
                raise AssertionError(f"torch raised, the engine did not: {reference_error}")
            self.p.log.append(f"  both raised: {str(reference_error).splitlines()[0][:90]}")
            self.graphs.remove(graph)
            self._note_dead_backward(accumulates, closing)
            return False
        try:
            on_engine()
        except RuntimeError as error:
            if self._window_lost(error):
                self._restore_reference_grads(saved_grads)
                return False
            if not (graph.stale_params_skipped_by_torch and "modified by an inplace operation" in str(error)):
                raise
            self._restore_reference_grads(saved_grads)  # as if torch had refused too
            self.p.log.append(f"  the engine raised, torch ran (a param its step skipped): {str(error)[:60]}")
            self.graphs.remove(graph)
            return False
        if not keeps_graph:
            self.graphs.remove(graph)
        if accumulates:
            self.window_summed = not closing
        return True

    def _average_reference_grads_over_ranks(self) -> None:
        """What DeepSpeed reduces to: each gradient's mean over the ranks (the same program on
        every rank leaves the same params without one)."""
        if self.world > 1:
            average_over_ranks([p.grad for p in self.reference.parameters() if p.grad is not None])

    def _restore_reference_grads(self, saved_grads) -> None:
        for p, g in zip(self.reference.parameters(), saved_grads):
            p.grad = g

    def _note_dead_backward(self, accumulates: bool, closing: bool) -> None:
        """ZeRO-1, GAS > 1: a backward dying in the closing micro-step, after DeepSpeed's hooks
        had moved earlier micro-steps' sums into its buckets, loses them; the engine then
        refuses the next backward or step() until zero_grad() (zero1_window_sums)."""
        if accumulates and self.p.stage == 1 and closing and self.window_summed:
            self.window_may_be_lost = True

    def _window_lost(self, error: RuntimeError) -> bool:
        """The engine refused on a lost window: legitimate only after such a dead backward.
        As a user would, drop the window on both (zero_grad) and go on."""
        if "closes the gradient accumulation window" not in str(error):
            return False
        assert self.window_may_be_lost, f"refused on a lost window with no dead backward that could lose it: {error}"
        self.p.log.append("  the engine refused: the dead backward lost part of the window; zero_grad on both")
        self.window_may_be_lost = False
        self.zero_grad()
        return True

    def check_invariants(self):
        if self.p.stage != 3:
            return
        gc.collect()
        gathered, inconsistent = released_state(self.engine)
        assert inconsistent == [], f"released with memory attached: {inconsistent}"
        if gathered:
            self.p.log[-1] += f"  [gathered: {' '.join(gathered)}]"
        if self.p.windows != "eager":
            return
        if self.p.policy == "regather":
            assert gathered == [], f"still gathered under regather: {self._describe_params(gathered)}"
        elif not self.graphs:
            if gathered and self.world > 1:
                gathered = self._gathered_once_other_threads_let_go()
            stats = zero_lifetime.stats(self.engine)
            assert gathered == [], f"gathered with no graph alive: {self._describe_params(gathered)}; {stats}"
            assert stats["live_handles"] == 0 and stats["pinned_bytes"] == 0, stats

    def _gathered_once_other_threads_let_go(self):
        """On 2 ranks gloo's worker thread can hold the last reference to a dropped graph's
        saved params past the drop: destroying a finished all-gather's work, it waits for the
        GIL to free a Python tensor that keeps the graph alive (caught with gdb). Seen under pin
        (ZeRO-3, CPU offload, GAS 2, ckpt_nonreentrant) in about 1 of 100 programs, released
        within 1-3 ms of the main thread sleeping (tests/probe_late_handle_release.py,
        docs/reliability.md). The handles die on that thread; their params are released on this
        one, by the next stats() (test_release_thread.py). Wait for that, up to a second; a leak
        stays and still fails."""
        deadline = time.monotonic() + 1.0
        while zero_lifetime.stats(self.engine)["live_handles"] and time.monotonic() < deadline:
            time.sleep(0.001)
        return released_state(self.engine)[0]

    def _describe_params(self, names) -> str:
        """Each param's ZeRO-3 status and the modules DeepSpeed counts as using it."""
        params = dict(self.engine.module.named_parameters())
        return ", ".join(f"{name} ({params[name].ds_status.name}, active in {sorted(params[name].ds_active_sub_modules)})"
                         for name in names)

    # -- driver -----------------------------------------------------------------------------

    def next_operation(self):
        choices = []
        if len(self.graphs) < MAX_LIVE:
            choices += [self.forward] * 3
        for graph in self.graphs:
            choices += [lambda g=graph: self.backward(g)] * 3
            choices += [lambda g=graph: self.autograd_grad(g)]
            choices += [lambda g=graph: self.drop(g)]
        choices += [self.step] * 2 + [self.zero_grad]
        return self.rng.choice(choices)

    def run(self):
        for _ in range(self.p.length):
            self.next_operation()()
            self.operations += 1
            self.check_invariants()
        while self.graphs:
            self.drop(self.graphs[0])
        self.check_invariants()
        if self.backward_since_step:  # close the window: what it accumulated is compared too
            for _ in range(self.p.gas):
                closes = self.engine.is_gradient_accumulation_boundary()
                self.step()
                if closes:
                    break
        return self


def run_program(model_name: str, stage: int, policy: Optional[str], seed: int, length: int,
                windows: str = "eager", offload: bool = False, gradient_hooks: bool = True,
                gas: int = 1, lr: float = 0.1) -> ProgramRunner:
    program = Program(model_name, stage, policy, seed, length, windows, offload=offload,
                      gradient_hooks=gradient_hooks, gas=gas, lr=lr)
    try:
        return ProgramRunner(program).run()
    except Exception as error:
        raise AssertionError(f"{error}\n{program.describe()}") from error


assert set(FLOAT_INPUT_MODELS) <= set(MODELS)
