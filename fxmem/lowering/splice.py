"""Compared matches in one AOTAutograd trace.

A compared match (neither proven nor futile: :mod:`.patterns`) is kept only where the plan with
it peaks lower than the plan without it. Both candidates come from one trace: :func:`mark`
wraps each compared match's inputs and outputs in ``fxmem::region_mark`` (an identity whose
backward is a mark too), so the joint graph AOTAutograd traces from the lowered graph shows
where each fused region's forward and backward start and end. From that joint graph
:class:`Compared` builds

- the lowered candidate: the marks removed;
- the unlowered candidate: each marked region replaced by the joint graph of the ops it
  replaced (the Dynamo subgraph kept in its :class:`Region`, traced alone by ``make_fx`` on the
  region's own fake inputs, under the autocast it ran in, with the trace's decompositions);

and the partitioner plans both and keeps the lower simulated peak. What the unlowered candidate
runs are the aten ops and autograd formulas that AOTAutograd emits for the unfused code; the
region's nodes go where the fused forward and backward ran.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
from torch import Tensor
from torch.fx.experimental.proxy_tensor import make_fx

from ..graph.module import copied, graph_module

log = logging.getLogger("fxmem")

IN, OUT = "in", "out"
GRAD = "_grad"  # a mark's backward: the gradient of a region input ("in_grad") or output ("out_grad")


@torch.library.custom_op("fxmem::region_mark", mutates_args=())
def region_mark(x: Tensor, region: int, index: int, role: str) -> Tensor:
    """Identity that marks a compared region's ``index``-th input or output (``role``). Removed
    from the joint graph before planning; it only runs where no partitioner saw the graph."""
    return x.clone()


@region_mark.register_fake
def _(x, region, index, role):
    return x.clone()


def _mark_backward(ctx, grad):
    return region_mark(grad, ctx.region, ctx.index, ctx.role + GRAD), None, None, None


def _mark_context(ctx, inputs, output):
    _, ctx.region, ctx.index, ctx.role = inputs


region_mark.register_autograd(_mark_backward, setup_context=_mark_context)
MARK = torch.ops.fxmem.region_mark.default


@dataclass
class Region:
    """One compared match: the Dynamo subgraph it replaced (inputs and outputs in mark order)."""
    id: int
    pattern: str
    node: str
    unfused: fx.GraphModule  # placeholders: the region's tensor inputs; output: its outputs
    autocast: dict = field(default_factory=dict)  # device -> dtype: the autocast it ran under
    # per op of ``unfused``: (the lowered graph's node names in order, how many of them it ran after)
    follows: list[tuple[list[str], int]] = field(default_factory=list, repr=False)
    where: list[fx.Node] = field(default_factory=list, repr=False)  # the replaced nodes, until located


def locate(regions: list[Region], graph: fx.Graph, order: dict[fx.Node, int]) -> None:
    """Once the graph is lowered: each region op's preceding node that is still there (``order``:
    the node positions before lowering)."""
    import bisect

    kept = sorted((order[n], n.name) for n in graph.nodes if n in order)
    at, names = [i for i, _ in kept], [name for _, name in kept]
    for r in regions:
        r.follows = [(names, bisect.bisect_left(at, order[n])) for n in r.where]
        r.where = []


def markable(m: Any) -> bool:
    """A match whose region can be marked: every input it reads from outside is a tensor."""
    inside = set(m.nodes)
    return all(isinstance(a.meta.get("example_value"), Tensor)
               for n in m.nodes for a in n.all_input_nodes if a not in inside)


def extract(m: Any, region_id: int, autocast: dict) -> tuple[Region, list[fx.Node]]:
    """The match's unfused subgraph as a standalone module (outputs: ``m.output`` first, then
    the nodes the graph still needs, ``m.kept``), and its inputs."""
    inside = set(m.nodes)
    inputs = list(dict.fromkeys(a for n in m.nodes for a in n.all_input_nodes if a not in inside))
    outputs = [m.output, *(k[0] for k in m.kept)]
    graph = fx.Graph()
    env = {a: graph.placeholder(f"in_{i}") for i, a in enumerate(inputs)}
    for n in m.nodes:
        env[n] = graph.node_copy(n, env.__getitem__)
    graph.output(tuple(env[o] for o in outputs))
    owner = m.output.graph.owning_module
    sub = graph_module(owner if owner is not None else torch.nn.Module(), graph)
    return Region(region_id, m.pattern, m.output.name, sub, dict(autocast), where=list(m.nodes)), inputs


def mark(graph: fx.Graph, region: Region, inputs: list[fx.Node]) -> dict[fx.Node, fx.Node]:
    """Marks on the region's inputs (before their first use in the match): old node -> mark."""
    marks = {}
    for i, a in enumerate(inputs):
        first = next(n for n in region.where if a in n.all_input_nodes)  # (``where``: graph order)
        with graph.inserting_before(first):
            marks[a] = graph.call_function(MARK, (a, region.id, i, IN))
        marks[a].meta.update(a.meta)
    return marks


