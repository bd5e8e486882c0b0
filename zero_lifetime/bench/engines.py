"""DeepSpeed engines and models for the benchmarks (DeepSpeed imported only when a bench needs it)."""

from __future__ import annotations

import contextlib
import copy
import io
import logging
import os
import warnings

import torch


def prepare_process(device: str) -> None:
    """Environment for a one-rank run on ``device``; must run before deepspeed is imported."""
    from ..single_rank import single_rank_env
    os.environ["DS_ACCELERATOR"] = "cuda" if device == "cuda" else "cpu"
    single_rank_env()


def quiet_deepspeed() -> None:
    """DeepSpeed's info logging off, and torch's deprecation notes for the collectives
    DeepSpeed itself calls (nothing a user of this process can change)."""
    import deepspeed  # noqa: F401  (its import sets the logger's level; lower it afterwards)
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=FutureWarning,
                            message=r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated")


class ParamBlock(torch.nn.Module):
    """One module owning ``n`` params of ``numel`` elements: what ZeRO-3 fetches and releases as a unit."""

    def __init__(self, n: int, numel: int):
        super().__init__()
        for i in range(n):
            self.register_parameter(f"w{i}", torch.nn.Parameter(torch.randn(numel) * 0.01))

    def forward(self, x):
        return sum(x * p.sum() for p in self.parameters())


class TinyTransformer(torch.nn.Module):

    def __init__(self, layers: int, width: int, vocab: int = 512):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, width)
        layer = torch.nn.TransformerEncoderLayer(width, nhead=4, dim_feedforward=4 * width, batch_first=True,
                                                 dropout=0.0)
        self.blocks = torch.nn.ModuleList(copy.deepcopy(layer) for _ in range(layers))
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, tokens):
        h = self.emb(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def make_engine(model: torch.nn.Module, stage: int = 3, gas: int = 1, **zero):
    """A fresh engine on a copy of ``model``: stock and installed engines start from the same
    weights. ``gas``: gradient accumulation steps; ``zero``: zero_optimization settings."""
    import deepspeed
    cfg = {
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "SGD", "params": {"lr": 1e-3}},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": stage,
                              **({"stage3_param_persistence_threshold": 0} if stage == 3 else {}), **zero},
    }
    # 0.17.6 prints ZeRO-3's persistent-param statistics with print(), between the bench's tables;
    # what it printed is shown after all when initialize fails.
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            engine, *_ = deepspeed.initialize(model=copy.deepcopy(model), config=cfg)
    except BaseException:
        print(printed.getvalue(), end="")
        raise
    return engine


def coordinator(engine):
    return engine.optimizer.parameter_offload.get_param_coordinator()


def discard(engine) -> None:
    """Uninstall (if installed) and destroy ``engine``, and let go of what stock DeepSpeed keeps of
    a destroyed ZeRO-3 engine: else its model and partitions stay alive to the end of the run,
    growing with the sweep (``benchmarks/experiments/bench_leftovers.py`` counts them)."""
    import zero_lifetime
    zero_lifetime.uninstall(engine)
    release = None
    if int(engine.zero_optimization_stage()) == 3:
        from ..adapters.zero3_teardown import release_after_destroy
        release = release_after_destroy(engine)
    engine.destroy()
    if release is not None:
        release()
