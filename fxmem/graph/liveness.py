"""Liveness: a graph's allocations in order, as a schedule of byte formulas, and its peak.

Every op that is not a view, a getitem or an in-place write allocates its output; a storage is
freed after the last read of any node aliasing it (boxed graphs free their inputs the same way).
Ops with known internal buffers (:mod:`.scratch`) allocate and free them where they run.
Graph outputs stay alive. The schedule holds formulas, so one schedule gives the peak at any shape.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Callable, Mapping

import sympy
import torch
import torch.fx as fx

from .inplace import WRITES_INTO_FIRST
from .scratch import scratch_bytes
from .sizes import SymbolicSizes, tensor_bytes

# Views whose schema declares no alias (autograd does not track them) but that share storage:
# ``_unsafe_view`` ends every matmul of a 3-D input (``mm`` then ``_unsafe_view``).
_UNTRACKED_VIEWS = {torch.ops.aten._unsafe_view.default}


def is_alias(node: fx.Node) -> bool:
    """Shares its first input's storage: a view, a getitem, or an in-place op."""
    if node.target is operator.getitem or node.target in WRITES_INTO_FIRST or node.target in _UNTRACKED_VIEWS:
        return True
    schema = getattr(node.target, "_schema", None)
    return bool(schema and schema.returns and schema.returns[0].alias_info is not None)


def _is_element(node: fx.Node) -> bool:
    """One output of an op that returns several (``native_layer_norm``'s mean, a replayed
    dropout's mask): its own storage, unlike an element of a view-returning op (``split``)."""
    if node.target is not operator.getitem or not node.args or not isinstance(node.args[0], fx.Node):
        return False
    src = node.args[0]
    return isinstance(src.meta.get("val"), (tuple, list)) and (not is_alias(src) or _is_element(src))


def storage_roots(gm: fx.GraphModule, shared: Mapping[fx.Node, fx.Node] | None = None) -> dict[fx.Node, fx.Node]:
    """Node -> the node whose output storage it is (what keeping it keeps alive). ``shared``:
    placeholders known to share another placeholder's storage (kept views of one tensor)."""
    root: dict[fx.Node, fx.Node] = dict(shared or {})
    for n in gm.graph.nodes:
        if n in root:
            continue
        aliases = (n.op == "call_function" and is_alias(n) and n.args and isinstance(n.args[0], fx.Node)
                   and not _is_element(n))
        root[n] = root.get(n.args[0], n.args[0]) if aliases else n
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


def _taken_early(n: fx.Node) -> bool:
    """A getitem among ``elements`` of its op (allocated there)."""
    return _is_element(n) and not is_alias(n.args[0])


def _allocated(n: fx.Node, sizes: SymbolicSizes) -> sympy.Expr:
    """Bytes ``n`` allocates; of a tuple, the outputs no getitem takes (the others are their own)."""
    val = n.meta.get("val")
    if not isinstance(val, (tuple, list)):
        return sizes.nbytes(n)
    taken = {u.args[1] for u in n.users if u.target is operator.getitem}
    return sympy.Add(*[tensor_bytes(v) for i, v in enumerate(val) if i not in taken], sympy.Integer(0))


def last_reads(gm: fx.GraphModule, root: dict[fx.Node, fx.Node]) -> dict[fx.Node, int]:
    """Storage root -> position of the last node reading it through any alias (the output node
    reads what the graph returns)."""
    last: dict[fx.Node, int] = {}
    for i, n in enumerate(gm.graph.nodes):
        for a in n.all_input_nodes:
            last[root[a]] = max(last.get(root[a], -1), i)
    return last


def tuple_held(gm: fx.GraphModule, last: dict[fx.Node, int]) -> dict[fx.Node, int]:
    """``last`` with each output of an op returning several freed no earlier than the op's last
    getitem: the tuple holds every output until then (a recomputed norm's ``(y, rstd)``, whose
    ``rstd`` getitem the backward takes late, keeps ``y`` alive)."""
    out = dict(last)
    for n in gm.graph.nodes:
        if n in last:
            for u in elements(n):
                out[u] = max(out.get(u, -1), last[n])
    return out


