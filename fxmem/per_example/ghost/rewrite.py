"""The ghost rewrite of a flat chunk graph: for each clip-weighted batch sum
``mv(t(view(G, [m, -1])), factor)`` of a per-example weight gradient ``G`` whose other uses are
per-example 2-norms, match ``G`` (``rules.py``), choose (fastDP's mixed rule: ghost when
``2 T^2 <= P Q``) and emit the ghost norm and the book-kept sum (``emit.py``). Every such leaf
gets a :class:`Decision`, ghost or materialized, with the reason."""
from __future__ import annotations

import operator
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.fx as fx

from .emit import Emitter, Leaf, acc_dtype
from .rules import RESHAPES, Match, is_op, match, shape_of, single_user

aten = torch.ops.aten
_NORM = aten.linalg_vector_norm.default


@dataclass
class Decision:
    """What the pass did with one per-example matrix gradient (one graph output)."""
    output: int                       # index of the chunk graph output holding its clipped sum
    kind: str                         # "linear", "embedding", "linear+embedding", ... or "other"
    shape: tuple[int, ...]            # per-example gradient shape (no batch dim)
    tokens: int | None = None         # T: rows summed per example (all uses together)
    choice: str = "materialize"       # "ghost" | "materialize"
    reason: str = ""
    param: str | None = None          # a readable name, where one is known

    def summary(self) -> dict:
        return asdict(self)


def _norm_chain(start: fx.Node, m: int) -> tuple[fx.Node, list[fx.Node]] | None:
    """``start`` -> reshapes -> 2-norms over non-batch dims ... -> ``[m]``: (the norm, the chain)."""
    chain, n = [], start
    while n.target in RESHAPES and single_user(n):
        chain.append(n)
        n = next(iter(n.users))
        if not (n.op == "call_function"):
            return None
    while is_op(n, _NORM):
        ord_ = n.args[1] if len(n.args) > 1 else n.kwargs.get("ord", 2)
        dims = n.args[2] if len(n.args) > 2 else n.kwargs.get("dim")
        keep = n.args[3] if len(n.args) > 3 else n.kwargs.get("keepdim", False)
        src_shape = shape_of(n.args[0])
        if ord_ != 2 or keep or dims is None or src_shape is None or src_shape[0] != m:
            return None
        dims = [dims] if isinstance(dims, int) else list(dims)
        if any(d % len(src_shape) == 0 for d in dims):
            return None
        chain.append(n)
        if shape_of(n) == (m,):
            return n, chain
        if not single_user(n):
            return None
        n = next(iter(n.users))
    return None


def _fake_mode(gm: fx.GraphModule):
    from torch._guards import detect_fake_mode

    vals = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    return detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])


def _leaf_kind(kinds: list[str]) -> str:
    return "+".join(dict.fromkeys(kinds)) + (" (tied: one weight, several uses)" if len(kinds) > 1 else "")


def rewrite(gm: fx.GraphModule, names: list[str] | None = None) -> list[Decision]:
    """Rewrite ``gm`` (a flat chunk graph) in place; returns a decision per per-example matrix
    gradient that reaches a clip-weighted sum (in output order)."""
    graph = gm.graph
    fake_mode = _fake_mode(gm)
    outputs = list(graph.output_node().args[0]) if graph.output_node().args else []
    out_index = {}
    for i, o in enumerate(outputs):
        if isinstance(o, fx.Node):
            out_index.setdefault(o, i)
    decisions: list[Decision] = []
    order = {n: i for i, n in enumerate(graph.nodes)}
    for mv in [n for n in graph.nodes if is_op(n, aten.mv.default)]:
        d = _one_leaf(gm, mv, fake_mode, out_index, order, names)
        if d is not None:
            decisions.append(d)
    if any(d.choice == "ghost" for d in decisions):
        graph.lint()
        gm.recompile()
    decisions.sort(key=lambda d: d.output)
    return decisions


_VIEWS = RESHAPES | {aten.transpose.int, aten.permute.default, aten.t.default}
_MATMULS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.embedding.default}


def _base(n: Any) -> Any:
    while is_op(n, *_VIEWS):
        n = n.args[0]
    return n


def _family(n: fx.Node) -> list[fx.Node]:
    """``n`` and every view of it."""
    out, todo = [], [n]
    while todo:
        x = todo.pop()
        out.append(x)
        todo += [u for u in x.users if is_op(u, *_VIEWS) and u.args[0] is x]
    return out


def _param_name(state: Match, names: list[str] | None, graph: fx.Graph) -> str | None:
    """Best effort: the placeholder (weight) that the layer's forward or input-gradient matmul
    multiplies one of the factors with, or the embedding table its ids index."""
    if not names:
        return None
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    shapes = {(state.P, state.Q), (state.Q, state.P)}
    unique = set()
    for t in state.terms:
        for f in (t.L, t.R):   # each factor separately: a layer input may feed several weights
            found = set()
            for x in _family(_base(f.node)):
                for u in x.users:
                    if not is_op(u, *_MATMULS):
                        continue
                    for a in u.args:
                        w = _base(a)
                        if w is not x and isinstance(w, fx.Node) and w.op == "placeholder" and shape_of(w) in shapes:
                            found.add(w)
            if len(found) == 1:
                unique |= found
    if len(unique) != 1:
        return None
    i = placeholders.index(unique.pop())
    if i >= len(names):
        return None
    name = names[i]
    return name[2:].rstrip("_") if name.startswith("l_") else name


