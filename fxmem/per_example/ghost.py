"""Ghost norms and book-keeping inside a per-example chunk graph.

Input: the flat aten graph of a chunk (``vmap(grad(loss))`` for m examples, then the per-example
norms, clip factors and clip-weighted sums of ``fxmem.dpsgd``'s epilogue after ``chunk.py``'s
rewrites). A per-example weight gradient ``G [m, P, Q]`` of a linear layer is
``G_i = L_i^T R_i`` with ``L_i [T, P]`` the layer's output gradient and ``R_i [T, Q]`` its input
(or the other way round: Conv1D, or a transposed weight), in the graph a ``bmm`` over the batch;
an embedding's is the same with ``L_i`` the one-hot rows of the token ids
(``embedding_dense_backward``). When ``G``'s only uses are

    norm  = vector_norm(...vector_norm(view(G), dim=2)..., dim=1)        the per-example L2 norm
    sum   = mv(view(G, [m, -1]).t(), factor)                             the clip-weighted batch sum

(optionally through ``nan_to_num``), this pass replaces them by

    norm_i^2 = sum((L_i L_i^T) * (R_i R_i^T))                  ghost norm: two [T, T] Gram matrices
    sum      = (factor * L)^T R over all m*T tokens           book-keeping: one matmul per layer

so the ``[m, P, Q]`` tensor never exists; ``L`` and ``R`` stay alive until the clip factors are
known. A sum of such terms (a weight used twice: tied embedding and output projection) gets the
cross terms ``2 sum((L_k L_l^T) * (R_k R_l^T))`` (the norm of a sum is not the sum of norms).
Gram matrices of one-hot factors are equality masks of the ids (or a ``gather`` of the other
factor at the ids), never a ``[T, vocab]`` one-hot tensor.

Per leaf it chooses the ghost norm when ``2 T^2 <= P Q`` and keeps the materialized gradient
otherwise (fastDP's mixed rule); every leaf with a per-example matrix gradient gets a
:class:`Decision` (``ChunkPlan.ghost``, the report). Anything not matching exactly is left alone.

Non-finite values: ``nan_to_num`` on a materialized gradient zeroes single elements, which a
ghost norm cannot do. A ghost norm that is not finite becomes nan, so it poisons the chunk's
sums, and :class:`Guarded` reruns such a chunk with the materialized graph (compiled on first need):
exact semantics, at the price of a finite check per chunk.
"""
from __future__ import annotations

import logging
import math
import operator
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch
import torch.fx as fx

from ..graph.module import graph_module

log = logging.getLogger("fxmem")
aten = torch.ops.aten

# ops that keep the batch dim first and the row-major element order (a reshape of the same data)
_RESHAPES = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.clone.default,
             aten.alias.default, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims,
             aten.expand.default, aten.contiguous.default}
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


# --- the factors of G_i = L_i^T R_i ------------------------------------------------------------


@dataclass
class Factor:
    """``[m, T, n]`` rows per token: a dense tensor (``node``, or its transpose ``[m, n, T]``,
    or ``W [T, m*n]`` laid out per token: ``layout``) or the one-hot rows of int ids ``[m, T]``
    (``[T]`` when every example has the same ids: ``shared``)."""
    kind: str                 # "dense" | "onehot"
    node: fx.Node
    n: int
    T: int
    layout: str = "mtn"       # dense: "mtn" [m, T, n] (any view of it), "mnt" [m, n, T], "tmn" [T, m*n]
    shared: bool = False      # onehot: ids [T] common to all examples


@dataclass
class Term:
    L: Factor
    R: Factor


@dataclass
class _State:
    terms: list[Term]
    P: int
    Q: int
    shape: tuple[int, ...]    # the current tensor = reshape of the [m, P, Q] products
    nodes: list[fx.Node] = field(default_factory=list)  # nodes of the chain/tree (deleted after)
    sources: list[fx.Node] = field(default_factory=list)
    kinds: list[str] = field(default_factory=list)


def _val(n: Any):
    return n.meta.get("val") if isinstance(n, fx.Node) else None


