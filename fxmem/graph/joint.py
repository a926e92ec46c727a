"""The regions of an AOTAutograd joint forward/backward graph.

A joint graph takes ``primals`` (forward inputs) and ``tangents`` (incoming output gradients) and
returns the forward outputs followed by the input gradients. Nodes fall in three groups:

- *forward*: ancestors of a forward output (they must run in the forward graph);
- *backward*: descendants of a tangent (they can only run in the backward graph);
- the rest (e.g. ``t(weight)`` used only by a gradient) may run on either side.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.utils._pytree as pytree


def is_tangent(node: fx.Node) -> bool:
    return node.op == "placeholder" and "tangents" in str(node.target)


def is_sym(node: fx.Node) -> bool:
    """A SymInt/SymFloat/SymBool (or plain int) value rather than a tensor."""
    val = node.meta.get("val")
    return isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool))


def _dropout_p(node: fx.Node):
    """The ``dropout_p`` argument of an op that has one (attention), else None."""
    for i, arg in enumerate(node.target._schema.arguments):
        if arg.name == "dropout_p":
            if "dropout_p" in node.kwargs:
                return node.kwargs["dropout_p"]
            return node.args[i] if i < len(node.args) else arg.default_value
    return None


def is_random(node: fx.Node) -> bool:
    """Ops whose recomputation would draw new random numbers (attention without dropout is not)."""
    if node.op != "call_function" or not hasattr(node.target, "_schema"):
        return False
    if torch.Tag.nondeterministic_seeded not in getattr(node.target, "tags", ()):
        return False
    return _dropout_p(node) not in (0, 0.0)


def is_multi_output(node: fx.Node) -> bool:
    """A node returning a tuple (e.g. ``native_layer_norm``): its ``getitem`` users are the values."""
    return isinstance(node.meta.get("val"), (tuple, list))


def ancestors(outputs: list[fx.Node], stop: set[fx.Node] = frozenset()) -> set[fx.Node]:
    """Every node that ``outputs`` need, walking back until a node in ``stop`` (included)."""
    seen: set[fx.Node] = set()
    todo = [n for n in outputs if isinstance(n, fx.Node)]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n not in stop:
            todo.extend(n.all_input_nodes)
    return seen


@dataclass(frozen=True)
class JointGraph:
    gm: fx.GraphModule
    primals: tuple[fx.Node, ...]
    tangents: tuple[fx.Node, ...]
    fwd_outputs: tuple[fx.Node | None, ...]
    bwd_outputs: tuple[fx.Node | None, ...]
    forward: frozenset[fx.Node]  # must run in forward
    backward: frozenset[fx.Node]  # depends on a tangent

    @classmethod
    def of(cls, gm: fx.GraphModule, num_fwd_outputs: int) -> "JointGraph":
        placeholders = list(gm.graph.find_nodes(op="placeholder"))
        outputs = pytree.arg_tree_leaves(*gm.graph.output_node().args)
        fwd, bwd = outputs[:num_fwd_outputs], outputs[num_fwd_outputs:]
        tangents = [p for p in placeholders if is_tangent(p)]
        backward: set[fx.Node] = set()
        for n in gm.graph.nodes:  # topological order: one pass finds all tangent descendants
            if n in tangents or any(a in backward for a in n.all_input_nodes):
                backward.add(n)
        backward.discard(gm.graph.output_node())
        forward = ancestors(fwd)
        # Every element of a forward tuple is a forward value, used in forward or not.
        forward |= {u for n in forward if is_multi_output(n) for u in n.users}
        return cls(
            gm, tuple(p for p in placeholders if not is_tangent(p)), tuple(tangents), tuple(fwd), tuple(bwd),
            frozenset(forward), frozenset(backward),
        )

    def input_names(self) -> set[str]:
        """Names of the primals and of views of them: storage that exists before the step."""
        from .liveness import storage_roots

        root, primals = storage_roots(self.gm), set(self.primals)
        return {n.name for n in root if root[n] in primals}

    def default_saved(self) -> list[fx.Node]:
        """What a plain partition keeps: forward values that the rest of the graph reads."""
        bw_region = ancestors(list(self.bwd_outputs), stop=set(self.forward))
        saved = {n for n in bw_region if n in self.forward and not is_multi_output(n)}
        return [n for n in self.gm.graph.nodes if n in saved]
