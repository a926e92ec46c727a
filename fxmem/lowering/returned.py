"""Logits returned beside a fused loss get their gradient outside the compiled graph.

An HF causal LM returns its logits as well as the loss; the fused cross-entropy reads them
(computed once, :func:`.functions.returned_logits`). As a differentiable output of the compiled
graph they would get a tangent: AOTAutograd's backward takes one gradient per differentiable
output, and autograd materializes an undefined one as zeros, so a step that differentiates the
loss only would hold a [tokens, vocab] zero buffer through the loss's backward (196 MiB for GPT-2
at 1024 tokens), and the logits' backward would run two vocabulary-sized matmuls of zeros.

So a graph compiled whole returns them without a gradient (:func:`.functions.detached_logits`),
and returns the operands they were computed from that the caller does not pass in (the hidden
states; the weight and biases are usually graph inputs); :func:`reattached` wraps the compiled
callable so that the caller gets the logits back through :class:`Reattached`, an autograd node
whose backward (the linear's, :func:`.functions.linear_backward`) runs only when the caller's
loss reads the logits. The hidden states' own tangent is what is left: [tokens, hidden] zeros.

    specs = detach(graph)            # after lowering: the graph's outputs extended
    fn = reattached(compiled, specs)  # the callable Dynamo gets: the graph's original outputs
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
import torch.fx as fx

from . import functions as fn
from .splice import is_mark

# node meta a replacement node takes from the node it stands for
KEEP_META = ("example_value", "stack_trace", "nn_module_stack")
ARG, OUT = "arg", "out"  # where an operand comes from at run time: a graph input, an extra output


@dataclass(frozen=True)
class Spec:
    """One returned logits output: its position among the graph's original outputs, and where
    each operand of the linear (h, weight, bias, logit bias; None: absent) is found at run time:
    ``(ARG, placeholder index)`` or ``(OUT, index among the extra outputs)``."""
    index: int
    operands: tuple[Optional[tuple[str, int]], ...]
    dtype: Optional[torch.dtype]
    outputs: int  # the graph's original output count


# what a graph compiled whole returns instead: the logits without a gradient
_DETACHED = {fn.returned_logits: fn.detached_logits, fn.returned_alias: fn.detached_alias}


def alias(graph: fx.Graph, logits: fx.Node, operands: tuple, kwargs: dict) -> bool:
    """Route the graph's output use of ``logits`` (an unfused loss reads them too) through
    :func:`.functions.returned_alias` of the linear's ``operands``, for :func:`detach`; whether
    the graph returns them."""
    outputs = [u for u in logits.users if u.op == "output"]
    if not outputs:
        return False
    with graph.inserting_after(logits):
        node = graph.call_function(fn.returned_alias, (logits, *operands), kwargs)
    node.meta.update({k: logits.meta[k] for k in KEEP_META if k in logits.meta})
    for out in outputs:
        out.replace_input_with(logits, node)
    return True


def detach(graph: fx.Graph) -> list[Spec]:
    """Rewrite each :func:`.functions.returned_logits` (:func:`.functions.returned_alias`) call
    that the graph returns (directly or through a compared region's mark) into
    :func:`.functions.detached_logits` (:func:`.functions.detached_alias`), and append the
    operands that are not graph inputs to the graph's outputs. A graph whose output is not a
    flat tuple is left as it is (its logits stay differentiable)."""
    out = next(iter(graph.find_nodes(op="output")))
    values = out.args[0]
    if not isinstance(values, (tuple, list)):
        return []
    places = {p: i for i, p in enumerate(graph.find_nodes(op="placeholder"))}
    outputs, extra, specs = list(values), [], []
    for i, v in enumerate(values):
        call = v.args[0] if isinstance(v, fx.Node) and is_mark(v) else v
        if not (isinstance(call, fx.Node) and call.op == "call_function" and call.target in _DETACHED):
            continue
        args = call.args[1:] if call.target is fn.returned_alias else call.args  # (logits, *operands)
        operands = []
        for a in (*args, *[None] * (4 - len(args)))[:4]:
            a = a.args[0] if isinstance(a, fx.Node) and is_mark(a) else a  # a compared region's input: the value
            if a is None:
                operands.append(None)
            elif a in places:
                operands.append((ARG, places[a]))
            else:
                operands.append((OUT, len(extra)))
                extra.append(a)
        call.target = _DETACHED[call.target]
        specs.append(Spec(i, tuple(operands), call.kwargs.get("dtype"), len(values)))
    if specs:
        out.args = (type(values)(outputs + extra),)
    return specs


class Reattached(torch.autograd.Function):
    """The compiled graph's detached logits, given the gradient of the linear that computed them
    (from its operands, in the dtype it ran in). Nothing is computed unless the caller
    differentiates the logits: autograd then calls :meth:`backward` with their gradient."""

    @staticmethod
    def forward(logits, h, weight, bias, logit_bias, dtype):
        return logits.view_as(logits)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, h, weight, bias, logit_bias, ctx.dtype = inputs
        ctx.save_for_backward(h, weight, bias, logit_bias)

    @staticmethod
    def backward(ctx, grad):
        h, weight, bias, logit_bias = ctx.saved_tensors
        need = tuple(ctx.needs_input_grad[1:5])
        return (None, *fn.linear_backward(grad, h, weight, bias, logit_bias, ctx.dtype, need), None)


def reattached(compiled: Callable, specs: Sequence[Spec]) -> Callable:
    """``compiled`` (the graph :func:`detach` rewrote) returning the graph's original outputs, the
    logits reattached to their operands' autograd graph."""
    if not specs:
        return compiled
    count = specs[0].outputs

    def run(*args: Any) -> Any:
        outs = compiled(*args)
        kept, extra = list(outs[:count]), outs[count:]
        for s in specs:
            ops = [None if o is None else (args[o[1]] if o[0] == ARG else extra[o[1]]) for o in s.operands]
            kept[s.index] = Reattached.apply(kept[s.index], *ops, s.dtype)
        return type(outs)(kept) if isinstance(outs, tuple) else kept

    run.__wrapped__ = compiled
    return run