def _shape(n: fx.Node) -> tuple[int, ...] | None:
    v = _val(n)
    if not isinstance(v, torch.Tensor):
        return None
    try:
        return tuple(int(s) for s in v.shape)
    except (TypeError, ValueError):  # symbolic
        return None


def _is(n: Any, *targets) -> bool:
    return isinstance(n, fx.Node) and n.op == "call_function" and n.target in targets


def _single_user(n: fx.Node) -> bool:
    return len(n.users) == 1


class _NoMatch(Exception):
    pass


def _need(cond: bool, why: str = "") -> None:
    if not cond:
        raise _NoMatch(why)


# --- matching: from the per-example gradient back to its sources ------------------------------


def _resolve(n: fx.Node, m: int) -> _State:
    """The state of ``n`` (a per-example gradient ``[m, ...]``) as a reshaped sum of products."""
    shape = _shape(n)
    _need(shape is not None and len(shape) >= 2 and shape[0] == m, "no static [m, ...] shape")
    if _is(n, aten.bmm.default):
        X, Y = n.args
        xs, ys = _shape(X), _shape(Y)
        _need(xs is not None and ys is not None and xs[0] == ys[0] == m and xs[2] == ys[1])
        P, T, Q = xs[1], xs[2], ys[2]
        return _State([Term(Factor("dense", X, P, T, "mnt"), Factor("dense", Y, Q, T))], P, Q,
                      (m, P, Q), [n], [n], ["linear"])
    emb = _embedding(n, m)
    if emb is not None:
        return emb
    if _is(n, aten.add.Tensor) and len(n.args) == 2 and not n.kwargs:
        a, b = n.args
        _need(isinstance(a, fx.Node) and isinstance(b, fx.Node) and _single_user(a) and _single_user(b))
        sa, sb = _resolve(a, m), _resolve(b, m)
        _need(sa.shape == sb.shape == shape and (sa.P, sa.Q) == (sb.P, sb.Q), "summands laid out differently")
        return _State(sa.terms + sb.terms, sa.P, sa.Q, shape, sa.nodes + sb.nodes + [n],
                      sa.sources + sb.sources, sa.kinds + sb.kinds)
    _need(n.op == "call_function" and n.args and isinstance(n.args[0], fx.Node), "not a rearrangement")
    src = n.args[0]
    _need(_single_user(src), "the gradient has other uses")
    if n.target in _RESHAPES:
        if n.target is aten.expand.default:
            _need(_shape(src) == shape, "a broadcasting expand")
        s = _resolve(src, m)
        s.shape, s.nodes = shape, s.nodes + [n]
        return s
    swap = (n.target is aten.transpose.int and len(shape) == 3 and sorted(d % 3 for d in n.args[1:3]) == [1, 2]) or \
        (n.target is aten.permute.default and len(shape) == 3 and [d % 3 for d in n.args[1]] == [0, 2, 1])
    _need(swap, f"{n.target} is not a reshape or a transpose of the last two dims")
    s = _resolve(src, m)
    _need(s.shape == (m, s.P, s.Q), "transpose of a reshaped gradient")
    s.terms = [Term(t.R, t.L) for t in s.terms]
    s.P, s.Q, s.shape, s.nodes = s.Q, s.P, shape, s.nodes + [n]
    return s