def mark_outputs(graph: fx.Graph, region: Region, outputs: list[fx.Node]) -> None:
    """Marks on the values that now compute the region's outputs: their users outside the
    region read the mark."""
    inside = set(outputs)
    for i, o in enumerate(outputs):
        with graph.inserting_after(o):
            out = graph.call_function(MARK, (o, region.id, i, OUT))
        out.meta.update(o.meta)
        o.replace_all_uses_with(out, delete_user_cb=lambda u, out=out: u is not out and u not in inside)


def is_mark(n: fx.Node) -> bool:
    return n.op == "call_function" and n.target is MARK


def unmark(gm: fx.GraphModule) -> int:
    """Remove every mark (they are identities): the lowered candidate."""
    count = 0
    for n in list(gm.graph.nodes):
        if is_mark(n):
            n.replace_all_uses_with(n.args[0])
            gm.graph.erase_node(n)
            count += 1
    return count  # (a joint graph: planned and split, its own code never runs)


def has_marks(gm: fx.GraphModule) -> bool:
    return any(is_mark(n) for n in gm.graph.nodes)


@dataclass
class Compared:
    """The compared regions of one lowered graph, for its partitioner: the unlowered candidate
    (a copy) first, then the marks removed in place (the lowered one)."""
    regions: dict[int, Region]

    def unlowered(self, gm: fx.GraphModule, target: Any) -> fx.GraphModule:
        """A copy of the marked joint graph with the regions' own ops (the unlowered candidate)."""
        return _target_passes(unlowered(gm, self.regions, _decompositions(target.name)), target.name)

    @staticmethod
    def lowered(gm: fx.GraphModule, target: Any) -> fx.GraphModule:
        """The marked joint graph with its marks removed, in place (the lowered candidate)."""
        unmark(gm)
        return _target_passes(gm, target.name)


def _target_passes(gm: fx.GraphModule, inner: str) -> fx.GraphModule:
    """Inductor's joint-graph passes ran on the marked graph; they run again on each candidate,
    where the marks no longer stand between ops and the unlowered ops are new."""
    if inner == "inductor":
        from torch._inductor.fx_passes.joint_graph import joint_graph_passes

        joint_graph_passes(gm)
    return gm


def _decompositions(inner: str) -> dict:
    """The decompositions the AOTAutograd trace ran with: none for the eager inner compiler
    (``aot_autograd``'s default), Inductor's table for Inductor."""
    if inner == "inductor":
        from torch._inductor.decomposition import select_decomp_table

        return select_decomp_table()
    return {}


class SpliceError(RuntimeError):
    """The unlowered candidate could not be built from the marked joint graph."""


def unlowered(gm: fx.GraphModule, regions: dict[int, Region], decompositions: dict | None) -> fx.GraphModule:
    """A copy of the marked joint graph ``gm`` with every marked region replaced by the joint
    graph of the ops it replaced, marks removed."""
    new = copied(gm)[0]  # (with the outputs' descriptors: which inputs the step mutates)
    new.meta.update(gm.meta)
    graph = new.graph
    found: dict[int, dict[tuple[str, int], fx.Node]] = {}
    for n in graph.nodes:
        if is_mark(n):
            _, rid, index, role = n.args
            found.setdefault(rid, {})[(role, index)] = n
    last_from = _last_forward_op(graph)
    traced: dict[tuple, Mini] = {}  # one trace per distinct region (a model's layers repeat)
    order = {n: float(i) for i, n in enumerate(graph.nodes)}  # graph position, kept for inserted nodes
    for rid, marks in found.items():
        if rid not in regions:
            raise SpliceError(f"a mark of region {rid}, which the lowering did not record")
        _splice(graph, regions[rid], marks, decompositions, traced, last_from, order)
    graph.lint()
    return new  # (not recompiled: a joint graph is planned and split, its own code never runs)


