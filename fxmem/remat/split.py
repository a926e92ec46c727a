"""Split a joint graph into forward and backward graph modules, given a saved set.

The forward graph computes the forward outputs and the saved values. The backward graph takes the
saved values and the tangents and computes the gradients; every forward node it needs that is not
saved is copied into it, i.e. recomputed. Conventions follow AOTAutograd's runtime: the forward
returns ``(*fwd_outputs, *saved_tensors, *saved_symints)`` and the backward takes
``(*saved_symints, *saved_tensors, *tangents)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Collection

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import find_symbol_binding_fx_nodes, free_symbols

from ..graph.joint import JointGraph, ancestors, is_multi_output, is_random, is_sym
from ..graph.module import graph_module
from ..host_memory import OFFLOAD_TAG, dim_order
from .allowlist import is_copy, is_view
from .replay import bind_states


class InvalidSavedSet(ValueError):
    """The saved set cannot produce the backward (names the offending node)."""


@dataclass(frozen=True)
class Split:
    fw: fx.GraphModule
    bw: fx.GraphModule
    saved: tuple[fx.Node, ...]  # joint-graph nodes the forward hands to the backward (tensors)
    saved_syms: tuple[fx.Node, ...]
    recomputed: tuple[fx.Node, ...]  # forward-side joint nodes that the backward runs again
    offloaded: tuple[fx.Node, ...] = ()  # of ``saved``: handed over in host memory (``fxmem.host_memory``)


def deferred(needed: set[fx.Node], late: set[fx.Node]) -> set[fx.Node]:
    """The ops of ``needed`` (not ``late``) that read only the graph's inputs and that another op
    of ``needed`` reads: the backward's first matmul of a tangent and a kept weight, a bias's
    gradient. Run in graph order, such an op allocates at the backward's start, and its output
    stays alive while the forward the backward recomputes is rebuilt before the op's readers run
    (issue #56: a gated MLP's ``tangent @ down_weight``, one ``[tokens, 2d]`` buffer, alive across
    the recomputed norm and projections)."""
    return {n for n in needed if n not in late and n.op == "call_function"
            and not any(a in needed for a in n.all_input_nodes) and any(u in needed for u in n.users)}


def late_order(gm: fx.GraphModule, needed: set[fx.Node], late: set[fx.Node], defer: bool = False) -> list[fx.Node]:
    """``needed`` in an order where each node of ``late`` runs just before its first user.

    Recomputed forward nodes are ``late``: computing them all at the start of the backward would
    bring back the forward's peak; computing each just in time keeps one layer's worth alive.
    ``defer``: the :func:`deferred` ops run just before their first user too (the step simulator
    picks, per saved set, whichever order peaks lower: ``remat.steppeak.StepPeak.defers``).
    """
    if defer:
        late = set(late) | deferred(needed, late)
    order, done = [], set()
    for root in gm.graph.nodes:
        if root not in needed or root in late or root in done:
            continue
        stack = [(root, False)]
        while stack:  # iterative post-order over the late inputs of ``root``
            n, expanded = stack.pop()
            if n in done:
                continue
            if expanded:
                done.add(n)
                order.append(n)
                continue
            stack.append((n, True))
            stack.extend((a, False) for a in reversed(n.all_input_nodes) if a in late and a in needed and a not in done)
    order.extend(n for n in gm.graph.nodes if n in needed and n not in done)  # late nodes nobody reads
    return order


@dataclass(frozen=True)
class Again:
    """An entry of a backward's order: ``node`` run a second time (:func:`run_twice`)."""
    node: fx.Node


def run_twice(order: list[fx.Node], late: set[fx.Node]) -> list:
    """``order`` with each recomputed copy op (:func:`~.allowlist.is_copy`) that both recomputed
    ops and gradient ops read, all the recomputed ones first, run again (an :class:`Again`) just
    before its first gradient reader, which reads the second copy. Run once, it lives from the
    recomputed forward that reads it to the gradient op that reads it last: an aggregation of
    ``k`` rolled copies of a value (Autoformer's time-delay aggregation, ``sum_i roll(v, d_i) *
    w_i``) is recomputed in forward order and differentiated in reverse, all ``2k`` copies alive
    at once. Run twice, each lives only around its readers; the values are the same."""
    pos = {n: i for i, n in enumerate(order)}
    before: dict[fx.Node, list[fx.Node]] = {}
    for n in order:
        if n not in late or not is_copy(n) or not isinstance(n.meta.get("val"), torch.Tensor):
            continue
        readers = [u for u in n.users if u in pos]
        recomputing = [pos[u] for u in readers if u in late]
        grads = [u for u in readers if u not in late]
        if recomputing and grads:
            first = min(grads, key=pos.__getitem__)
            if max(recomputing) < pos[first]:
                before.setdefault(first, []).append(n)
    if not before:
        return order
    out: list = []
    for n in order:
        out.extend(Again(a) for a in before.get(n, ()))
        out.append(n)
    return out