def _embedding(n: fx.Node, m: int) -> _State | None:
    """``view(embedding_dense_backward(gout, ids + i*V, m*V), [m, V, d])`` (vmap's batching rule
    with per-example ids), or ``permute(view(edb(W [T, m*d], idx [T], V), [V, m, d]), [1, 0, 2])``
    (ids shared by every example: positions)."""
    shape = _shape(n)
    if _is(n, aten.view.default, aten._unsafe_view.default, aten.reshape.default) and len(shape) == 3 \
            and _is(n.args[0], aten.embedding_dense_backward.default):
        edb = n.args[0]
        gout, idx, num_weights, padding_idx, scale = edb.args
        _need(_single_user(edb) and padding_idx == -1 and not scale, "padding_idx or scale_grad_by_freq")
        V, d = shape[1], shape[2]
        _need(num_weights == m * V and _shape(edb) == (m * V, d))
        _need(_is(idx, aten.add.Tensor) and len(idx.args) == 2, "ids without per-example offsets")
        ids = offs = None
        for a, b in (idx.args, idx.args[::-1]):
            if isinstance(b, fx.Node) and _is(b, aten.view.default, aten._unsafe_view.default, aten.reshape.default) \
                    and _is(b.args[0], aten.arange.start_step) and tuple(b.args[0].args[:3]) == (0, m * V, V):
                ids, offs = a, b
        _need(ids is not None and isinstance(ids, fx.Node), "ids without per-example offsets")
        ishape, gshape = _shape(ids), _shape(gout)
        _need(ishape is not None and gshape is not None and ishape[0] == m and gshape == ishape + (d,))
        T = math.prod(ishape[1:])
        extra = [x for x in (idx, offs, offs.args[0]) if len(x.users) == 1]
        return _State([Term(Factor("onehot", ids, V, T), Factor("dense", gout, d, T))], V, d, shape,
                      [n, edb] + extra, [edb], ["embedding"])
    if _is(n, aten.permute.default) and len(shape) == 3 and list(n.args[1]) == [1, 0, 2]:
        v = n.args[0]
        if not (_is(v, aten.view.default, aten._unsafe_view.default)
                and _is(v.args[0], aten.embedding_dense_backward.default)):
            return None
        edb = v.args[0]
        W, idx, num_weights, padding_idx, scale = edb.args
        V, d = shape[1], shape[2]
        ws, ishape = _shape(W), _shape(idx)
        _need(_single_user(v) and _single_user(edb) and padding_idx == -1 and not scale)
        _need(num_weights == V and _shape(v) == (V, m, d) and ishape is not None and ws is not None
              and ws == ishape + (m * d,), "unbatched embedding of another layout")
        T = math.prod(ishape)
        return _State([Term(Factor("onehot", idx, V, T, shared=True), Factor("dense", W, d, T, "tmn"))],
                      V, d, shape, [n, v, edb], [edb], ["embedding"])
    return None


def _norm_chain(start: fx.Node, m: int) -> tuple[fx.Node, list[fx.Node]] | None:
    """``start`` -> reshapes -> 2-norms over non-batch dims ... -> ``[m]``: (the norm, the chain)."""
    chain, n = [], start
    while n.target in _RESHAPES and _single_user(n):
        chain.append(n)
        n = next(iter(n.users))
        if not (n.op == "call_function"):
            return None
    while _is(n, _NORM):
        ord_ = n.args[1] if len(n.args) > 1 else n.kwargs.get("ord", 2)
        dims = n.args[2] if len(n.args) > 2 else n.kwargs.get("dim")
        keep = n.args[3] if len(n.args) > 3 else n.kwargs.get("keepdim", False)
        src_shape = _shape(n.args[0])
        if ord_ != 2 or keep or dims is None or src_shape is None or src_shape[0] != m:
            return None
        dims = [dims] if isinstance(dims, int) else list(dims)
        if any(d % len(src_shape) == 0 for d in dims):
            return None
        chain.append(n)
        if _shape(n) == (m,):
            return n, chain
        if not _single_user(n):
            return None
        n = next(iter(n.users))
    return None


# --- emitting ----------------------------------------------------------------------------------