Event = tuple[str, str, sympy.Expr]  # ("alloc", name, bytes) or ("free", name, bytes)


def schedule(gm: fx.GraphModule, sizes: SymbolicSizes, counted: Callable[[fx.Node], bool] = lambda n: True,
             storages: Mapping[fx.Node, tuple[fx.Node, sympy.Expr]] | None = None) -> list[Event]:
    """Allocations and frees in execution order. Placeholders for which ``counted`` is false are
    not counted (they exist before the graph runs and outlive it, e.g. parameters). ``storages``:
    placeholder -> (the placeholder whose storage it shares, that storage's bytes)."""
    storages = storages or {}
    nodes = list(gm.graph.nodes)
    root = storage_roots(gm, {p: q for p, (q, _) in storages.items()})
    last = tuple_held(gm, last_reads(gm, root))
    events: list[Event] = []
    live: dict[fx.Node, sympy.Expr] = {}
    for i, n in enumerate(nodes):
        if n.op == "placeholder" and counted(n) and root[n] is n:
            live[n] = storages[n][1] if n in storages else sizes.nbytes(n)
            events.append(("alloc", n.name, live[n]))
        elif n.op == "call_function" and root[n] is n and not _taken_early(n):
            live[n] = _allocated(n, sizes)
            events.append(("alloc", n.name, live[n]))
            for u in elements(n):
                live[u] = sizes.nbytes(u)
                events.append(("alloc", u.name, live[u]))
        extra = scratch_bytes(n) if n.op == "call_function" else 0
        if extra != 0:  # the op's own buffers, freed before it returns
            events += [("alloc", f"{n.name}.scratch", extra), ("free", f"{n.name}.scratch", extra)]
        for r in [r for r in live if last.get(r, i) == i]:
            events.append(("free", r.name, live.pop(r)))
    return events


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


def peak(events: list[Event], values: Mapping[str, int], base: int = 0) -> Liveness:
    """Walk a schedule at the given symbol values (by name); ``base`` bytes are alive throughout."""
    live: dict[str, int] = {}
    total, best, at, snapshot = base, base, None, ()
    for kind, name, expr in events:
        b = evaluate(expr, values)
        if kind == "alloc":
            live[name] = b
            total += b
            if total > best:
                best, at = total, name
                snapshot = tuple(sorted(live.items(), key=lambda kv: -kv[1]))
        else:
            total -= live.pop(name)
    return Liveness(best, at, snapshot)


def step_schedules(fw: fx.GraphModule, bw: fx.GraphModule, sizes: SymbolicSizes,
                   inputs: set[str]) -> tuple[list[Event], list[Event]]:
    """The forward's and the backward's schedules within a training step. Not counted: the
    forward's inputs and the backward's placeholders named in ``inputs`` (parameters, the batch
    and views of them), which exist before the step; counted: the kept values and tangents."""
    return (schedule(fw, sizes, counted=lambda n: False),
            schedule(bw, sizes, counted=lambda n: n.name not in inputs, storages=kept_storages(fw, bw, sizes)))


def kept_storages(fw: fx.GraphModule, bw: fx.GraphModule,
                  sizes: SymbolicSizes) -> dict[fx.Node, tuple[fx.Node, sympy.Expr]]:
    """The backward's placeholders for kept values -> (the first one sharing their storage, the
    storage's bytes): a kept view (an ``expand`` of grouped-query attention's keys, a slice of a
    fused projection) holds its whole storage, once however many views of it are kept."""
    root = storage_roots(fw)
    by_name = {n.name: n for n in fw.graph.nodes}
    first: dict[fx.Node, fx.Node] = {}
    out = {}
    for p in bw.graph.find_nodes(op="placeholder"):
        n = by_name.get(p.name)
        if n is None or n.op == "placeholder" or root[n].op == "placeholder":
            continue
        r = root[n]
        out[p] = (first.setdefault(r, p), sizes.nbytes(r))
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