def _last_traced(names: list[str], count: int, last_from: dict[str, fx.Node]) -> fx.Node | None:
    """The joint graph's last forward op traced from the nearest of the first ``count`` of
    ``names`` that has one."""
    for name in reversed(names[max(0, count - 64):count]):  # (a few nodes back at most, in practice)
        if name in last_from:
            return last_from[name]
    return None


def _last_forward_op(graph: fx.Graph) -> dict[str, fx.Node]:
    """Dynamo node name -> the last forward op of the joint graph traced from it (``from_node``)."""
    backward: set[fx.Node] = set()
    last: dict[str, fx.Node] = {}
    for n in graph.nodes:
        if (n.op == "placeholder" and "tangents" in str(n.target)) or any(a in backward for a in n.all_input_nodes):
            backward.add(n)
        elif n.op == "call_function":
            for source in n.meta.get("from_node") or ():
                last[source.name] = n
    return last


def _splice(graph: fx.Graph, region: Region, marks: dict[tuple[str, int], fx.Node],
            decompositions: dict | None, traced: dict[tuple, "Mini"], last_from: dict[str, fx.Node],
            order: dict[fx.Node, float]) -> None:
    """Replace one marked region of the joint graph by the joint graph of its unfused ops."""
    n_in = len(region.unfused.graph.find_nodes(op="placeholder"))
    n_out = len(next(iter(region.unfused.graph.find_nodes(op="output"))).args[0])
    ins = [marks.get((IN, i)) for i in range(n_in)]
    outs = [marks.get((OUT, i)) for i in range(n_out)]
    if any(m is None for m in ins + outs):
        raise SpliceError(f"region {region.id} ({region.pattern} at {region.node}): a mark is missing")
    in_grads = [marks.get((IN + GRAD, i)) for i in range(n_in)]
    out_grads = [marks.get((OUT + GRAD, i)) for i in range(n_out)]
    inputs = [m.args[0].meta["val"] for m in ins]
    grads_in = [g.args[0].meta["val"] if g is not None else None for g in out_grads]
    differentiable = [g is not None for g in in_grads]
    key = (region.unfused.code, tuple(region.autocast.items()), tuple(differentiable),
           *(None if t is None else (str(t.shape), str(t.stride()), t.dtype, t.device) for t in inputs + grads_in))
    if key not in traced:
        traced[key] = _trace(region, inputs, grads_in, differentiable, decompositions)
    mini = traced[key]
    places = mini.gm.graph.find_nodes(op="placeholder")
    result = next(iter(mini.gm.graph.find_nodes(op="output"))).args[0]
    placer = _Placer(graph, order, outs[0].args[0].meta)
    placer.env.update(zip(places, [m.args[0] for m in ins] + [g.args[0] for g in out_grads if g is not None]))
    by_seq = placer.forward(mini, dict(zip(places[:n_in], ins)), region.follows, last_from)
    readers = {r: list(g.users) for r, g in zip(result[n_out:], in_grads) if isinstance(r, fx.Node) and g is not None}
    placer.backward(mini, [g for g in out_grads if g is not None], by_seq, max(placer.number(m) for m in ins),
                    readers, region)
    values = [placer.env[r] if isinstance(r, fx.Node) else r for r in result]
    for i, o in enumerate(outs):
        o.replace_all_uses_with(values[i])
    for i, g in enumerate(in_grads):
        if g is None:
            continue
        if values[n_out + i] is None:
            raise SpliceError(f"region {region.id}: input {i} has a gradient with the fused ops, none without")
        g.replace_all_uses_with(values[n_out + i])
    _erase_unused(graph, [m for m in ins + outs + in_grads + out_grads if m is not None])


