"""The physical floor of a training step: what any recompute plan of a layered model must hold.

    floor = max(parameter gradients, layer boundaries + max(one layer's working set, the loss's working set))

- parameter gradients: every trainable parameter's gradient (all are alive when the step ends);
- layer boundaries: one hidden-state input per layer (what ``torch.utils.checkpoint`` keeps);
- one layer's working set: the peak of one layer's forward and backward run alone on its
  boundary input (the incoming and the outgoing gradient included, its parameters' gradients not:
  they are counted above), the largest over the model's layer stacks;
- the loss's working set: the peak of a step of the model with its layers taken out (embeddings,
  final norm, head, loss), its parameters' gradients not counted.

Measured in eager PyTorch with ``fxmem.profiling.step_perf`` (exact allocator events), dropout as
the model has it. Every gradient is alive when the step ends; while the loss's backward or a
layer's recompute runs, the boundaries of the layers below are alive (and only the gradients
computed so far): a layerwise plan cannot peak below either. The working sets enter as their
``max``: a layerwise plan runs them one after the other, never both at once. The sum of the four
terms counts what is never alive at once (on a 12-layer Llama it is above HF checkpointing's
measured peak). The working sets are eager's: fused kernels (the lowered cross-entropy,
Inductor's fusions) and a planner that frees earlier go below them. ``bench/run.py`` reports it
as the ``floor`` configuration, its four terms in the check column.
"""

from __future__ import annotations

import copy
import gc
from typing import Any, Callable

import torch
import torch.nn as nn

from fxmem.profiling import step_perf


def layer_stacks(model: nn.Module) -> list[tuple[nn.Module, str, nn.ModuleList]]:
    """(parent, attribute, ModuleList) for each stack of repeated layers: a ModuleList of two or
    more modules of one class that have parameters, not nested in another such stack."""
    stacks, inside = [], set()
    for name, m in model.named_modules():
        if any(name.startswith(p + ".") for p in inside):
            continue
        if isinstance(m, nn.ModuleList) and len(m) >= 2 and len({type(c) for c in m}) == 1 \
                and any(True for _ in m[0].parameters()):
            parent_name, _, attr = name.rpartition(".")
            stacks.append((model.get_submodule(parent_name), attr, m))
            inside.add(name)
    return stacks


def _grad_bytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params if p.requires_grad)


def _peak(fn: Callable[[], Any], device: str) -> int:
    gc.collect()
    with step_perf(device) as perf:
        fn()
    return perf.result.peak_bytes


def _first_inputs(model: nn.Module, layer: nn.Module, batch: dict) -> tuple[tuple, dict]:
    """The arguments ``layer`` is called with in one forward of ``model`` (no grad)."""
    seen: list[tuple[tuple, dict]] = []
    handle = layer.register_forward_pre_hook(lambda _m, a, k: seen.append((a, k)) if not seen else None,
                                             with_kwargs=True)
    try:
        with torch.no_grad():
            model(**batch)
    finally:
        handle.remove()
    if not seen:
        raise ValueError(f"floor: {type(layer).__name__} was not called by the model's forward")
    return seen[0]


def _layer_working_set(model: nn.Module, layer: nn.Module, batch: dict, device: str) -> tuple[int, int]:
    """(boundary bytes, working-set bytes) of one layer: its hidden-state input, and the peak of its
    forward + backward on that input with its parameters' gradients taken off."""
    args, kwargs = _first_inputs(model, layer, batch)
    if args and isinstance(args[0], torch.Tensor):
        x, call = args[0], lambda xi: layer(xi, *args[1:], **kwargs)
    elif isinstance(kwargs.get("hidden_states"), torch.Tensor):
        x, call = kwargs["hidden_states"], lambda xi: layer(*args, **{**kwargs, "hidden_states": xi})
    else:
        raise ValueError(f"floor: cannot find the hidden-state input of {type(layer).__name__}")

    def step():
        out = call(x.detach().requires_grad_(x.is_floating_point()))
        out = out[0] if isinstance(out, (tuple, list)) else out
        out.backward(torch.ones_like(out))

    layer.zero_grad(set_to_none=True)
    step()  # warm-up: lazily built buffers (rotary caches, masks) are not the working set
    layer.zero_grad(set_to_none=True)
    peak = _peak(step, device)
    layer.zero_grad(set_to_none=True)
    return x.numel() * x.element_size(), max(0, peak - _grad_bytes(layer.parameters()))


def _loss_working_set(model: nn.Module, loss: Callable, batch: dict, device: str) -> int:
    """The peak of a step of ``model`` with every layer stack emptied, its gradients not counted."""
    bare = copy.deepcopy(model)
    for parent, attr, _ in layer_stacks(bare):
        setattr(parent, attr, nn.ModuleList())
    bare.zero_grad(set_to_none=True)
    loss(bare(**batch)).backward()  # warm-up
    bare.zero_grad(set_to_none=True)
    peak = _peak(lambda: loss(bare(**batch)).backward(), device)
    return max(0, peak - _grad_bytes(bare.parameters()))


def physical_floor(model: nn.Module, loss: Callable, batch: dict, device: str = "cpu") -> dict[str, int]:
    """The floor's four terms and ``total`` (bytes), for ``loss(model(**batch)).backward()``."""
    stacks = layer_stacks(model)
    if not stacks:
        raise ValueError(f"floor: {type(model).__name__} has no stack of repeated layers (a ModuleList of one "
                         "class with parameters)")
    boundaries, layer_ws = 0, 0
    for _, _, layers in stacks:
        b, w = _layer_working_set(model, layers[0], batch, device)
        boundaries += b * len(layers)
        layer_ws = max(layer_ws, w)
    terms = {"grads": _grad_bytes(model.parameters()), "boundaries": boundaries, "layer_working_set": layer_ws,
             "loss_working_set": _loss_working_set(model, loss, batch, device)}
    model.zero_grad(set_to_none=True)
    total = max(terms["grads"], terms["boundaries"] + max(terms["layer_working_set"], terms["loss_working_set"]))
    return {**terms, "total": total}
