"""``make_functional``: a module as a function of its parameters, for ``torch.func``.

    fn, trainable, frozen = make_functional(model)        # trainable: requires_grad parameters
    def loss_fn(trainable, frozen, ids, labels):
        return fn(trainable, frozen, ids[None], labels=labels[None]).loss
    grad_fn = clipped_grad(loss_fn, 1.0, batch_argnums=(2, 3))   # per-example grads: trainable only
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from torch.func import functional_call

__all__ = ["make_functional"]


def make_functional(model: nn.Module, partition_trainable: bool = True
                    ) -> tuple[Callable[..., Any], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``(fn, trainable, frozen)`` with ``fn(trainable, frozen, *args, **kwargs)`` =
    ``torch.func.functional_call(model, {**frozen, **trainable}, args, kwargs)``.

    ``partition_trainable=True``: ``trainable`` holds the parameters with ``requires_grad``
    (e.g. LoRA adapters), ``frozen`` the other parameters and every buffer.
    ``partition_trainable=False``: every parameter is trainable, ``frozen`` holds the buffers.

    The dicts hold the module's own tensors (not copies), so an optimizer stepping the module's
    parameters is seen by the next call; tied parameters appear once (under their first name).
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"make_functional: model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(partition_trainable, bool):
        raise ValueError(f"make_functional: partition_trainable must be True or False, got {partition_trainable!r}")
    trainable: dict[str, torch.Tensor] = {}
    frozen: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        (trainable if (p.requires_grad or not partition_trainable) else frozen)[name] = p
    for name, b in model.named_buffers():
        frozen[name] = b

    def fn(trainable_params: dict[str, torch.Tensor], frozen_params: dict[str, torch.Tensor],
           *args: Any, **kwargs: Any) -> Any:
        return functional_call(model, {**frozen_params, **trainable_params}, args, kwargs)

    fn.__name__ = f"functional_{type(model).__name__}"
    return fn, trainable, frozen
