"""Ghost-norm rules: how a per-example weight gradient ``G [m, P, Q]`` is recognized as a sum
of ``G_i = L_i^T R_i`` products, one rule per op (Opacus' grad-sample rules are the model).

Each rule takes the node and the chunk size m and returns a :class:`Match` (the factors of the
products and the nodes that build ``G``) or a :class:`NoMatch` with the reason; none raises.
:func:`match` tries the rules of the node's op (:data:`RULES`), in order:

    bmm                              a linear layer: G = L^T R over the tokens (``linear``)
    view / _unsafe_view / reshape    an embedding's gradient, per-example ids (``embedding_ids``),
                                     else a reshape of a matched gradient (``rearranged``)
    permute                          an embedding's gradient, ids shared by every example
                                     (``embedding_positions``), else a transpose (``swapped``)
    transpose                        the last two dims swapped: L and R swap (``swapped``)
    add                              a weight used twice: the terms of both (``tied``)
    other reshapes                   ``rearranged``
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Union

import torch
import torch.fx as fx

aten = torch.ops.aten

# ops that keep the batch dim first and the row-major element order (a reshape of the same data)
RESHAPES = frozenset({aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.clone.default,
                      aten.alias.default, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims,
                      aten.expand.default, aten.contiguous.default})
_VIEW_RESHAPES = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)


# --- what a rule returns ------------------------------------------------------------------------


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
class Match:
    """A per-example gradient as a reshaped sum of ``L_i^T R_i`` products."""
    terms: list[Term]
    P: int
    Q: int
    shape: tuple[int, ...]    # the matched tensor = reshape of the [m, P, Q] products
    nodes: list[fx.Node] = field(default_factory=list)  # nodes of the chain/tree (deleted after)
    sources: list[fx.Node] = field(default_factory=list)
    kinds: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return True


@dataclass(frozen=True)
class NoMatch:
    """Why a rule does not apply (falsy)."""
    reason: str = ""

    def __bool__(self) -> bool:
        return False


Result = Union[Match, NoMatch]
Rule = Callable[[fx.Node, int], Result]


def match(n: fx.Node, m: int) -> Result:
    """``n`` (a per-example gradient ``[m, ...]``) as a reshaped sum of products: the first rule
    of its op that matches, else the first reason given (a later rule's reason when the first
    has none)."""
    shape = shape_of(n)
    if shape is None or len(shape) < 2 or shape[0] != m:
        return NoMatch("no static [m, ...] shape")
    if n.op != "call_function":
        return NoMatch(f"{n.op} {n.name}")
    reasons = []
    for fn in RULES.get(n.target, ()):
        got = fn(n, m)
        if got:
            return got
        reasons.append(got.reason)
    return NoMatch(next((r for r in reasons if r), f"{n.target} is not a reshape or a transpose of the last two dims"))


# --- helpers ------------------------------------------------------------------------------------


def val(n: Any):
    return n.meta.get("val") if isinstance(n, fx.Node) else None


def shape_of(n: Any) -> tuple[int, ...] | None:
    v = val(n)
    if not isinstance(v, torch.Tensor):
        return None
    try:
        return tuple(int(s) for s in v.shape)
    except (TypeError, ValueError):  # symbolic
        return None


def is_op(n: Any, *targets) -> bool:
    return isinstance(n, fx.Node) and n.op == "call_function" and n.target in targets


def single_user(n: fx.Node) -> bool:
    return len(n.users) == 1


# --- the rules, one per op ----------------------------------------------------------------------


def linear(n: fx.Node, m: int) -> Result:
    """``bmm(X [m, P, T], Y [m, T, Q])``: a linear layer's weight gradient over T tokens."""
    X, Y = n.args
    xs, ys = shape_of(X), shape_of(Y)
    if xs is None or ys is None or not (xs[0] == ys[0] == m and xs[2] == ys[1]):
        return NoMatch("a bmm of other shapes")
    P, T, Q = xs[1], xs[2], ys[2]
    return Match([Term(Factor("dense", X, P, T, "mnt"), Factor("dense", Y, Q, T))], P, Q,
                 (m, P, Q), [n], [n], ["linear"])


def embedding_ids(n: fx.Node, m: int) -> Result:
    """``view(embedding_dense_backward(gout, ids + i*V, m*V), [m, V, d])``: vmap's batching rule
    of an embedding with per-example ids."""
    shape, edb = shape_of(n), n.args[0]
    if len(shape) != 3 or not is_op(edb, aten.embedding_dense_backward.default):
        return NoMatch()
    gout, idx, num_weights, padding_idx, scale = edb.args
    if not single_user(edb) or padding_idx != -1 or scale:
        return NoMatch("an embedding with padding_idx or scale_grad_by_freq")
    V, d = shape[1], shape[2]
    if num_weights != m * V or shape_of(edb) != (m * V, d):
        return NoMatch("an embedding gradient of another layout")
    ids = offs = None
    if is_op(idx, aten.add.Tensor) and len(idx.args) == 2:
        for a, b in (idx.args, idx.args[::-1]):
            if is_op(b, *_VIEW_RESHAPES) and is_op(b.args[0], aten.arange.start_step) \
                    and tuple(b.args[0].args[:3]) == (0, m * V, V):
                ids, offs = a, b
    if not isinstance(ids, fx.Node):
        return NoMatch("an embedding's ids without per-example offsets")
    ishape, gshape = shape_of(ids), shape_of(gout)
    if ishape is None or gshape is None or ishape[0] != m or gshape != ishape + (d,):
        return NoMatch("an embedding gradient of another layout")
    T = math.prod(ishape[1:])
    extra = [x for x in (idx, offs, offs.args[0]) if len(x.users) == 1]
    return Match([Term(Factor("onehot", ids, V, T), Factor("dense", gout, d, T))], V, d, shape,
                 [n, edb] + extra, [edb], ["embedding"])