class _Emitter:
    def __init__(self, graph: fx.Graph, fake_mode):
        self.graph, self.fake_mode = graph, fake_mode

    def __call__(self, target, *args, **kwargs) -> fx.Node:
        node = self.graph.call_function(target, args, kwargs)
        vals = fx.node.map_arg((args, kwargs), lambda a: a.meta["val"])
        with self.fake_mode:
            node.meta["val"] = target(*vals[0], **vals[1])
        return node


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class _Leaf:
    """Emits the ghost norm and the book-kept sum of one matched leaf."""

    def __init__(self, emit: _Emitter, state: _State, m: int, acc: torch.dtype):
        self.e, self.s, self.m, self.acc = emit, state, m, acc
        self._dense: dict[int, fx.Node] = {}

    def dense(self, f: Factor, dtype: torch.dtype) -> fx.Node:
        """``[m, T, n]`` in ``dtype``."""
        key = (id(f), dtype)
        if key not in self._dense:
            e, x = self.e, f.node
            if f.layout == "mnt":
                x = e(aten.transpose.int, x, 1, 2)
            elif f.layout == "tmn":
                x = e(aten.permute.default, e(aten.reshape.default, x, [f.T, self.m, f.n]), [1, 0, 2])
            if _shape(x) != (self.m, f.T, f.n):
                x = e(aten.reshape.default, x, [self.m, f.T, f.n])
            if x.meta["val"].dtype != dtype:
                x = e(aten._to_copy.default, x, dtype=dtype)
            self._dense[key] = x
        return self._dense[key]

    def ids(self, f: Factor) -> fx.Node:
        """``[m, T]`` (``[1, T]`` when shared)."""
        e = self.e
        if f.shared:
            return e(aten.reshape.default, f.node, [1, f.T])
        x = f.node
        return x if _shape(x) == (self.m, f.T) else e(aten.reshape.default, x, [self.m, f.T])

    def gram(self, a: Factor, b: Factor) -> fx.Node:
        """``[m, T_a, T_b]`` (or broadcastable): inner products of a's rows with b's rows."""
        e, acc = self.e, self.acc
        if a.kind == "dense" and b.kind == "dense":
            return e(aten.bmm.default, self.dense(a, acc), e(aten.transpose.int, self.dense(b, acc), 1, 2))
        if a.kind == "onehot" and b.kind == "onehot":
            eq = e(aten.eq.Tensor, e(aten.unsqueeze.default, self.ids(a), 2), e(aten.unsqueeze.default, self.ids(b), 1))
            return e(aten._to_copy.default, eq, dtype=acc)
        if a.kind == "dense":
            return e(aten.transpose.int, self.gram(b, a), 1, 2)
        # one-hot a, dense b: gram[s, t] = b[t, ids_a[s]]
        bt = e(aten.transpose.int, self.dense(b, acc), 1, 2)                     # [m, n, T_b]
        index = e(aten.expand.default, e(aten.unsqueeze.default, self.ids(a), 2), [self.m, a.T, b.T])
        return e(aten.gather.default, bt, 1, index)

    def norm_sq(self) -> fx.Node:
        e, terms = self.e, self.s.terms
        total = None
        for k in range(len(terms)):
            for j in range(k, len(terms)):
                prod = e(aten.mul.Tensor, self.gram(terms[k].L, terms[j].L), self.gram(terms[k].R, terms[j].R))
                part = e(aten.sum.dim_IntList, prod, [1, 2])
                if j != k:
                    part = e(aten.mul.Tensor, part, 2.0)
                total = part if total is None else e(aten.add.Tensor, total, part)
        # a non-finite ghost norm becomes nan: it poisons the sums, and guard() reruns the chunk
        # with the materialized gradients (nan_to_num's element-wise semantics)
        finite = e(aten.isfinite.default, total)
        total = e(aten.where.self, finite, e(aten.clamp_min.default, total, 0.0),
                  e(aten.scalar_tensor.default, float("nan"), dtype=self.acc))
        return total

    def weighted_sum(self, factor: fx.Node, dtype: torch.dtype) -> fx.Node:
        """``sum_i factor_i G_i`` as ``[P, Q]``."""
        e, m = self.e, self.m
        c = e(aten.view.default, factor, [m, 1, 1])
        if factor.meta["val"].dtype != dtype:
            c = e(aten._to_copy.default, c, dtype=dtype)
        total = None
        for t in self.s.terms:
            L, R = t.L, t.R
            if L.kind == "dense" and R.kind == "dense":
                Ld, Rd = self.dense(L, dtype), self.dense(R, dtype)
                if L.n <= R.n:
                    Ld = e(aten.mul.Tensor, Ld, c)
                else:
                    Rd = e(aten.mul.Tensor, Rd, c)
                part = e(aten.mm.default, e(aten.t.default, e(aten.reshape.default, Ld, [m * L.T, L.n])),
                         e(aten.reshape.default, Rd, [m * R.T, R.n]))
            else:
                oh, de = (L, R) if L.kind == "onehot" else (R, L)
                rows = e(aten.reshape.default, e(aten.mul.Tensor, self.dense(de, dtype), c), [m * de.T, de.n])
                ids = self.ids(oh)
                if oh.shared:
                    ids = e(aten.expand.default, ids, [m, oh.T])
                ids = e(aten.reshape.default, ids, [m * oh.T])
                part = e(aten.embedding_dense_backward.default, rows, ids, oh.n, -1, False)   # [n_oh, n_de]
                if oh is R:
                    part = e(aten.t.default, part)
            total = part if total is None else e(aten.add.Tensor, total, part)
        return total


