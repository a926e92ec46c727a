"""Bytes a lowering saves: what autograd keeps for backward from the matched subgraph minus what
the fused replacement keeps, both run on meta tensors at the compiled shape (every float input
requiring grad). Tensors the pattern did not create (its inputs, parameters) are not counted:
they exist whatever the pattern does. Inside a ``vmap`` region the per-example figure is
multiplied by the batch size. Under autocast both run on fake tensors of the values' device
inside the same autocast (meta tensors have no autocast), so the unfused ops keep autocast's
casts as they will when AOTAutograd traces them."""
from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import optimization_hint as hint_int

from ..graph.module import graph_module
from .match import val

log = logging.getLogger("fxmem")


def _meta(v: Any, device: str | None = "meta") -> Any:
    """A fresh tensor like ``v`` at its hinted shape (on ``device``; None: ``v``'s own); SymInts,
    also inside a size list, as their hints."""
    if isinstance(v, (list, tuple)):  # e.g. a view's size, [batch, seq, hidden] with symbolic dims
        return type(v)(_meta(x, device) for x in v) if not hasattr(v, "_fields") else v
    if isinstance(v, torch.SymInt):
        return hint_int(v)
    if isinstance(v, torch.Tensor):
        shape = [hint_int(s) if isinstance(s, torch.SymInt) else int(s) for s in v.shape]
        t = torch.empty(shape, dtype=v.dtype, device=device or v.device)
        return t.requires_grad_(True) if t.is_floating_point() else t
    return v


def _kept_bytes(run: Callable[[], Any], inputs: list) -> int:
    """Bytes of distinct storages autograd saves while ``run`` runs, inputs' storages excluded."""
    exclude = {t.untyped_storage()._cdata for t in inputs if isinstance(t, torch.Tensor)}
    kept: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s._cdata not in exclude:
            kept[s._cdata] = s.nbytes()
        return t

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(kept.values())


def _subgraph(nodes: list[fx.Node], output: fx.Node) -> tuple[fx.GraphModule, list[fx.Node]]:
    inside = set(nodes)
    inputs = list(dict.fromkeys(a for n in nodes for a in n.all_input_nodes if a not in inside))
    g = fx.Graph()
    env = {a: g.placeholder(f"in{i}") for i, a in enumerate(inputs)}
    for n in nodes:
        env[n] = g.node_copy(n, env.__getitem__)
    g.output(env[output])
    return graph_module(torch.nn.Module(), g), inputs


def _under(autocast: dict | None):
    """Where the estimate runs: meta tensors, or fake ones inside ``autocast`` (device -> dtype)."""
    if not autocast:
        return contextlib.nullcontext(), "meta"
    from torch._subclasses.fake_tensor import FakeTensorMode

    stack = contextlib.ExitStack()
    stack.enter_context(FakeTensorMode())
    for device, dtype in autocast.items():
        stack.enter_context(torch.autocast(device, dtype=dtype))
    return stack, None


def bytes_saved(nodes: list[fx.Node], output: fx.Node, call: Callable, args: tuple, kwargs: dict,
                batch: int = 1, autocast: dict | None = None) -> int | None:
    """Saved-for-backward bytes of ``nodes`` (computing ``output``) minus those of
    ``call(*args, **kwargs)``; None when either cannot run on meta (fake) tensors. ``autocast``:
    the autocast on where they run (device type -> dtype)."""
    try:
        context, device = _under(autocast)
        with context:
            gm, inputs = _subgraph(nodes, output)
            before_in = [_meta(val(a), device) for a in inputs]
            # gm.forward, not gm(): GraphModule.__call__ prints a traceback to stderr when it raises
            before = _kept_bytes(lambda: gm.forward(*before_in), before_in)
            meta: dict[fx.Node, Any] = {}
            after_args = fx.node.map_arg(args, lambda a: meta.setdefault(a, _meta(val(a), device)))
            after_kwargs = fx.node.map_arg(kwargs, lambda a: meta.setdefault(a, _meta(val(a), device)))
            after = _kept_bytes(lambda: call(*after_args, **after_kwargs), list(meta.values()))
    except Exception as e:  # the estimate is informative only: never fail a compile for it
        log.debug("fxmem lowering: no saved-bytes estimate for %s: %s", output.name, e)
        return None
    return (before - after) * batch
