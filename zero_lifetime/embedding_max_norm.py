"""Embeddings with ``max_norm`` under ZeRO: a warning at install.

torch renormalizes the looked-up rows of such a weight in place during the forward
(``torch.embedding_renorm_``). Under ZeRO the change lands in the working copy of the weight:
ZeRO-1/2's params, which ``step()`` overwrites from the optimizer's master weights, or ZeRO-3's
gathered copy, which the release drops. The rows are never renormalized for good, and
training ends off torch without an error, stock and installed (docs/upstream.md, entry 19).
Neither is changed here: only said, once, at install.
"""

import warnings

import torch

_EMBEDDINGS = (torch.nn.Embedding, torch.nn.EmbeddingBag)


def renormalizing_embeddings(model) -> list:
    """The embeddings whose renormalization ZeRO loses, described: those with ``max_norm`` whose
    weight the optimizer updates. (A frozen one keeps it on ZeRO-1/2, which leave it out of
    their buffers, and on 1-rank ZeRO-3, which does not gather there. On 2 ranks ZeRO-3 loses it
    from the weight, but every lookup renormalizes the same rows alike, so what trains is
    torch's: not warned; tests/test_two_ranks.py.)"""
    return [f"'{name}' ({type(module).__name__}, max_norm={module.max_norm})" for name, module in model.named_modules()
            if isinstance(module, _EMBEDDINGS) and module.max_norm is not None and module.weight.requires_grad]


def warn_if_renormalizing_embeddings(model, zero_stage: int) -> None:
    described = renormalizing_embeddings(model)
    if described:
        warnings.warn(
            f"zero_lifetime: ZeRO stage {zero_stage} loses the renormalization of {', '.join(described)}: "
            "the forward renormalizes the rows it looks up in a working copy of the weight that "
            f"{'the release drops' if zero_stage == 3 else 'step() overwrites from the master weights'}, "
            "so they are never renormalized for good and training departs from torch's, stock DeepSpeed "
            "as well (a change made to the params after step() is overwritten the same way). Drop max_norm; "
            "normalizing the looked-up vectors in the forward is a differentiable alternative.",
            RuntimeWarning, stacklevel=3)