class _Placer:
    """Copies a region's unfused nodes into the joint graph where a compile without the fused
    ops runs them. ``order``: graph positions (inserted nodes get positions between their
    neighbours'); ``seq``: autograd sequence numbers, the engine's priority in the backward."""

    def __init__(self, graph: fx.Graph, order: dict[fx.Node, float], source_meta: dict):
        self.graph, self.order = graph, order
        self.env: dict[fx.Node, Any] = {}  # region node -> joint graph node
        self.seq: dict[fx.Node, float] = {}
        self.meta = {k: source_meta[k] for k in ("stack_trace", "nn_module_stack") if k in source_meta}

    def number(self, n: fx.Node) -> float:
        return self.seq.get(n, n.meta.get("seq_nr", -1))

    def place(self, n: fx.Node, before: fx.Node, priority: float) -> fx.Node:
        with self.graph.inserting_before(before):
            self.env[n] = new = self.graph.node_copy(n, self.env.__getitem__)
        order = self.order
        order[new] = (order[new.prev] + order[before]) / 2 if new.prev in order else order[before] - 1.0
        self.seq[new] = priority
        new.meta["seq_nr"] = int(priority)
        for k, v in self.meta.items():
            new.meta.setdefault(k, v)
        return new

    def forward(self, mini: "Mini", marks: dict[fx.Node, fx.Node], follows: list, last_from: dict) -> dict[int, float]:
        """The forward in its own order (Dynamo's), each op as early as its inputs (the region's
        inputs at their marks) and the Dynamo node it followed allow; an op's sequence number
        follows its input's. Returns the sequence numbers the region's forward ops got."""
        by_seq: dict[int, float] = {}
        last = min(marks.values(), key=self.order.__getitem__)
        for n in mini.forward:
            inputs = [marks[a] if a in marks else self.env[a] for a in n.all_input_nodes]
            op = mini.origin.get(n)
            after = _last_traced(*follows[op], last_from) if op is not None and op < len(follows) else None
            at = max([last, *inputs, *([after] if after is not None else [])], key=self.order.__getitem__)
            last = new = self.place(n, at.next, self.number(at) + 1e-3)
            if n.meta.get("seq_nr") is not None:
                by_seq[n.meta["seq_nr"]] = self.seq[new]
        return by_seq

    def backward(self, mini: "Mini", out_grads: list[fx.Node], by_seq: dict[int, float], latest: float,
                 readers: dict[fx.Node, list[fx.Node]], region: Region) -> None:
        """The backward, one autograd node's ops at a time, where the engine runs them: once
        ready (after their inputs and the region's incoming gradients, ``out_grads``), before the
        first op of a lower sequence number (the engine runs the ready node of the highest
        first) or a reader of the gradients they compute."""
        if mini.backward and not out_grads:
            raise SpliceError(f"region {region.id}: a backward without an incoming gradient")
        start = max(out_grads, key=self.order.__getitem__, default=None)
        for step, members in mini.backward:
            priority = by_seq.get(step, latest)
            inside = set(members)
            ready = max([start] + [self.env[a] for n in members for a in n.all_input_nodes
                                   if a not in inside and a in self.env], key=self.order.__getitem__)
            stop = {u for n in members for u in readers.get(n, ())}
            at = ready.next
            while at.op != "output" and at not in stop and not _runs_after(at, priority, self.seq):
                at = at.next
            for n in members:
                self.place(n, at, priority)


def _erase_unused(graph: fx.Graph, start: list[fx.Node]) -> None:
    """Erase the marks and what only they (transitively) read: the fused region's nodes."""
    work = list(start)
    while work:
        n = work.pop()
        if n._erased or n.users or n.op in ("placeholder", "output"):
            continue
        if n.op == "call_function" and not is_mark(n) and n.is_impure():
            continue
        inputs = n.all_input_nodes
        graph.erase_node(n)
        work.extend(inputs)


@dataclass
class Mini:
    """A region's unfused joint graph: its forward ops in order, and its backward as the autograd
    engine ran it, one autograd node at a time (its sequence number and the ops it emitted)."""
    gm: fx.GraphModule
    forward: list[fx.Node]
    backward: list[tuple[int, list[fx.Node]]]
    origin: dict[fx.Node, int]  # forward node -> the index of the region op (Dynamo node) that made it


