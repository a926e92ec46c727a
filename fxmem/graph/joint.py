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


def is_mutation(node: fx.Node) -> bool:
    """An op that writes into one of its arguments (``copy_`` of a mutated input's new value, a
    custom op's ``Tensor(a!)`` argument): it reaches no output, yet it must run."""
    schema = getattr(node.target, "_schema", None)
    return node.op == "call_function" and schema is not None and schema.is_mutable


def _written(node: fx.Node) -> list[fx.Node]:
    """The arguments a mutation writes into."""
    args = node.target._schema.arguments
    bound = [*node.args, *(node.kwargs.get(a.name) for a in args[len(node.args):])]
    return [v for a, v in zip(args, bound) if a.alias_info is not None and a.alias_info.is_write
            and isinstance(v, fx.Node)]


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
    # In-graph mutations of the forward (Inductor keeps input mutations in the graph as ``copy_``
    # epilogues) and of the backward: each split graph runs its side's, in graph order.
    fwd_mutations: tuple[fx.Node, ...] = ()
    bwd_mutations: tuple[fx.Node, ...] = ()
    # Primals whose storage the step writes: in the graph, or by AOTAutograd's runtime from a
    # forward output it marks ``InputMutationAOTOutput``. The backward must not read them again.
    mutated: frozenset[fx.Node] = frozenset()

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
        mutations = [n for n in gm.graph.nodes if is_mutation(n)]
        fwd_mut = tuple(n for n in mutations if n not in backward)
        forward = ancestors([*fwd, *fwd_mut])
        # Every element of a forward tuple is a forward value, used in forward or not.
        forward |= {u for n in forward if is_multi_output(n) for u in n.users}
        primals = tuple(p for p in placeholders if not is_tangent(p))
        joint = cls(gm, primals, tuple(tangents), tuple(fwd), tuple(bwd), frozenset(forward), frozenset(backward),
                    fwd_mut, tuple(n for n in mutations if n in backward), _mutated_primals(gm, primals, fwd_mut))
        mark_mutated_reads(joint)
        return joint

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


READS_MUTATED = "fxmem_reads_mutated"  # node meta: reads an input the step mutates (never recomputed)


def _mutated_primals(gm: fx.GraphModule, primals: tuple[fx.Node, ...],
                     fwd_mutations: tuple[fx.Node, ...]) -> frozenset[fx.Node]:
    """Primals the forward mutates, from AOTAutograd's own record: the destinations of the graph's
    mutation nodes (through views), and the inputs its output descriptors name as mutated."""
    from torch._functorch._aot_autograd.descriptors import InputMutationAOTOutput

    from .liveness import storage_roots

    root = storage_roots(gm)
    mutated = {root[w] for n in fwd_mutations for w in _written(n)}
    descs = gm.graph.output_node().meta.get("desc") or ()
    named = [d.mutated_input for d in descs if isinstance(d, InputMutationAOTOutput)]
    mutated |= {p for p in primals if p.meta.get("desc") is not None and p.meta["desc"] in named}
    return frozenset(mutated & set(primals))


def mark_mutated_reads(joint: JointGraph) -> None:
    """Mark the forward nodes that read a mutated primal (or a view of one) with
    :data:`READS_MUTATED`: recomputed in the backward they would read the new value (autograd's
    version check refuses it where the input was saved; where the step writes in the graph, the
    result would silently be wrong), so the planner keeps them or what they feed instead."""
    if not joint.mutated:
        return
    from .liveness import storage_roots

    root = storage_roots(joint.gm)
    for n in joint.gm.graph.nodes:
        if n.op == "call_function" and n not in joint.backward and not is_mutation(n) and any(
                root.get(a) in joint.mutated for a in n.all_input_nodes):
            n.meta[READS_MUTATED] = True


_SIZE_READS = (torch.ops.aten.sym_size.int, torch.ops.aten.sym_stride.int, torch.ops.aten.sym_numel.default,
               torch.ops.aten.sym_storage_offset.default)


def hoist_size_reads(gm: fx.GraphModule) -> int:
    """Move each read of a tensor's size (``aten.sym_size.int`` and kin: shapes, never data) to
    just after the tensor is made. With dynamic shapes make_fx records a size where the code
    asked for it (e.g. the loss's ``logits.view(-1, vocab)``, after the logits' bias was added):
    there it holds the tensor's storage alive, and the eager inner compiler can neither free it
    nor write the bias add into it. Read early, the size is the same. Returns how many moved."""
    moved = 0
    for n in list(gm.graph.nodes):
        if n.op == "call_function" and n.target in _SIZE_READS and isinstance(n.args[0], fx.Node):
            x = n.args[0]
            if x.next is not n and all(a is x or not isinstance(a, fx.Node) for a in n.args):
                x.append(n)
                moved += 1
    if moved:
        gm.recompile()
    return moved