def _host_meta(node: fx.Node) -> dict:
    """``node``'s meta for its copy in host memory: the value on the CPU as ``fxmem::offload``
    makes it, tagged host."""
    val = node.meta["val"]
    with val.fake_mode:
        host = torch.ops.fxmem.offload(val, dim_order(val))
    return {**node.meta, "val": host, OFFLOAD_TAG: True}


def _extract(gm: fx.GraphModule, inputs: list[fx.Node], outputs: list, descs: list | None,
             late: set[fx.Node] = frozenset(), effects: tuple[fx.Node, ...] = (),
             host: frozenset[fx.Node] = frozenset(), defer: bool = False, twice: bool = False) -> fx.GraphModule:
    """A graph module taking ``inputs`` (any nodes of ``gm``) and returning ``outputs``, running
    ``effects`` (mutations that reach no output) too. ``host``: outputs returned in host memory
    (``fxmem::offload`` right after the value is made: its device storage dies at its last read
    here), or inputs taken in host memory (``fxmem::reload`` just before the first read).
    ``twice``: :func:`run_twice`'s copies run again (named ``<name>_again``)."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    held: dict[fx.Node, fx.Node] = {}  # input -> its host placeholder, until reloaded
    for node in inputs:
        if node in host:
            held[node] = graph.placeholder(f"{node.name}_host")
            held[node].meta = _host_meta(node)
        else:
            env[node] = graph.placeholder(node.name)
            env[node].meta = node.meta

    def value(n: fx.Node) -> fx.Node:
        if n not in env and n in held:  # the first read: copied back here
            val = n.meta["val"]
            order = dim_order(val)
            env[n] = graph.create_node("call_function", torch.ops.fxmem.reload.default,
                                       (held[n], val.device, order), name=n.name)
            with val.fake_mode:
                env[n].meta = {**n.meta, "val": torch.ops.fxmem.reload(held[n].meta["val"], val.device, order)}
        return env[n]

    needed = ancestors([*outputs, *effects], stop=set(inputs)) - set(inputs)
    order = late_order(gm, needed, late, defer)
    for node in run_twice(order, late) if twice else order:
        if isinstance(node, Again):
            n = node.node
            env[n] = graph.create_node(n.op, n.target, fx.map_arg(n.args, value), fx.map_arg(n.kwargs, value),
                                       name=f"{n.name}_again")
            env[n].meta = dict(n.meta)
            continue
        if node.op == "placeholder":
            raise InvalidSavedSet(f"{node.name} is needed but is not an input of this graph")
        env[node] = graph.node_copy(node, value)
    for node in [o for o in outputs if isinstance(o, fx.Node) and o in host and o not in held]:
        with graph.inserting_after(env[node]):
            copy = graph.create_node("call_function", torch.ops.fxmem.offload.default,
                                     (env[node], dim_order(node.meta["val"])), name=f"{node.name}_host")
        copy.meta = _host_meta(node)
        env[node] = copy
    out = graph.output(tuple(value(o) if isinstance(o, fx.Node) else o for o in outputs))
    if descs is not None:
        out.meta["desc"] = descs
    graph.lint()
    return graph_module(gm, graph)


def _output_descs(gm: fx.GraphModule) -> list:
    out = gm.graph.output_node()
    descs = out.meta.get("desc")
    return list(descs) if descs is not None else [None] * len(out.args[0])


def _walk(joint: JointGraph, saved: set[fx.Node]) -> tuple[set[fx.Node], set[fx.Node]]:
    """(every node the backward reaches, ``saved`` plus the forward-side SymInts and graph inputs
    it needs): a walk back from the gradients that stops at saved values and tangents."""
    stop, saved = saved | set(joint.tangents), set(saved)
    todo, seen = [n for n in joint.bwd_outputs if isinstance(n, fx.Node)], set()
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n in stop:
            continue
        if n not in joint.backward and (n.op == "placeholder" or is_sym(n)):
            saved.add(n)
            continue
        todo.extend(n.all_input_nodes)
    return seen, saved


def _recomputed(joint: JointGraph, seen: set[fx.Node], saved: set[fx.Node]) -> set[fx.Node]:
    tangents = set(joint.tangents)
    return {n for n in seen - saved if n not in joint.backward and n not in tangents and n.op != "get_attr"}


class Walk:
    """:func:`recomputed` for many saved sets of one joint graph that does not change meanwhile
    (the budget's candidates): the edges are read once, as indices, and each set walked once."""

    def __init__(self, joint: JointGraph):
        self.joint, nodes = joint, list(joint.gm.graph.nodes)
        index = {n: i for i, n in enumerate(nodes)}
        tangents = set(joint.tangents)
        self._nodes, self._tangents = nodes, {index[t] for t in tangents}
        self._inputs = [tuple(index[a] for a in n.all_input_nodes) for n in nodes]
        self._inputs_kept = {i for i, n in enumerate(nodes)  # forward inputs and SymInts: never recomputed
                             if n not in joint.backward and (n.op == "placeholder" or is_sym(n))}
        self._fwd = {i for i, n in enumerate(nodes)
                     if n not in joint.backward and n not in tangents and n.op != "get_attr"}
        self._starts = [index[n] for n in joint.bwd_outputs if isinstance(n, fx.Node)]
        self._index, self._memo = index, {}

    def __call__(self, saved) -> frozenset[fx.Node]:
        key = frozenset(saved)
        if key not in self._memo:
            stop = {self._index[n] for n in key} | self._tangents
            todo, seen = list(self._starts), set()
            while todo:
                i = todo.pop()
                if i in seen:
                    continue
                seen.add(i)
                if i not in stop and i not in self._inputs_kept:
                    todo.extend(self._inputs[i])
            again = (seen & self._fwd) - stop - self._inputs_kept
            self._memo[key] = frozenset(self._nodes[i] for i in again)
        return self._memo[key]


def recomputed(joint: JointGraph, saved) -> set[fx.Node]:
    """The forward nodes the backward runs again when ``saved`` is kept (what :func:`split`
    would copy into the backward, without building the graphs)."""
    return _recomputed(joint, *_walk(joint, set(saved)))


def handoff(joint: JointGraph, saved: set[fx.Node], order: dict[fx.Node, int],
            symbols: Callable[[fx.Node], set] | None = None, bindings: dict | None = None
            ) -> tuple[list[fx.Node], list[fx.Node], list[fx.Node]]:
    """(recomputed forward nodes, saved tensors, saved SymInts) of keeping ``saved``, each in the
    order the split hands them over. ``symbols`` / ``bindings``: a node's free shape symbols and
    the graph's symbol bindings, when the caller has them cached (many saved sets, one graph)."""
    seen, saved = _walk(joint, saved)
    recomputed = sorted(_recomputed(joint, seen, saved), key=order.__getitem__)
    needed_saved = saved & seen
    syms = {n for n in needed_saved if is_sym(n)}
    tensors = sorted(needed_saved - syms, key=order.__getitem__)
    # Tensors stashed without a version-counter check go last (AOTAutograd's convention).
    tensors.sort(key=lambda n: bool(n.meta.get("saved_tensor_with_no_vc_check", False)))
    # Inductor needs every symbol in a backward input's shape bound by a SymInt input.
    bindings = find_symbol_binding_fx_nodes(joint.gm.graph) if bindings is None else bindings
    symbols = symbols or (lambda n: free_symbols(n.meta.get("val")))
    # A SymInt handed over as an expression (``-u0``, a roll's shift) too: Inductor binds ``u0``
    # only from an input that is ``u0`` itself.
    for n in [*tensors, *joint.tangents, *sorted(syms, key=order.__getitem__)]:
        for s in symbols(n):
            if s in bindings and bindings[s] not in joint.backward:
                syms.add(bindings[s])
    return recomputed, tensors, sorted(syms, key=order.__getitem__)


def input_view_bases(joint: JointGraph, saved: set[fx.Node]) -> set[fx.Node]:
    """``saved`` with each view of a graph input (a chain of view ops from a primal: a norm's
    weight reshaped to ``(1, groups, channels // groups, 1)``) replaced by that input; the
    backward redoes the view. Same bytes: an input's views keep no storage of their own.

    For Inductor: with its layout optimization (convolution graphs) it returns every 4-D saved
    output in channels-last strides, a view of an input as a channels-last copy, and the backward
    restrided to match. A backward op whose meaning depends on its input's strides
    (``as_strided``, which a group norm's gradient decomposes into) then read that copy in the
    wrong order: every gradient of a diffusers ``UNet2DModel`` was wrong. Handed over itself, the
    input (a norm's 1-D weight: no layout to change) is viewed again in the backward with the
    strides the graph was traced with."""
    inputs = set(joint.primals)
    out = set()
    for n in saved:
        base = n
        while base.op == "call_function" and is_view(base) and isinstance(base.args[0], fx.Node):
            base = base.args[0]
        out.add(base if base in inputs and base is not n else n)
    return out


def split(joint: JointGraph, saved: list[fx.Node] | set[fx.Node], input_views: bool = True,
          offloaded: Collection[fx.Node] = (), defer: bool = False, twice: bool = False) -> Split:
    """Forward and backward modules that hand exactly ``saved`` (plus what they must) across.
    ``input_views=False``: views of graph inputs are redone in the backward from the input
    (:func:`input_view_bases`). ``offloaded``: saved values handed over in host memory
    (``fxmem.host_memory``; each must be one the split hands over: a forward op's own storage).
    ``defer``: the backward runs its :func:`deferred` ops just before their first user
    (:func:`late_order`; ``StepPeak.defers`` says where that peaks lower). ``twice``: the
    backward runs :func:`run_twice`'s copy ops a second time (``StepPeak.twice`` says where).

    ``saved`` may hold any forward-side nodes (not tangent-dependent). Graph inputs and SymInts
    that the backward needs are kept automatically (inputs are alive anyway; SymInts are tiny).
    Raises :class:`InvalidSavedSet` if the backward would recompute a random op that does not
    replay its generator (see ``replay``).
    """
    order = {n: i for i, n in enumerate(joint.gm.graph.nodes)}
    saved = set(saved) if input_views else input_view_bases(joint, set(saved))
    bad = [n.name for n in saved if n in joint.backward or n.op == "output" or is_multi_output(n)]
    if bad:
        raise InvalidSavedSet(f"saved set holds nodes that are backward-only or tuples: {', '.join(bad)}")
    recomputed, tensors, syms_sorted = handoff(joint, saved, order)
    random = [n.name for n in recomputed if is_random(n)]
    if random:
        raise InvalidSavedSet(f"the backward would recompute random ops {random}: save them or replay their RNG")

    from torch._functorch._aot_autograd.descriptors import SavedForBackwardsAOTOutput

    host = frozenset(offloaded)
    if not host <= set(tensors) or host & set(joint.fwd_outputs):
        bad = sorted(n.name for n in host if n not in tensors or n in joint.fwd_outputs)
        raise InvalidSavedSet(f"offloaded values that the split does not hand over (or that the forward returns): "
                              f"{', '.join(bad)}")
    descs = _output_descs(joint.gm)
    n_fwd = len(joint.fwd_outputs)
    n_saved = len(tensors) + len(syms_sorted)
    fw = _extract(joint.gm, list(joint.primals), [*joint.fwd_outputs, *tensors, *syms_sorted],
                  descs[:n_fwd] + [SavedForBackwardsAOTOutput(i) for i in range(n_saved)], effects=joint.fwd_mutations,
                  host=host)
    bind_states(fw)
    bw = _extract(joint.gm, [*syms_sorted, *tensors, *joint.tangents], list(joint.bwd_outputs), descs[n_fwd:],
                  late=set(recomputed), effects=joint.bwd_mutations, host=host, defer=defer, twice=twice)
    return Split(fw, bw, tuple(tensors), tuple(syms_sorted), tuple(recomputed),
                 tuple(n for n in tensors if n in host))
