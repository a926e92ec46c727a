"""Liveness: a graph's allocations and frees in order, and their peak: fxmem's one step simulator.

:func:`walk` is the simulator. It takes one graph as node lists (its inputs and which of them are
counted, its body in execution order, its outputs), the storage its kept views share, the eager
inner compiler's buffer reuse and the random states bound to their ops, and returns the
allocations and frees in order. Every op that is not a view, a getitem or an in-place write
allocates its output; a storage is freed after the last read of any node aliasing it (boxed
graphs free their inputs the same way); ops with known internal buffers (:mod:`.scratch`)
allocate and free them where they run; graph outputs stay alive. The bytes are a parameter:
formulas of the input sizes (:class:`Formulas`: one schedule gives the peak at every shape, for
the report and ``predict_peak``) or integers at the plan shape (:class:`AtShape`: the planner
walks a hundred saved sets of one joint graph). :func:`peak_bytes` and :func:`peak` walk the
result. Two adapters feed it: :func:`schedule` (a graph module: the split's forward and backward)
and ``remat.steppeak.StepPeak`` (the node lists the split would build, read off the joint graph).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Callable, Collection, Iterable, Mapping, Sequence

import sympy
import torch
import torch.fx as fx
from torch._prims.rng_prims import run_with_rng_state

from ..host_memory import OFFLOAD_TAG
from .inplace import WRITES_INTO_FIRST
from .scratch import scratch_bytes
from .sizes import SymbolicSizes, tensor_bytes

# Views whose schema declares no alias (autograd does not track them) but that share storage:
# ``_unsafe_view`` ends every matmul of a 3-D input (``mm`` then ``_unsafe_view``).
_UNTRACKED_VIEWS = {torch.ops.aten._unsafe_view.default}


def is_alias(node: fx.Node) -> bool:
    """Shares its first input's storage: a view, a getitem, or an in-place op (not a view that
    copies where the graph runs: ``layouts.mark_copies``)."""
    if node.meta.get("copies"):
        return False
    if node.target is operator.getitem or node.target in WRITES_INTO_FIRST or node.target in _UNTRACKED_VIEWS:
        return True
    schema = getattr(node.target, "_schema", None)
    return bool(schema and schema.returns and schema.returns[0].alias_info is not None)


def is_element(node: fx.Node) -> bool:
    """One output of an op that returns several (``native_layer_norm``'s mean, a replayed
    dropout's mask): its own storage, unlike an element of a view-returning op (``split``)."""
    if node.target is not operator.getitem or not node.args or not isinstance(node.args[0], fx.Node):
        return False
    src = node.args[0]
    return isinstance(src.meta.get("val"), (tuple, list)) and (not is_alias(src) or is_element(src))


def alias_source(n: fx.Node) -> fx.Node | None:
    """The node whose storage ``n`` shares (its first argument, for a view, a getitem of a view's
    outputs or an in-place op), else None: ``n`` owns its storage."""
    a = n.args[0] if n.args else None
    if n.op == "call_function" and isinstance(a, fx.Node) and is_alias(n) and not is_element(n):
        return a
    return None


def storage_roots(gm: fx.GraphModule, shared: Mapping[fx.Node, fx.Node] | None = None) -> dict[fx.Node, fx.Node]:
    """Node -> the node whose output storage it is (what keeping it keeps alive). ``shared``:
    placeholders known to share another placeholder's storage (kept views of one tensor)."""
    root: dict[fx.Node, fx.Node] = dict(shared or {})
    for n in gm.graph.nodes:
        if n in root:
            continue
        a = alias_source(n)
        root[n] = root.get(a, a) if a is not None else n
    return root


def elements(n: fx.Node) -> list[fx.Node]:
    """The getitems taking outputs of ``n``, an op returning several, one per output: they own
    their storage, allocated when ``n`` runs (with its inputs still alive), not when the getitem
    does."""
    if not isinstance(n.meta.get("val"), (tuple, list)) or is_alias(n):
        return []
    first = {}
    for u in n.users:
        if u.target is operator.getitem:
            first.setdefault(u.args[1], u)
    return list(first.values())


def taken_early(n: fx.Node) -> bool:
    """A getitem among ``elements`` of its op (allocated there)."""
    return is_element(n) and not is_alias(n.args[0])


def last_reads(gm: fx.GraphModule, root: dict[fx.Node, fx.Node]) -> dict[fx.Node, int]:
    """Storage root -> position of the last node reading it through any alias (the output node
    reads what the graph returns)."""
    last: dict[fx.Node, int] = {}
    for i, n in enumerate(gm.graph.nodes):
        for a in n.all_input_nodes:
            last[root[a]] = max(last.get(root[a], -1), i)
    return last


class NodeFacts:
    """What :func:`walk` reads of each node of one graph, computed once: a planner walks the
    nodes of one joint graph for many saved sets."""

    def __init__(self, nodes: Iterable[fx.Node]):
        nodes = list(nodes)
        self.reads = {n: n.all_input_nodes for n in nodes}
        self.source = {n: alias_source(n) for n in nodes}
        self.early = {n for n in nodes if taken_early(n)}
        self.several = {n for n in nodes if isinstance(n.meta.get("val"), (tuple, list))}
        # an op returning several -> every getitem of its outputs (each owns its storage)
        self.getitems = {n: [u for u in n.users if u.target is operator.getitem] for n in nodes if elements(n)}
        self.replays = {n for n in nodes if n.op == "call_function" and n.target is run_with_rng_state}
        # values in host memory (an offloaded activation, ``fxmem.host_memory``): no device bytes
        self.host = {n for n in nodes if n.meta.get(OFFLOAD_TAG)}


class Formulas:
    """Bytes as formulas of the input sizes: a schedule that holds at every shape."""

    def __init__(self, sizes: SymbolicSizes):
        self.sizes = sizes

    def value(self, n: fx.Node) -> sympy.Expr:
        return self.sizes.nbytes(n)

    def outputs(self, n: fx.Node, skip: Collection[int]) -> sympy.Expr:
        """The outputs of ``n``, an op returning several, whose index is not in ``skip``."""
        return sympy.Add(*[tensor_bytes(v) for i, v in enumerate(n.meta["val"]) if i not in skip], sympy.Integer(0))

    def scratch(self, n: fx.Node) -> sympy.Expr:
        return scratch_bytes(n)


class AtShape:
    """Bytes at the plan shape, integers, each computed once per node (many walks, one graph)."""

    def __init__(self, sizes: SymbolicSizes):
        self.sizes, self._at = sizes, {}

    def _get(self, key, expr: Callable[[], sympy.Expr]) -> int:
        if key not in self._at:
            self._at[key] = self.sizes.at(expr())
        return self._at[key]

    def value(self, n: fx.Node) -> int:
        return self._get(n, lambda: self.sizes.nbytes(n))

    def outputs(self, n: fx.Node, skip: Collection[int]) -> int:
        return sum(self._get((n, i), lambda v=v: tensor_bytes(v)) for i, v in enumerate(n.meta["val"])
                   if i not in skip)

    def scratch(self, n: fx.Node) -> int:
        return self._get((n, "scratch"), lambda: scratch_bytes(n))


Event = tuple[str, str, sympy.Expr]  # ("alloc", name, bytes) or ("free", name, bytes)
Reuse = Callable[[list, dict, dict, dict, set], Mapping[fx.Node, tuple]]


def walk(inputs: Sequence[fx.Node], body: Sequence[fx.Node], outputs: Iterable, nbytes: Formulas | AtShape,
         facts: NodeFacts, *, counted: Collection[fx.Node] = (),
         shared: Mapping[fx.Node, tuple[fx.Node, fx.Node]] | None = None, reuse: Reuse | None = None,
         states: Collection[fx.Node] = (), reloaded: Collection[fx.Node] = ()) -> list[Event]:
    """A graph's allocations and frees in execution order.

    ``inputs``: what exists when the graph starts; ``counted`` ones are allocated then (the
    others, e.g. parameters, exist before the graph and outlive it). ``body``: the nodes the
    graph runs, in order; ``outputs``: what it returns (alive to the end). ``shared``: input ->
    (the first input sharing its storage, the node owning that storage): a kept view holds its
    whole storage, once however many views of it are kept. ``reuse``: the inner compiler's
    buffer reuse, ``(body, root, last, pos, ran) -> {node: (argument it writes into, ...)}``
    (``graph.reuse.dead_writes``). ``states``: generator states bound to their random op (the
    forward's ``run_and_save_rng_state``): drawn at the op, after its dead inputs are freed.
    ``reloaded``: inputs held in host memory, copied back just before their first read
    (``fxmem::reload``, where the split places it): allocated there, not when the graph starts.
    Nodes of ``facts.host`` (an offload's host copy) allocate no device bytes.
    """
    shared = shared or {}
    ran = set(body) | set(reloaded)  # a reloaded value is the graph's own: an op may write into it
    pos = {n: i for i, n in enumerate([*inputs, *body])}
    end = len(pos)
    outputs = [o for o in outputs if isinstance(o, fx.Node)]
    reads = facts.reads

    def roots_and_last(source: Callable[[fx.Node], fx.Node | None]) -> tuple[dict, dict]:
        root = {n: shared[n][0] if n in shared else n for n in inputs}
        for n in body:
            a = source(n)
            root[n] = root.get(a, a) if a is not None else n
        last: dict = {}
        for n in body:
            p = pos[n]
            for a in reads[n]:
                r = root.get(a)
                if r is not None:  # not a state bound to its op (no longer read)
                    last[r] = p
        for o in outputs:
            if o in root:
                last[root[o]] = end
        return root, last

    root, last = roots_and_last(facts.source.__getitem__)
    written = reuse(body, root, last, pos, ran) if reuse is not None else None
    if written:
        root, last = roots_and_last(lambda n: written[n][0] if n in written else facts.source[n])
    for n, getitems in facts.getitems.items():  # a tuple holds every output until its last getitem
        if n in last:  # (a recomputed norm's ``(y, rstd)``, whose ``rstd`` the backward takes late)
            for u in getitems:
                if u in ran:
                    last[u] = max(last.get(u, -1), last[n])
    events: list[Event] = []
    frees: dict[int, list] = {}

    def allocate(name: str, b, at: int) -> None:
        events.append(("alloc", name, b))
        frees.setdefault(at, []).append((name, b))

    def free(p: int) -> None:
        for name, b in frees.pop(p, ()):
            events.append(("free", name, b))

    waiting = set(reloaded)
    for n in inputs:
        if n in counted and root[n] is n and n not in waiting and n not in facts.host:
            allocate(n.name, nbytes.value(shared[n][1] if n in shared else n), last.get(n, pos[n]))
        free(pos[n])
    for n in body:
        p = pos[n]
        for a in reads[n] if waiting else ():
            if a in waiting:  # copied back from host memory just before this first read
                waiting.discard(a)
                allocate(a.name, nbytes.value(a), last.get(root[a], p))
        if n in facts.replays and n.args[0] in states:  # the op hands out its state: drawn after
            free(p)  # its dead inputs are freed, alive to the end
            allocate(n.args[0].name, nbytes.value(n.args[0]), end)
        if n.op != "call_function":
            free(p)
            continue
        if root[n] is n and n not in facts.early and n not in facts.host:
            if n in facts.several:  # an op returning several: the getitems own their outputs
                taken = {}
                for u in facts.getitems.get(n, ()):
                    if u in ran:
                        taken.setdefault(u.args[1], u)
                allocate(n.name, nbytes.outputs(n, taken), last.get(n, p))
                for u in taken.values():
                    allocate(u.name, nbytes.value(u), last.get(u, p))
            else:
                allocate(n.name, nbytes.value(n), last.get(n, p))
        extra = nbytes.scratch(n)
        if extra != 0:  # the op's own buffers, freed before it returns
            events += [("alloc", f"{n.name}.scratch", extra), ("free", f"{n.name}.scratch", extra)]
        free(p)
    free(end)
    return events


def schedule(gm: fx.GraphModule, sizes: SymbolicSizes, counted: Callable[[fx.Node], bool] = lambda n: True,
             storages: Mapping[fx.Node, tuple[fx.Node, fx.Node]] | None = None) -> list[Event]:
    """:func:`walk` over a graph module, bytes as formulas. Placeholders for which ``counted`` is
    false are not counted (they exist before the graph runs and outlive it, e.g. parameters).
    ``storages``: placeholder -> (the placeholder whose storage it shares, the node owning that
    storage)."""
    nodes = list(gm.graph.nodes)
    inputs = [n for n in nodes if n.op == "placeholder"]
    body = [n for n in nodes if n.op not in ("placeholder", "output")]
    return walk(inputs, body, gm.graph.output_node().all_input_nodes, Formulas(sizes), NodeFacts(nodes),
                counted={n for n in inputs if counted(n)}, shared=storages)


@dataclass(frozen=True)
class Liveness:
    peak: int
    peak_at: str | None  # the node whose allocation reached the peak
    live_at_peak: tuple[tuple[str, int], ...]  # (node name, bytes), largest first


def evaluate(expr: sympy.Expr, values: Mapping[str, int]) -> int:
    """A formula's value; ``values`` is keyed by symbol name (so formulas read back from text work)."""
    if not expr.free_symbols:
        return int(expr)
    return int(expr.xreplace({s: values[s.name] for s in expr.free_symbols}))


def _highest(events: Sequence[tuple[str, str, int]], base: int = 0) -> tuple[int, int]:
    """(the peak of integer events, the index of the allocation reaching it, -1 if none does)."""
    total = best = base
    at = -1
    for i, (kind, _, b) in enumerate(events):
        if kind == "alloc":
            total += b
            if total > best:
                best, at = total, i
        else:
            total -= b
    return best, at


def peak_bytes(events: Sequence[tuple[str, str, int]]) -> int:
    """The peak of a schedule whose bytes are integers (:class:`AtShape`)."""
    return _highest(events)[0]


def peak(events: list[Event], values: Mapping[str, int], base: int = 0) -> Liveness:
    """Walk a schedule at the given symbol values (by name); ``base`` bytes are alive throughout."""
    at_values: dict[sympy.Expr, int] = {}  # a schedule repeats few formulas (each layer's tensors alike)

    def value(expr: sympy.Expr) -> int:
        if expr not in at_values:
            at_values[expr] = evaluate(expr, values)
        return at_values[expr]

    ints = [(kind, name, value(expr)) for kind, name, expr in events]
    best, at = _highest(ints, base)
    live: dict[str, int] = {}
    for kind, name, b in ints[:at + 1]:
        if kind == "alloc":
            live[name] = b
        else:
            live.pop(name)
    snapshot = tuple(sorted(live.items(), key=lambda kv: -kv[1])) if at >= 0 else ()
    return Liveness(best, ints[at][1] if at >= 0 else None, snapshot)


def step_schedules(fw: fx.GraphModule, bw: fx.GraphModule, sizes: SymbolicSizes,
                   inputs: set[str]) -> tuple[list[Event], list[Event]]:
    """The forward's and the backward's schedules within a training step. Not counted: the
    forward's inputs and the backward's placeholders named in ``inputs`` (parameters, the batch
    and views of them), which exist before the step; counted: the kept values and tangents."""
    return (schedule(fw, sizes, counted=lambda n: False),
            schedule(bw, sizes, counted=lambda n: n.name not in inputs, storages=kept_storages(fw, bw)))


def kept_storages(fw: fx.GraphModule, bw: fx.GraphModule) -> dict[fx.Node, tuple[fx.Node, fx.Node]]:
    """The backward's placeholders for kept values -> (the first one sharing their storage, the
    forward node owning the storage): a kept view (an ``expand`` of grouped-query attention's
    keys, a slice of a fused projection) holds its whole storage, once however many views of it
    are kept."""
    root = storage_roots(fw)
    by_name = {n.name: n for n in fw.graph.nodes}
    first: dict[fx.Node, fx.Node] = {}
    out = {}
    for p in bw.graph.find_nodes(op="placeholder"):
        n = by_name.get(p.name)
        if n is None or n.op == "placeholder" or root[n].op == "placeholder":
            continue
        r = root[n]
        out[p] = (first.setdefault(r, p), r)
    return out


def step_peak(fw: fx.GraphModule, bw: fx.GraphModule, sizes: SymbolicSizes, inputs: set[str]) -> int:
    """A training step's peak bytes at the plan shape (forward, then backward)."""
    values = {s.name: v for s, v in sizes.values.items()}
    return max(peak(events, values).peak for events in step_schedules(fw, bw, sizes, inputs))


def simulate(gm: fx.GraphModule, sizes: SymbolicSizes, inputs_freed: bool = True) -> Liveness:
    """The peak at the plan shape. ``inputs_freed=False``: inputs stay alive to the end."""
    events = schedule(gm, sizes)
    if not inputs_freed:
        inputs = {n.name for n in gm.graph.find_nodes(op="placeholder")}
        events = [e for e in events if not (e[0] == "free" and e[1] in inputs)]
    return peak(events, {s.name: v for s, v in sizes.values.items()})
