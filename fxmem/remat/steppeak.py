"""A training step's simulated peak for many saved sets of one joint graph, without building graphs.

The peak of a saved set is that of the forward and backward graphs :func:`.split.split` builds,
as the eager inner compiler rewrites them (``graph.reuse``) and with the forward's random ops
bound to their states (``replay.bind_states``). A budget scores a hundred saved sets or more, and
copying graph nodes and evaluating byte formulas was most of its compile time. :class:`StepPeak`
reads the node lists the split would build off the joint graph and hands them to the one step
simulator, ``graph.liveness.walk``, with every byte count an integer at the plan shape, computed
once per node. ``tests/test_steppeak.py`` checks that it equals the split's on the zoo's models.
"""

from __future__ import annotations

from collections import ChainMap
from functools import partial

import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import find_symbol_binding_fx_nodes, free_symbols

from ..graph.joint import JointGraph, ancestors
from ..graph.liveness import AtShape, NodeFacts, peak_bytes, storage_roots, walk
from ..graph.reuse import dead_writes
from ..graph.sizes import SymbolicSizes
from .fusion import fused_away, fused_facts
from .replay import generator_state
from .settings import Target
from .split import Again, deferred, handoff, late_order, run_twice


class _Copy:
    """A recomputed copy op's second run in a simulated backward: the walk's stand-in for the
    ``<name>_again`` node ``split(..., twice=True)`` makes (same op, arguments and value)."""

    op = "call_function"

    def __init__(self, node: fx.Node):
        self.node, self.name = node, f"{node.name}_again"

    target = property(lambda self: self.node.target)
    args = property(lambda self: self.node.args)
    kwargs = property(lambda self: self.node.kwargs)
    meta = property(lambda self: self.node.meta)
    all_input_nodes = property(lambda self: self.node.all_input_nodes)


class _Overlay:
    """``NodeFacts`` of a backward whose readers after a second copy read that copy."""

    def __init__(self, base: NodeFacts, reads: dict, source: dict):
        self.reads, self.source = ChainMap(reads, base.reads), ChainMap(source, base.source)  # no copy per walk
        self.early, self.several, self.getitems = base.early, base.several, base.getitems
        self.replays, self.host = base.replays, base.host