class _Recording(fx.Interpreter):
    """Runs the region's ops under make_fx, noting which op made each traced node."""

    def __init__(self, gm: fx.GraphModule, origin: dict[fx.Node, int]):
        super().__init__(gm)
        self.origin = origin
        self.index = {n: i for i, n in enumerate(n for n in gm.graph.nodes if n.op not in ("placeholder", "output"))}

    def run_node(self, n: fx.Node) -> Any:
        from torch.fx.experimental.proxy_tensor import get_proxy_mode

        mode = get_proxy_mode()
        if mode is None or n not in self.index:
            return super().run_node(n)
        before = set(mode.tracer.graph.nodes)
        out = super().run_node(n)
        self.origin.update((x, self.index[n]) for x in mode.tracer.graph.nodes if x not in before)
        return out


def _trace(region: Region, inputs: list, tangents: list, differentiable: list[bool],
           decompositions: dict | None) -> Mini:
    """The joint graph of the region's unfused ops at its fake inputs: placeholders the inputs
    then the gradients of the outputs that have one; outputs the region's outputs then the
    gradients of the inputs (None where an input has none)."""
    sub, autocast = region.unfused, region.autocast
    n_in = len(inputs)
    given = [t for t in tangents if t is not None]
    steps: list[tuple[int, set]] = []  # (sequence number, the graph's nodes) as each engine step began

    origin: dict[fx.Node, int] = {}  # traced node -> the index of the region op that made it

    def joint(*args):
        xs = [x.detach().requires_grad_(d) for x, d in zip(args[:n_in], differentiable)]
        with torch.enable_grad(), _autocast(autocast):
            outs = _Recording(sub, origin).run(*xs)
        wanted = [(o, g) for o, t, g in zip(outs, tangents, _each(args[n_in:], tangents)) if t is not None]
        want_x = [x for x in xs if x.requires_grad]
        _record_steps([o for o, _ in wanted], steps)
        got = torch.autograd.grad([o for o, _ in wanted], want_x, [g for _, g in wanted], allow_unused=True) \
            if wanted and want_x else ()
        it = iter(got)
        return (*outs, *[next(it) if x.requires_grad else None for x in xs])

    with fx_traceback.preserve_node_meta():  # each forward op's sequence number (``seq_nr``)
        gm = make_fx(joint, decomposition_table=decompositions or {}, tracing_mode="symbolic")(*inputs, *given)
    graph = gm.graph
    for n in list(graph.nodes):  # the detach that made each input a leaf is no op of the step
        if n.op == "call_function" and n.target is torch.ops.aten.detach.default and n.args[0].op == "placeholder":
            n.replace_all_uses_with(n.args[0])
            graph.erase_node(n)
    ops = [n for n in graph.nodes if n.op == "call_function"]
    if not steps:
        return Mini(gm, ops, [], origin)
    forward = [n for n in ops if n in steps[0][1]]
    backward: list[tuple[int, list[fx.Node]]] = []
    for n in ops:
        if n in steps[0][1]:
            continue
        number = next(number for number, existing in reversed(steps) if n not in existing)  # the step that made it
        if not backward or backward[-1][0] != number:
            backward.append((number, []))
        backward[-1][1].append(n)
    return Mini(gm, forward, backward, origin)


def _runs_after(n: fx.Node, priority: float, seq: dict) -> bool:
    """The engine runs ``n`` after a ready autograd node of sequence number ``priority``."""
    number = seq.get(n, n.meta.get("seq_nr"))
    return n.op == "call_function" and number is not None and number < priority


def _record_steps(outputs: list[Tensor], steps: list) -> None:
    """Note the nodes traced before each autograd node of the region's backward starts: the engine
    runs one node's ops together (a product's two gradients), then the next node."""
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    mode = get_proxy_mode()
    if mode is None:
        return
    graph = mode.tracer.graph
    seen, todo = set(), [o.grad_fn for o in outputs if o.grad_fn is not None]
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        fn.register_prehook(lambda grads, fn=fn: steps.append((fn._sequence_nr(), set(graph.nodes))))
        todo.extend(f for f, _ in fn.next_functions)


def _each(given: tuple, tangents: list) -> list:
    it = iter(given)
    return [next(it) if t is not None else None for t in tangents]


def _autocast(state: dict):
    import contextlib

    stack = contextlib.ExitStack()
    for device, dtype in state.items():
        stack.enter_context(torch.autocast(device, dtype=dtype))
    return stack