def _is_upcast(n: fx.Node) -> bool:
    """``_to_copy(x, dtype=float32/64)``: a dtype conversion only."""
    return (is_op(n, aten._to_copy.default) and set(n.kwargs) == {"dtype"}
            and n.kwargs["dtype"] in (torch.float32, torch.float64))


def _output_of(mv: fx.Node, out_index: dict) -> int:
    n = mv
    while True:
        if n in out_index:
            return out_index[n]
        users = [u for u in n.users if u.op == "call_function" and u.target in RESHAPES]
        if len(n.users) != 1 or not users:
            return -1
        n = users[0]


def _one_leaf(gm: fx.GraphModule, mv: fx.Node, fake_mode, out_index: dict, order: dict,
              names: list[str] | None = None) -> Decision | None:
    # mv(t(view(Z, [m, -1])), factor): walk back to Z, the per-example gradient leaf
    chain, n = [mv], mv.args[0]
    if not is_op(n, aten.t.default):
        return None
    while (is_op(n, aten.t.default, *RESHAPES) or _is_upcast(n)) and single_user(n):
        chain.append(n)   # an upcast: low-precision gradients summed in float32 (fxmem.dpsgd)
        n = n.args[0]
    Z = n
    zs = shape_of(Z)
    if zs is None or len(zs) < 2:
        return None
    m = zs[0]
    factor = mv.args[1]
    if shape_of(factor) != (m,) or shape_of(chain[-1]) is None or shape_of(chain[-1])[0] != m:
        return None
    if len(zs) == 2:   # a per-example vector (bias, norm weight): stays materialized, not reported
        return None
    index = _output_of(mv, out_index)
    decision = Decision(index, "other", zs[1:])
    # every use of Z: this matvec and per-example 2-norms
    norms, dead = [], list(chain)
    for u in Z.users:
        if u is chain[-1]:
            continue
        got = _norm_chain(u, m)
        if got is None:
            decision.reason = f"the per-example gradient has another use ({u.target})"
            return decision
        norms.append(got[0])
        dead += got[1]
    if not norms:
        decision.reason = "no per-example norm of it"
        return decision
    src = Z.args[0] if is_op(Z, aten.nan_to_num.default) else Z
    if src is not Z:
        if not single_user(src):
            decision.reason = "the per-example gradient has other uses"
            return decision
        dead.append(Z)
    state = match(src, m)
    if not state:
        decision.reason = f"not a linear or embedding weight gradient{': ' + state.reason if state.reason else ''}"
        return decision
    if any(t.L.kind == "onehot" and t.R.kind == "onehot" for t in state.terms):
        decision.reason = "one-hot times one-hot"
        return decision
    T = sum(t.L.T for t in state.terms)
    P, Q = state.P, state.Q
    decision.kind = _leaf_kind(state.kinds)
    decision.param = _param_name(state, names, gm.graph)
    decision.tokens = T
    if 2 * T * T > P * Q:
        decision.reason = f"2*T^2 = {2 * T * T} > P*Q = {P * Q}: materializing is cheaper"
        return decision
    decision.choice = "ghost"
    decision.reason = f"2*T^2 = {2 * T * T} <= P*Q = {P * Q}"
    # --- emit ---------------------------------------------------------------------------------
    graph = gm.graph
    zdtype = Z.meta["val"].dtype
    acc = acc_dtype(zdtype)
    last_source = max(state.sources, key=lambda s: order[s])
    emit = Emitter(graph, fake_mode)
    with graph.inserting_after(last_source):
        # inserting_after(n) puts every new node directly after n (reversing their order): an
        # anchor there, and each new node inserted before it, keeps them in program order
        anchor = graph.call_function(operator.add, (0, 0))
    with graph.inserting_before(anchor):
        leaf = Leaf(emit, state, m, acc)
        sq = leaf.norm_sq()
    graph.erase_node(anchor)
    for norm in norms:
        with graph.inserting_before(norm):
            new = emit(aten.sqrt.default, sq)
            if norm.meta["val"].dtype != acc:
                new = emit(aten._to_copy.default, new, dtype=norm.meta["val"].dtype)
        norm.replace_all_uses_with(new)
    with graph.inserting_before(mv):
        leaf.forget_views()   # the sum runs later: its own views (the norm's are dead by then)
        total = leaf.weighted_sum(factor, mv.meta["val"].dtype)
        flat = emit(aten.reshape.default, total, [-1])
    mv.replace_all_uses_with(flat)
    _erase_dead(graph, dead + state.nodes + norms)
    return decision


def _erase_dead(graph: fx.Graph, nodes: list[fx.Node]) -> None:
    pending = list(dict.fromkeys(nodes))
    changed = True
    while changed:
        changed = False
        for n in list(pending):
            if not n.users:
                graph.erase_node(n)
                pending.remove(n)
                changed = True