class StepPeak:
    """``StepPeak(joint, sizes, target)(saved)``: the simulated step peak (bytes at the plan
    shape) of keeping ``saved``, equal to ``step_peak`` of ``split(joint, saved, defer=d,
    twice=t)`` (its dead buffers reused where the target does) where ``d`` and ``t`` are
    :meth:`defers` and :meth:`twice` of ``saved``."""

    def __init__(self, joint: JointGraph, sizes: SymbolicSizes, target: Target, names: set[str] | None = None,
                 released: frozenset[fx.Node] = frozenset()):
        self.joint, self.sizes = joint, sizes
        # what the backward returns, alive to its end: not the gradients the optimizer takes where they are made
        self._returned = [o for o in joint.bwd_outputs if o not in released]
        self.names = joint.input_names() if names is None else names
        nodes = list(joint.gm.graph.nodes)
        self.pos = {n: i for i, n in enumerate(nodes)}
        self.bindings = find_symbol_binding_fx_nodes(joint.gm.graph)
        self._storage = storage_roots(joint.gm)  # a kept view holds its whole storage (liveness.kept_storages)
        self._symbols = {n: free_symbols(n.meta.get("val")) for n in nodes}
        self._facts, self._bytes = NodeFacts(nodes), AtShape(sizes)
        candidates = target.writes()
        self._writes = {n: candidates(n) for n in nodes} if candidates is not None else None
        self._reuse = partial(dead_writes, candidates=self._writes.__getitem__) if candidates is not None else None
        self._twice_ok = target.exact_peak  # the eager inner compiler (see partition.Partitioner)
        self._copies: dict[fx.Node, _Copy] = {}  # a copy op -> its second run's stand-in (one each)
        self._memo: dict = {}  # (saved, offloaded) -> _backward's result

    def __call__(self, saved, offloaded=frozenset()) -> int:
        """``offloaded``: of the saved values, those handed over in host memory (``split``'s)."""
        return max(self._phases(saved, fused=False, offloaded=offloaded))

    def phases(self, saved, offloaded=frozenset()) -> tuple[int, int]:
        """(forward peak, backward peak) of keeping ``saved``: what a step of several graphs adds
        up (``report.memory.chained_peak``)."""
        return self._phases(saved, fused=False, offloaded=offloaded)

    def fused(self, saved, offloaded=frozenset()) -> int:
        """The step peak of keeping ``saved`` with Inductor's fusion modeled (``.fusion``): ops
        never stored are not allocated. Ranks plans whose :meth:`__call__` peaks tie."""
        return max(self._phases(saved, fused=True, offloaded=offloaded))

    def defers(self, saved, offloaded=frozenset()) -> bool:
        """Whether the split of ``saved`` runs the backward's ``split.deferred`` ops just before
        their first user (``split(..., defer=True)``): where that order's simulated backward
        peaks lower than graph order's. The peaks here are of the order chosen."""
        return self._backward(saved, offloaded)[5]

    def twice(self, saved, offloaded=frozenset()) -> bool:
        """Whether the split of ``saved`` runs its recomputed copy ops a second time
        (``split(..., twice=True)``, ``split.run_twice``): where that backward simulates lower."""
        return self._backward(saved, offloaded)[6]

    def _backward(self, saved, offloaded) -> tuple:
        """(recomputed, saved tensors, saved SymInts, the backward's body as run once, its peak,
        whether the body defers ``split.deferred``, whether it runs copy ops twice), memoized per
        saved set: the order of lowest simulated peak of the two :func:`~.split.late_order` gives,
        each as it is and with :func:`~.split.run_twice`'s second copies (eager inner compiler)."""
        key = (frozenset(saved), frozenset(offloaded))
        if key in self._memo:
            return self._memo[key]
        joint = self.joint
        recomputed, tensors, syms_sorted = handoff(joint, set(saved), self.pos, self._symbols.__getitem__,
                                                   self.bindings)
        bw_in = [*syms_sorted, *tensors, *joint.tangents]
        stop = set(bw_in)
        needed, late = ancestors(list(joint.bwd_outputs), stop=stop) - stop, set(recomputed)
        orders = [(late_order(joint.gm, needed, late), False)]
        if deferred(needed, late):
            later = late_order(joint.gm, needed, late, defer=True)
            if later != orders[0][0]:
                orders.append((later, True))
        best = None  # (peak, body, defer, twice): the first of the lowest peak
        for body, defer in orders:
            peak = peak_bytes(self._walk_bw(bw_in, tensors, body, self._facts, offloaded))
            if best is None or peak < best[0]:
                best = (peak, body, defer, False)
            again = self._twice(body, late) if self._twice_ok else None
            if again is not None:
                twice_body, facts, reuse = again
                peak = peak_bytes(self._walk_bw(bw_in, tensors, twice_body, facts, offloaded, reuse))
                if peak < best[0]:
                    best = (peak, body, defer, True)
        peak, body, defer, twice = best
        self._memo[key] = (recomputed, tensors, syms_sorted, body, peak, defer, twice)
        return self._memo[key]

    def _twice(self, body: list, late: set) -> tuple | None:
        """``body`` with :func:`~.split.run_twice`'s second copies, the facts whose readers after a
        second copy read it, and the buffer reuse of those readers' arguments; None: no copies."""
        entries = run_twice(body, late)
        if len(entries) == len(body):
            return None
        facts, reads, source, writes = self._facts, {}, {}, {}
        current: dict = {}  # a copy op -> its second run, once that ran
        out = []
        for e in entries:
            n = e.node if isinstance(e, Again) else e
            m = {a: current[a] for a in facts.reads[n] if a in current}
            x = self._copies.setdefault(n, _Copy(n)) if isinstance(e, Again) else n
            if m or x is not n:
                reads[x] = [m.get(a, a) for a in facts.reads[n]]
                source[x] = m.get(facts.source[n], facts.source[n])
                if self._writes is not None:
                    writes[x] = [(m.get(a, a), m.get(b, b) if isinstance(b, fx.Node) else b)
                                 for a, b in self._writes[n]]
            if x is not n:
                current[n] = x
            out.append(x)
        reuse = None
        if self._writes is not None:
            reuse = partial(dead_writes, candidates=lambda n: writes[n] if n in writes else self._writes[n])
        return out, _Overlay(facts, reads, source), reuse

    def _walk_bw(self, bw_in, tensors, body, facts, offloaded, reuse=None):
        first: dict = {}
        shared = {n: (first.setdefault(self._storage[n], n), self._storage[n]) for n in tensors
                  if self._storage[n].op != "placeholder"}
        return walk(bw_in, body, self._returned, self._bytes, facts,
                    counted={n for n in bw_in if n.name not in self.names}, shared=shared,
                    reuse=self._reuse if reuse is None else reuse, reloaded=offloaded)

    def _phases(self, saved, fused: bool, offloaded=frozenset()) -> tuple[int, int]:
        """(forward peak, backward peak) of keeping ``saved``, ``offloaded`` of it in host memory:
        the forward does not return those (the split's offload runs right after each is made, so
        its device storage dies at its last forward read, as here), the backward allocates each
        at its first read (where the split's reload runs)."""
        joint = self.joint
        recomputed, tensors, syms_sorted, bw_body, bw_peak, _, _ = self._backward(saved, offloaded)
        primals = list(joint.primals)
        fw_out = [*joint.fwd_outputs, *tensors, *syms_sorted]
        fw_body = sorted(ancestors(fw_out, stop=set(primals)) - set(primals), key=self.pos.__getitem__)
        # bind_states: a state leaves the forward; where the backward replays its op, the op
        # hands it out as well
        states = {n for n in tensors if n.op == "call_function" and n.target is generator_state}
        fw_body = [n for n in fw_body if not (n.op == "call_function" and n.target is generator_state)]
        fw_body, fw_facts = self._fused(fw_body, fw_out) if fused else (fw_body, self._facts)
        fw_kept = [o for o in fw_out if o not in offloaded] if offloaded else fw_out
        fw = walk(primals, fw_body, fw_kept, self._bytes, fw_facts, reuse=self._reuse, states=states)
        if fused:
            bw_in = [*syms_sorted, *tensors, *joint.tangents]
            bw_body, bw_facts = self._fused(bw_body, joint.bwd_outputs)
            bw_peak = peak_bytes(self._walk_bw(bw_in, tensors, bw_body, bw_facts, offloaded))
        return peak_bytes(fw), bw_peak

    def _fused(self, body: list, outputs) -> tuple[list, NodeFacts]:
        gone = fused_away(body, [o for o in outputs if isinstance(o, fx.Node)])
        return [n for n in body if n not in gone], fused_facts(self._facts, body, gone)