# --- the pass ----------------------------------------------------------------------------------


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
    for mv in [n for n in graph.nodes if _is(n, aten.mv.default)]:
        d = _one_leaf(gm, mv, fake_mode, out_index, order, names)
        if d is not None:
            decisions.append(d)
    if any(d.choice == "ghost" for d in decisions):
        graph.lint()
        gm.recompile()
    decisions.sort(key=lambda d: d.output)
    return decisions


_VIEWS = _RESHAPES | {aten.transpose.int, aten.permute.default, aten.t.default}
_MATMULS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.embedding.default}


def _base(n: Any) -> Any:
    while _is(n, *_VIEWS):
        n = n.args[0]
    return n


def _family(n: fx.Node) -> list[fx.Node]:
    """``n`` and every view of it."""
    out, todo = [], [n]
    while todo:
        x = todo.pop()
        out.append(x)
        todo += [u for u in x.users if _is(u, *_VIEWS) and u.args[0] is x]
    return out


def _param_name(state: _State, names: list[str] | None, graph: fx.Graph) -> str | None:
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
                    if not _is(u, *_MATMULS):
                        continue
                    for a in u.args:
                        w = _base(a)
                        if w is not x and isinstance(w, fx.Node) and w.op == "placeholder" and _shape(w) in shapes:
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
    return (_is(n, aten._to_copy.default) and set(n.kwargs) == {"dtype"}
            and n.kwargs["dtype"] in (torch.float32, torch.float64))


def _output_of(mv: fx.Node, out_index: dict) -> int:
    n = mv
    while True:
        if n in out_index:
            return out_index[n]
        users = [u for u in n.users if u.op == "call_function" and u.target in _RESHAPES]
        if len(n.users) != 1 or not users:
            return -1
        n = users[0]


def _one_leaf(gm: fx.GraphModule, mv: fx.Node, fake_mode, out_index: dict, order: dict,
              names: list[str] | None = None) -> Decision | None:
    # mv(t(view(Z, [m, -1])), factor): walk back to Z, the per-example gradient leaf
    chain, n = [mv], mv.args[0]
    if not _is(n, aten.t.default):
        return None
    while (_is(n, aten.t.default, *_RESHAPES) or _is_upcast(n)) and _single_user(n):
        chain.append(n)   # an upcast: low-precision gradients summed in float32 (fxmem.dpsgd)
        n = n.args[0]
    Z = n
    zs = _shape(Z)
    if zs is None or len(zs) < 2:
        return None
    m = zs[0]
    factor = mv.args[1]
    if _shape(factor) != (m,) or _shape(chain[-1]) is None or _shape(chain[-1])[0] != m:
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
    src = Z.args[0] if _is(Z, aten.nan_to_num.default) else Z
    if src is not Z:
        if not _single_user(src):
            decision.reason = "the per-example gradient has other uses"
            return decision
        dead.append(Z)
    try:
        state = _resolve(src, m)
    except _NoMatch as e:
        decision.reason = f"not a linear or embedding weight gradient{': ' + str(e) if str(e) else ''}"
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
    acc = _acc_dtype(zdtype)
    last_source = max(state.sources, key=lambda s: order[s])
    emit = _Emitter(graph, fake_mode)
    with graph.inserting_after(last_source):
        # inserting_after(n) puts every new node directly after n (reversing their order): an
        # anchor there, and each new node inserted before it, keeps them in program order
        anchor = graph.call_function(operator.add, (0, 0))
    with graph.inserting_before(anchor):
        leaf = _Leaf(emit, state, m, acc)
        sq = leaf.norm_sq()
    graph.erase_node(anchor)
    for norm in norms:
        with graph.inserting_before(norm):
            new = emit(aten.sqrt.default, sq)
            if norm.meta["val"].dtype != acc:
                new = emit(aten._to_copy.default, new, dtype=norm.meta["val"].dtype)
        norm.replace_all_uses_with(new)
    with graph.inserting_before(mv):
        leaf._dense.clear()   # the sum runs later: its own views (the norm's are dead by then)
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


