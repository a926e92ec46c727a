"""The graph pass of ``step_in_backward`` (see the package): a split's backward rewritten so that
each parameter gradient goes to ``fxmem::step_in_backward`` where it is made."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import torch
import torch.fx as fx
from torch import Tensor

from ..graph.liveness import storage_roots
from . import runtime


@dataclass(frozen=True)
class Rewritten:
    """What :func:`rewrite` did to one backward: the keys it updates, in graph order."""
    keys: tuple[int, ...]

    def names(self) -> list[str]:
        return [runtime.slot(k).name for k in self.keys]


def rewrite(fw: fx.GraphModule, bw: fx.GraphModule, keys: Mapping[int, int], in_order: bool = True) -> Rewritten:
    """``bw`` (in place) with each gradient of a graph input in ``keys`` (input index -> key)
    handed to ``fxmem::step_in_backward`` and None returned in its place. The op is placed
    after the gradient and after the last read of any backward value sharing the parameter's
    storage (the parameter itself, views of it the forward saved, views of those). Unless the
    inner compiler runs the graph ``in_order``, the op also takes what those reads computed."""
    out = bw.graph.output_node()
    descs = out.meta.get("desc")
    grads = list(out.args[0])
    if not keys or descs is None or len(descs) != len(grads):
        return Rewritten(())
    fw_nodes = {n.name: n for n in fw.graph.nodes}
    fw_root = storage_roots(fw)
    bw_root = storage_roots(bw)
    order = {n: i for i, n in enumerate(bw.graph.nodes)}

    def input_index(n: fx.Node) -> int | None:
        """The graph input whose storage a backward placeholder shares, or None."""
        src = fw_nodes.get(n.name)
        if src is None:
            return None
        root = fw_root.get(src, src)
        return _input_index(root.meta.get("desc")) if root.op == "placeholder" else None

    views: dict[int, list[fx.Node]] = {}  # input index -> backward nodes sharing its storage
    for p in bw.graph.find_nodes(op="placeholder"):
        i = input_index(p)
        if i is not None:
            views.setdefault(i, []).append(p)
    sharing: dict[int, set[fx.Node]] = {}
    placeholders_of = {p: i for i, ps in views.items() for p in ps}
    for n, root in bw_root.items():
        if root in placeholders_of:
            sharing.setdefault(placeholders_of[root], set()).add(n)
    done = []
    for pos, (grad, desc) in enumerate(zip(grads, descs)):
        i = _grad_of(desc)
        if not isinstance(grad, fx.Node) or i not in keys:
            continue
        views_of = sharing.get(i, set())
        readers = {u for n in views_of for u in n.users if u.op != "output" and u not in views_of}
        after = max([grad, *readers], key=order.__getitem__)
        with bw.graph.inserting_after(after):
            node = bw.graph.call_function(torch.ops.fxmem.step_in_backward.default,
                                          (grad, [] if in_order else _tensors(readers, order), keys[i]))
        node.meta["val"] = None
        slot = runtime.slot(keys[i])
        node.meta["scratch_per_byte"], node.meta["scratch_block"] = slot.owner.scratch_bytes(slot.param)
        order[node] = order[after] + 0.5
        grads[pos] = None
        done.append((order[node], keys[i]))
    if done:
        out.args = (tuple(grads),)
        bw.graph.lint()
        bw.recompile()
    return Rewritten(tuple(k for _, k in sorted(done)))


def released_outputs(joint: Any, inputs: frozenset[int]) -> frozenset[fx.Node]:
    """The joint graph's backward outputs that are gradients of ``inputs`` (graph input indices):
    with ``step_in_backward`` they die where they are made, which the planner's simulator counts."""
    descs = joint.gm.graph.output_node().meta.get("desc")
    if not inputs or descs is None:
        return frozenset()
    grads = descs[len(joint.fwd_outputs):]
    return frozenset(o for o, d in zip(joint.bwd_outputs, grads) if isinstance(o, fx.Node) and _grad_of(d) in inputs)


def _tensors(nodes: Iterable[fx.Node], order: Mapping[fx.Node, float]) -> list[fx.Node]:
    """The tensors ``nodes`` compute (an op returning several: its getitems), in graph order."""
    out = []
    for n in nodes:
        out += [n] if isinstance(n.meta.get("val"), Tensor) else \
            [u for u in n.users if isinstance(u.meta.get("val"), Tensor)]
    return sorted(set(out), key=order.__getitem__)


def _input_index(desc: Any) -> int | None:
    idx = getattr(desc, "idx", None)
    return idx if type(desc).__name__ == "PlainAOTInput" and isinstance(idx, int) else None


def _grad_of(desc: Any) -> int | None:
    return _input_index(getattr(desc, "grad_of", None))
