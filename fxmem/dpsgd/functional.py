"""``make_functional``: a module as a function of its parameters, for ``torch.func``.

    fn, trainable, frozen = make_functional(model)        # trainable: requires_grad parameters
    def loss_fn(trainable, frozen, ids, labels):
        return fn(trainable, frozen, ids[None], labels=labels[None]).loss
    grad_fn = clipped_grad(loss_fn, 1.0, batch_argnums=(2, 3))   # per-example grads: trainable only

As :func:`~fxmem.dpsgd.make_private` does, ``make_functional`` validates the module (BatchNorm and
the other modules DP-SGD cannot train raise :class:`~fxmem.dpsgd.UnsupportedModuleError`, naming
them and ``fxmem.dpsgd.fix()``) and computes plain ``nn.RNN``/``nn.GRU``/``nn.LSTM`` as their
cell loops (:func:`~fxmem.dpsgd.rnn.shadow`): the user's module is not changed.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from torch.func import functional_call

from .rnn import shadow
from .validate import validate

__all__ = ["make_functional"]

_FUSED_RNNS = (nn.RNN, nn.GRU, nn.LSTM)  # what shadow() computes as LoopRNN


def make_functional(model: nn.Module, partition_trainable: bool = True, strict: bool = True
                    ) -> tuple[Callable[..., Any], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``(fn, trainable, frozen)`` with ``fn(trainable, frozen, *args, **kwargs)`` =
    ``torch.func.functional_call(model, {**frozen, **trainable}, args, kwargs)``.

    ``partition_trainable=True``: ``trainable`` holds the parameters with ``requires_grad``
    (e.g. LoRA adapters), ``frozen`` the other parameters and every buffer.
    ``partition_trainable=False``: every parameter is trainable, ``frozen`` holds the buffers.

    The dicts hold the module's own tensors (not copies), so an optimizer stepping the module's
    parameters is seen by the next call; tied parameters appear once (under their first name).

    ``fn`` computes every plain ``nn.RNN``/``nn.GRU``/``nn.LSTM`` as its cell loop (``LoopRNN``
    on the same parameters, as :func:`~fxmem.dpsgd.make_private` differentiates them): their
    fused kernels cannot run under ``vmap`` (RNN, GRU) or break the Dynamo graph (LSTM). The
    module itself is not changed (its parameters, names and ``state_dict`` stay), so no
    ``fix()`` is needed for them. ``strict``: raise :class:`~fxmem.dpsgd.UnsupportedModuleError`
    for the modules DP-SGD cannot train (:func:`~fxmem.dpsgd.validate`: BatchNorm,
    InstanceNorm with running statistics), naming each and ``fxmem.dpsgd.fix()``.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"make_functional: model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(partition_trainable, bool):
        raise ValueError(f"make_functional: partition_trainable must be True or False, got {partition_trainable!r}")
    if not isinstance(strict, bool):
        raise ValueError(f"make_functional: strict must be True or False, got {strict!r}")
    view = shadow(model)  # the module fn computes: RNNs as their cell loops, every tensor shared
    if strict:
        validate(view, raise_errors=True)
    trainable: dict[str, torch.Tensor] = {}
    frozen: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        (trainable if (p.requires_grad or not partition_trainable) else frozen)[name] = p
    for name, b in model.named_buffers():
        frozen[name] = b

    slots, edges, copies = _slots(view), _edges(model), _copies(model, view)
    known = frozenset(key for _, _, key in slots)

    def fn(trainable_params: dict[str, torch.Tensor], frozen_params: dict[str, torch.Tensor],
           *args: Any, **kwargs: Any) -> Any:
        values = {**frozen_params, **trainable_params}
        if not values.keys() <= known or any(children.get(name) is not child for children, name, child in edges):
            # names the module does not have, or a submodule replaced since: torch's own walk
            return functional_call(shadow(model) if copies else model, values, args, kwargs)
        for state, copied in copies:  # train()/eval() since make_functional
            if copied.training != state["training"]:
                copied.training = state["training"]
        saved = []
        try:
            for tensors, attr, key in slots:
                if key in values:
                    saved.append((tensors, attr, tensors[attr]))
                    tensors[attr] = values[key]
            return view(*args, **kwargs)
        finally:
            for tensors, attr, original in reversed(saved):
                tensors[attr] = original

    fn.__name__ = f"functional_{type(model).__name__}"
    return fn, trainable, frozen


def _copies(model: nn.Module, view: nn.Module) -> list[tuple[dict, nn.Module]]:
    """``(module.__dict__, its copy in view)`` for every module that
    :func:`~fxmem.dpsgd.rnn.shadow` copied (the RNNs' LoopRNNs and their ancestors): ``fn``
    gives each copy its original's ``training`` flag (dropout between RNN layers follows
    ``model.train()``/``eval()``). The flag is read from the instance dict: Dynamo refuses to
    wrap an ``nn.RNN``/``nn.GRU``/``nn.LSTM`` object at all (a graph break, ``allow_rnn``)."""
    pairs = zip(model.named_modules(remove_duplicate=False), view.named_modules(remove_duplicate=False))
    return [(vars(m), v) for (_, m), (_, v) in pairs if m is not v]


def _slots(model: nn.Module) -> list[tuple[dict, str, str]]:
    """Where each parameter and buffer lives: ``(table, attribute, key)``, ``table`` the owning
    module's own ``_parameters`` or ``_buffers`` dict, one per name under which the module
    reaches the tensor (a tied weight's every name, keyed by its first, as
    ``functional_call(..., tie_weights=True)`` ties them).

    ``fn`` swaps the tensors into these slots itself, as ``functional_call`` does, from a list
    made once here: ``functional_call`` walks the module tree and its name maps on every call,
    and Dynamo traces that walk each time it compiles ``clipped_grad``'s step (the first call's
    cost: bench/results/dpsgd-first-call.md)."""
    first: dict[int, str] = {}
    slots = []
    for table, named in (("_parameters", model.named_parameters), ("_buffers", model.named_buffers)):
        for name, tensor in named(remove_duplicate=False):
            key = first.setdefault(id(tensor), name)
            prefix, _, attr = name.rpartition(".")
            slots.append((getattr(model.get_submodule(prefix), table), attr, key))
    return slots


def _edges(model: nn.Module) -> list[tuple[dict, str, nn.Module]]:
    """Every ``(parent._modules, name, child)`` of the module tree: ``fn`` checks them (a dict
    lookup each) so that a submodule replaced after ``make_functional`` is never trained
    through stale slots. Not the edges to a plain ``nn.RNN``/``nn.GRU``/``nn.LSTM``: Dynamo
    refuses to wrap one (a graph break), so replacing one of those after ``make_functional``
    is not seen (call ``make_functional`` again)."""
    return [(parent._modules, name, child) for parent in model.modules() for name, child in parent._modules.items()
            if child is not None and type(child) not in _FUSED_RNNS]
