"""The multi-task loop of the gradient-bucket report, and its plain-torch oracle.

A shared trunk and one head per task. "per_task": one backward per task, GAS = number
of tasks, so the heads of tasks 0 and 1 get gradients only in their own non-boundary
micro-step. "summed": one backward of the summed task losses, GAS 1. Two modes where
a head gets no gradient in a step, so torch leaves it where it is: "sampled" trains
a different subset of the tasks each step; "zero_grad_between" runs two backwards
over one forward with zero_grad() between them, and the second loss never reaches
head 0; "zero_grad_mid_window" (GAS 2) calls zero_grad() between the two micro-steps
of a window, so only the second (which never reaches head 0) counts. "head_per_backward"
(GAS 1): one forward through every head, then one retained backward per head's loss, so
heads 1 and 2 get their first gradient of the step in a later backward. Used by the
1-rank tests and by the 2-rank worker (each rank trains on its own data shard; the
oracle all-reduces plain torch gradients).
"""

import copy

import torch

import deepspeed
from deepspeed.utils import safe_get_full_fp32_param
from harness import backward_both, backward_by

TASKS = 3
LR = 0.1


class MultiTask(torch.nn.Module):

    def __init__(self, tasks: int = TASKS):
        super().__init__()
        self.trunk = torch.nn.Linear(8, 16)
        self.heads = torch.nn.ModuleList(torch.nn.Linear(16, 4) for _ in range(tasks))

    def forward(self, x, task):
        """One head's output, or a tuple of them for a tuple of tasks (one trunk pass)."""
        hidden = torch.tanh(self.trunk(x))
        if isinstance(task, tuple):
            return tuple(self.heads[t](hidden) for t in task)
        return self.heads[task](hidden)


# Every ZeRO stage with and without CPU optimizer offload, and their test ids.
STAGES_OFFLOAD = [(1, False), (1, True), (2, False), (2, True), (3, False), (3, True)]


def stage_id(stage: int, offload: bool) -> str:
    return f"stage{stage}-{'offload' if offload else 'no_offload'}"


STAGE_IDS = [stage_id(s, o) for s, o in STAGES_OFFLOAD]
SAMPLED_TASKS = [(0, 1), (1,), (2, 1), (1,)]  # head 0 only in step 0, head 2 from step 2


def sampled_tasks(step: int):
    return SAMPLED_TASKS[step % len(SAMPLED_TASKS)]


def zero_grad_between_losses(out):
    """Both heads in the first loss; the second (after zero_grad) reaches head 1 only."""
    first, second = out
    return task_loss(first) + task_loss(second), 2 * task_loss(second)


def config(stage: int, mode: str, offload: bool, dtype: str, bucket: int = 100, clip: float = 0.0,
           gas: int = None, comm: str = None):
    """``gas``: the accumulation steps, when not the mode's own; ``comm``: DeepSpeed's
    communication_data_type, when not the model's dtype."""
    zero = {"stage": stage, "contiguous_gradients": True, "overlap_comm": True, "reduce_scatter": True,
            "reduce_bucket_size": bucket}  # tiny: several flushes per backward, trunk.weight (128) bypasses
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": gas or {"per_task": TASKS, "zero_grad_mid_window": 2}.get(mode, 1),
        "optimizer": {"type": "SGD", "params": {"lr": LR}},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": clip,
        "zero_optimization": zero,
    }
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if comm is not None:
        cfg["communication_data_type"] = comm
    return cfg


def batches(step: int, rank: int = 0):
    g = torch.Generator().manual_seed(1000 * step + 17 * rank + 1)
    return [torch.randn(4, 8, generator=g) for _ in range(TASKS)]


def task_loss(out):
    return out.float().pow(2).mean()


def make_models(seed: int = 0):
    torch.manual_seed(seed)
    model = MultiTask()
    return model, copy.deepcopy(model)


def train_engine(engine, mode: str, steps: int, rank: int = 0, dtype: str = "fp32", path: str = "engine"):
    """path: "engine" (engine.backward) or "manual" (loss.backward); per_task and
    zero_grad_mid_window always use engine.backward."""
    cast = (lambda x: x.to(torch.bfloat16)) if dtype == "bf16" else (lambda x: x)
    for step in range(steps):
        xs = batches(step, rank)
        if mode == "per_task":
            for task in range(TASKS):
                engine.backward(task_loss(engine(cast(xs[task]), task)))
                engine.step()
        elif mode == "zero_grad_between":
            backward_both(engine, *zero_grad_between_losses(engine(cast(xs[0]), (0, 1))), path, zero_grad=True)
            engine.step()
        elif mode == "head_per_backward":
            outputs = engine(cast(xs[0]), tuple(range(TASKS)))
            for task, out in enumerate(outputs):
                backward_by(engine, task_loss(out), path, retain_graph=task + 1 < TASKS)
            engine.step()
        elif mode == "zero_grad_mid_window":
            engine.backward(task_loss(engine(cast(xs[0]), 0)) + task_loss(engine(cast(xs[0]), 1)))
            engine.step()  # not a boundary: nothing applied
            engine.zero_grad()
            engine.backward(task_loss(engine(cast(xs[1]), 1)))
            engine.step()
        else:
            tasks = sampled_tasks(step) if mode == "sampled" else range(TASKS)
            loss = sum(task_loss(engine(cast(xs[t]), t)) for t in tasks)  # one forward per task
            backward_by(engine, loss, path)
            engine.step()


def train_reference(model, mode: str, steps: int, rank: int = 0, world: int = 1, clip: float = 0.0):
    """Plain torch SGD; with world > 1 the gradients are all-reduced (averaged) per step."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(steps):
        xs = batches(step, rank)
        if mode == "per_task":
            for task in range(TASKS):  # DeepSpeed scales each micro-step's loss by 1/GAS
                (task_loss(model(xs[task], task)) / TASKS).backward()
        elif mode == "zero_grad_between":
            first, second = zero_grad_between_losses(model(xs[0], (0, 1)))
            first.backward(retain_graph=True)
            opt.zero_grad()  # set_to_none: head 0 gets no gradient, so SGD leaves it
            second.backward()
        elif mode == "head_per_backward":
            outputs = model(xs[0], tuple(range(TASKS)))
            for task, out in enumerate(outputs):
                task_loss(out).backward(retain_graph=task + 1 < TASKS)
        elif mode == "zero_grad_mid_window":  # the first micro-step is dropped; GAS 2 halves the loss
            (task_loss(model(xs[1], 1)) / 2).backward()
        else:
            tasks = sampled_tasks(step) if mode == "sampled" else range(TASKS)
            sum(task_loss(model(xs[t], t)) for t in tasks).backward()
        if world > 1:
            for p in model.parameters():
                if p.grad is not None:
                    torch.distributed.all_reduce(p.grad)
                    p.grad /= world
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()


def build_engine(model, stage: int, mode: str, offload: bool, dtype: str, clip: float = 0.0, gas: int = None,
                 comm: str = None):
    engine, *_ = deepspeed.initialize(model=model, config=config(stage, mode, offload, dtype, clip=clip, gas=gas,
                                                                 comm=comm),
                                      model_parameters=model.parameters())
    return engine


def engine_weights(engine):
    return {name: safe_get_full_fp32_param(p).detach().float().clone()
            for name, p in engine.module.named_parameters()}


def max_differences(engine, reference):
    got = engine_weights(engine)
    return {name: (got[name] - p.detach()).abs().max().item() for name, p in reference.named_parameters()}


def tolerance(dtype: str) -> float:
    return 2e-2 if dtype == "bf16" else 1e-5