def embedding_positions(n: fx.Node, m: int) -> Result:
    """``permute(view(edb(W [T, m*d], idx [T], V), [V, m, d]), [1, 0, 2])``: an embedding whose
    ids every example shares (positions)."""
    shape, v = shape_of(n), n.args[0]
    if len(shape) != 3 or list(n.args[1]) != [1, 0, 2] or not (
            is_op(v, aten.view.default, aten._unsafe_view.default)
            and is_op(v.args[0], aten.embedding_dense_backward.default)):
        return NoMatch()
    edb = v.args[0]
    W, idx, num_weights, padding_idx, scale = edb.args
    V, d = shape[1], shape[2]
    ws, ishape = shape_of(W), shape_of(idx)
    if not single_user(v) or not single_user(edb) or padding_idx != -1 or scale:
        return NoMatch("an embedding with padding_idx or scale_grad_by_freq, or other uses")
    if num_weights != V or shape_of(v) != (V, m, d) or ishape is None or ws is None or ws != ishape + (m * d,):
        return NoMatch("unbatched embedding of another layout")
    T = math.prod(ishape)
    return Match([Term(Factor("onehot", idx, V, T, shared=True), Factor("dense", W, d, T, "tmn"))],
                 V, d, shape, [n, v, edb], [edb], ["embedding"])


def tied(n: fx.Node, m: int) -> Result:
    """``a + b``: one weight used twice (tied embedding and output projection): both terms."""
    if len(n.args) != 2 or n.kwargs:
        return NoMatch("an add with a scalar or keywords")
    a, b = n.args
    if not (isinstance(a, fx.Node) and isinstance(b, fx.Node) and single_user(a) and single_user(b)):
        return NoMatch("a summand with other uses")
    sa = match(a, m)
    if not sa:
        return sa
    sb = match(b, m)
    if not sb:
        return sb
    if not (sa.shape == sb.shape == shape_of(n) and (sa.P, sa.Q) == (sb.P, sb.Q)):
        return NoMatch("summands laid out differently")
    return Match(sa.terms + sb.terms, sa.P, sa.Q, shape_of(n), sa.nodes + sb.nodes + [n],
                 sa.sources + sb.sources, sa.kinds + sb.kinds)


def rearranged(n: fx.Node, m: int) -> Result:
    """A reshape of a matched gradient (the same elements, the batch dim first)."""
    src = n.args[0] if n.args else None
    if not isinstance(src, fx.Node):
        return NoMatch("not a rearrangement")
    if not single_user(src):
        return NoMatch("the gradient has other uses")
    if n.target is aten.expand.default and shape_of(src) != shape_of(n):
        return NoMatch("a broadcasting expand")
    s = match(src, m)
    if s:
        s.shape, s.nodes = shape_of(n), s.nodes + [n]
    return s


def swapped(n: fx.Node, m: int) -> Result:
    """The last two dims of a matched ``[m, P, Q]`` gradient swapped: ``R^T L``."""
    shape, src = shape_of(n), n.args[0]
    swap = len(shape) == 3 and (
        (n.target is aten.transpose.int and sorted(d % 3 for d in n.args[1:3]) == [1, 2])
        or (n.target is aten.permute.default and [d % 3 for d in n.args[1]] == [0, 2, 1]))
    if not swap:
        return NoMatch(f"{n.target} is not a reshape or a transpose of the last two dims")
    if not single_user(src):
        return NoMatch("the gradient has other uses")
    s = match(src, m)
    if not s:
        return s
    if s.shape != (m, s.P, s.Q):
        return NoMatch("transpose of a reshaped gradient")
    s.terms = [Term(t.R, t.L) for t in s.terms]
    s.P, s.Q, s.shape, s.nodes = s.Q, s.P, shape, s.nodes + [n]
    return s


# op -> its rules, tried in order
RULES: dict[Any, tuple[Rule, ...]] = {
    aten.bmm.default: (linear,),
    **{op: (embedding_ids, rearranged) for op in _VIEW_RESHAPES},
    aten.permute.default: (embedding_positions, swapped),
    aten.transpose.int: (swapped,),
    aten.add.Tensor: (tied,),
    **{op: (rearranged,) for op in RESHAPES - set(_VIEW_RESHAPES)},
}