# --- the compiled chunk with its fallback ------------------------------------------------------


def _all_finite(outs) -> bool:
    """Whether every floating output is finite, checked through its sum (in float32 or wider): a
    non-finite element always makes the sum non-finite (inf + x = inf, inf - inf = nan, nan
    propagates), so no non-finite output passes; a finite output whose sum overflows would only
    cost a needless fallback. One reduction per output, ~15x cheaper than ``isfinite(o).all()``
    (which allocates a bool tensor the size of every clipped sum, on every chunk)."""
    sums = [o.sum(dtype=torch.promote_types(o.dtype, torch.float32)) for o in outs
            if isinstance(o, torch.Tensor) and o.is_floating_point()]
    return not sums or bool(torch.stack(sums).isfinite().all())


class Guarded:
    """A ghost-rewritten chunk: runs it, and if any floating output is not finite, reruns the
    chunk with the materialized per-example gradients (compiled on first need)."""

    def __init__(self, fn: Callable, decisions: list[Decision], recompile: Callable[[list], Callable]):
        self.fn, self.decisions, self._recompile = fn, decisions, recompile
        self._fallback: Callable | None = None
        self.fallbacks = 0

    def __call__(self, *args):
        outs = self.fn(*args)
        if _all_finite(outs):
            return outs
        if self._fallback is None:
            log.warning("fxmem ghost clipping: non-finite values in a chunk; rerunning it with "
                        "materialized per-example gradients (nan_to_num semantics)")
            self._fallback = self._recompile(list(args))
        self.fallbacks += 1
        del outs
        return self._fallback(*args)


class Pass:
    """The hook the chunk compile calls: ``Pass(options, chunk_gm)(flat_gm)`` rewrites the flat
    graph (a no-op when ``options.ghost_clipping`` is off) and keeps the decisions;
    ``guard(fn, recompile)`` wraps the compiled chunk when anything was rewritten."""

    def __init__(self, options, gm: fx.GraphModule | None = None):
        self.enabled = bool(getattr(options, "ghost_clipping", False))
        self.decisions: list[Decision] = []
        self.names = [n.name for n in gm.graph.nodes if n.op == "placeholder"] if gm is not None else None

    def __call__(self, flat: fx.GraphModule) -> fx.GraphModule:
        if not self.enabled:
            return flat
        # rewrite a copy: a failure leaves the graph as it was (correct, unchanged)
        graph = fx.Graph()
        out = graph.graph_copy(flat.graph, {})
        graph.output(out)
        copy = graph_module(flat, graph)
        try:
            self.decisions = rewrite(copy, self.names)
        except Exception as e:  # noqa: BLE001
            log.warning("fxmem ghost clipping: not applied (%s: %s); per-example gradients stay "
                        "materialized", type(e).__name__, e)
            self.decisions = []
            return flat
        return copy if any(d.choice == "ghost" for d in self.decisions) else flat

    def guard(self, fn: Callable, recompile: Callable[[list], Callable]) -> Callable:
        if not any(d.choice == "ghost" for d in self.decisions):
            return fn
        return Guarded(fn, self.decisions, recompile)
