"""A training step's simulated peak for many saved sets of one joint graph, without building graphs.

The peak of a saved set is that of the forward and backward graphs :func:`.split.split` builds,
as the eager inner compiler rewrites them (``inner.reuse_dead_buffers``) and with the forward's
random ops bound to their states (``replay.bind_states``), walked by ``graph.liveness``. A budget
scores a hundred saved sets or more, and copying graph nodes and evaluating byte formulas was
most of its compile time. :class:`StepPeak` computes the same number on the joint graph itself:
the same nodes in the same order, every byte count an integer at the plan shape, computed once
per node. ``tests/test_steppeak.py`` checks that it equals the split's on the zoo's models.
"""

from __future__ import annotations

import operator

import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import find_symbol_binding_fx_nodes, free_symbols

from ..graph.joint import JointGraph, ancestors
from ..graph.liveness import _is_element, _taken_early, elements, is_alias, storage_roots
from ..graph.scratch import scratch_bytes
from ..graph.sizes import SymbolicSizes, tensor_bytes
from ..inner import write_candidates
from .replay import generator_state, wrapped_target
from .settings import Target
from .split import _late_order, handoff


class StepPeak:
    """``StepPeak(joint, sizes, target)(saved)``: the simulated step peak (bytes at the plan
    shape) of keeping ``saved``, equal to ``step_peak`` of ``split(joint, saved)``."""

    def __init__(self, joint: JointGraph, sizes: SymbolicSizes, target: Target, names: set[str] | None = None):
        self.joint, self.sizes = joint, sizes
        self.names = joint.input_names() if names is None else names
        self.reuse = target.reuses_buffers
        self.pos = {n: i for i, n in enumerate(joint.gm.graph.nodes)}
        self.bindings = find_symbol_binding_fx_nodes(joint.gm.graph)
        self._storage = storage_roots(joint.gm)  # a kept view holds its whole storage (liveness.kept_storages)
        self._bytes: dict = {}
        self._source: dict[fx.Node, fx.Node | None] = {}
        self._writes: dict[fx.Node, list] = {}
        self._reads = {n: n.all_input_nodes for n in joint.gm.graph.nodes}
        self._replays = {n for n in joint.gm.graph.nodes if wrapped_target(n) is not None}
        self._symbols = {n: free_symbols(n.meta.get("val")) for n in joint.gm.graph.nodes}
        self._early = {n for n in joint.gm.graph.nodes if _taken_early(n)}  # allocated by their op
        self._getitems = {n: [u for u in n.users if u.target is operator.getitem]  # of an op's outputs
                          for n in joint.gm.graph.nodes if elements(n)}

    def _at(self, key, expr) -> int:
        if key not in self._bytes:
            self._bytes[key] = self.sizes.at(expr())
        return self._bytes[key]

    def _nbytes(self, n: fx.Node, body) -> int:
        """Bytes ``n`` allocates; of a tuple, the outputs that no getitem the graph runs takes (a
        kept one is an input of the graph: the op recomputes it anyway)."""
        val = n.meta.get("val")
        if not isinstance(val, (tuple, list)):
            return self._at(n, lambda: self.sizes.nbytes(n))
        taken = {u.args[1] for u in n.users if u.target is operator.getitem and u in body}
        return sum(self._at((n, i), lambda v=v: tensor_bytes(v)) for i, v in enumerate(val) if i not in taken)

    def _scratch(self, n: fx.Node) -> int:
        return self._at((n, "scratch"), lambda: scratch_bytes(n))

    def _alias_source(self, n: fx.Node) -> fx.Node | None:
        """The node whose storage ``n`` shares (``liveness.storage_roots``' rule), else None."""
        if n not in self._source:
            a = n.args[0] if n.args else None
            self._source[n] = a if (n.op == "call_function" and isinstance(a, fx.Node) and is_alias(n)
                                    and not _is_element(n)) else None
        return self._source[n]

    def __call__(self, saved) -> int:
        joint = self.joint
        recomputed, tensors, syms_sorted = handoff(joint, set(saved), self.pos, self._symbols.__getitem__,
                                                   self.bindings)
        primals = list(joint.primals)
        fw_out = [*joint.fwd_outputs, *tensors, *syms_sorted]
        fw_body = sorted(ancestors(fw_out, stop=set(primals)) - set(primals), key=self.pos.__getitem__)
        # bind_states: a state leaves the forward; where the backward replays its op, the op
        # hands it out as well (one node, drawn after the op's inputs are freed)
        saved_states = {n for n in tensors if n.op == "call_function" and n.target is generator_state}
        fw_body = [n for n in fw_body if not (n.op == "call_function" and n.target is generator_state)]
        fw = self._peak(primals, set(), fw_body, fw_out, saved_states)
        bw_in = [*syms_sorted, *tensors, *joint.tangents]
        stop = set(bw_in)
        bw_body = _late_order(joint.gm, ancestors(list(joint.bwd_outputs), stop=stop) - stop, set(recomputed))
        counted = {n for n in bw_in if n.name not in self.names}
        first: dict = {}
        shared = {n: first.setdefault(self._storage[n], n) for n in tensors
                  if self._storage[n].op != "placeholder"}
        return max(fw, self._peak(bw_in, counted, bw_body, list(joint.bwd_outputs), set(), shared))

    def _peak(self, inputs: list, counted: set, body: list, outputs: list, saved_states: set,
              shared: dict | None = None) -> int:
        """The peak of one graph: ``inputs`` (``counted`` ones allocated), ``body`` in order,
        ``outputs`` read at the end; ``saved_states``: forward states handed out by their op;
        ``shared``: input -> the first input sharing its storage (allocated once, at the
        storage's bytes)."""
        shared = shared or {}
        ran = set(body)
        members = set(inputs) | ran
        pos = {n: i for i, n in enumerate([*inputs, *body])}
        end = len(pos)

        def reads(n):  # a bound random op no longer reads its state
            return [a for a in self._reads[n] if a in members] if n in self._replays else self._reads[n]

        def roots_and_last(first):
            root = {n: shared.get(n, n) for n in inputs}
            for n in body:
                a = first(n)
                root[n] = root.get(a, a) if a is not None else n
            last: dict = {}
            for n in body:
                for a in reads(n):
                    last[root[a]] = pos[n]
            for o in outputs:
                if isinstance(o, fx.Node) and o in root:  # not a bound state (freed at the end)
                    last[root[o]] = end
            return root, last

        root, last = roots_and_last(self._alias_source)
        if self.reuse:
            written = self._reused(body, root, last, pos, ran)
            root, last = roots_and_last(lambda n: written.get(n) or self._alias_source(n))
        for n, getitems in self._getitems.items():  # a tuple holds its outputs to its last getitem
            if n in last:  # (liveness.tuple_held); the getitems of an op's outputs own their storage
                for u in getitems:
                    if u in ran:
                        last[u] = max(last.get(u, -1), last[n])
        total = best = 0
        frees: dict[int, list] = {}
        for n in inputs:
            if n in counted and root[n] is n:
                b = self._nbytes(self._storage[n], ran) if n in shared else self._nbytes(n, ran)
                total += b
                best = max(best, total)
                frees.setdefault(last.get(n, pos[n]), []).append(b)
            for b in frees.pop(pos[n], ()):
                total -= b
        for n in body:
            p = pos[n]
            if wrapped_target(n) is not None and n.args[0] in saved_states:  # freed before it draws
                for b in frees.pop(p, ()):
                    total -= b
                state = self._nbytes(n.args[0], ran)
                total += state
                best = max(best, total)
                frees.setdefault(end, []).append(state)
            if n.op == "call_function" and root[n] is n and n not in self._early:
                taken = {u.args[1]: u for u in reversed(self._getitems.get(n, ())) if u in ran}  # first per output
                for m in [n, *taken.values()]:  # a tuple's outputs at once
                    b = self._nbytes(m, ran)
                    total += b
                    best = max(best, total)
                    frees.setdefault(last.get(m, p), []).append(b)
            if n.op == "call_function":
                best = max(best, total + self._scratch(n))
            for b in frees.pop(p, ()):
                total -= b
        return best

    def _reused(self, body: list, root: dict, last: dict, pos: dict, ran: set) -> dict:
        """``inner.reuse_dead_buffers``' rewrites: node -> the argument it now writes into (whose
        storage this graph allocated, ``ran``, and dies here)."""
        written = {}
        for n in body:
            if n not in self._writes:
                self._writes[n] = write_candidates(n)
            for a, b in self._writes[n]:
                r = root[a]
                if (r in ran and r.op == "call_function" and last.get(r) == pos[n]
                        and not (isinstance(b, fx.Node) and root[b] is r)):
                    written[n] = a
                    break
        return written
