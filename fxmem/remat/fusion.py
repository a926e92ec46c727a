"""Inductor's fusion as the planner models it: which values of a graph are never stored.

The step simulator (``graph.liveness.walk``) allocates every op's output, as the eager inner
compiler runs them. Inductor fuses chains of pointwise ops into the kernel of whatever reads
them: a pointwise op whose readers are all pointwise ops or reductions is computed inside their
loops and never stored. Plans whose simulated peaks tie (the backward's peak in ops every plan
runs alike) can then peak quite differently under Inductor (the zoo's conv net: the plan that
keeps least measured 0.80x the one that recomputes least). This model ranks such ties; it is
not a prediction (the report reads Inductor's generated code for that): it does not see
Inductor's reordering, its extern kernels' layouts or its buffer reuse.
"""

from __future__ import annotations

import copy
from typing import Iterable, Sequence

import torch
import torch.fx as fx

from ..graph.joint import is_random
from ..graph.liveness import NodeFacts
from .allowlist import is_view

aten = torch.ops.aten
# Reductions Inductor lowers as loops over their input (a pointwise producer fuses into them).
_REDUCTIONS = {aten.sum, aten.mean, aten.amax, aten.amin, aten.var_mean, aten._log_softmax_backward_data,
               aten._softmax_backward_data}


def _pointwise(n: fx.Node) -> bool:
    return n.op == "call_function" and torch.Tag.pointwise in getattr(n.target, "tags", ()) and not is_random(n)


def _reduction(n: fx.Node) -> bool:
    return n.op == "call_function" and (torch.Tag.reduction in getattr(n.target, "tags", ())
                                        or getattr(n.target, "overloadpacket", None) in _REDUCTIONS)


def fused_away(body: Sequence[fx.Node], outputs: Iterable[fx.Node]) -> set[fx.Node]:
    """The ops of ``body`` never stored: pointwise ops (and views of them) that are not
    ``outputs`` and whose readers in ``body`` are all such ops, pointwise ops or reductions."""
    inside, outs = set(body), set(outputs)
    gone: set[fx.Node] = set()
    for n in reversed(body):
        if n in outs or not (_pointwise(n) or (is_view(n) and n.args and n.args[0] in inside)):
            continue
        users = [u for u in n.users if u in inside or u in outs]
        if users and all(u in inside and (u in gone or _pointwise(u) or _reduction(u)) for u in users):
            gone.add(n)
    changed = True
    while changed:  # a view is never stored only where its source is not
        changed = False
        for n in [n for n in gone if is_view(n) and n.args[0] not in gone]:
            gone.discard(n)
            changed = True
    return gone


def fused_facts(facts: NodeFacts, body: Sequence[fx.Node], gone: set[fx.Node]) -> NodeFacts:
    """``facts`` where each op of ``body`` reads, instead of an op in ``gone``, what that op read
    (its inputs stay alive until the fused kernel has run)."""
    reads: dict[fx.Node, list[fx.Node]] = {}
    for n in body:
        through = []
        for a in facts.reads[n]:
            through.extend(reads[a] if a in gone else [a])
        reads[n] = list(dict.fromkeys(through))
    out = copy.copy(facts)
    out.reads = {**facts.reads, **reads}
    return out
