"""Emitting a matched leaf's ghost norm and book-kept sum into the chunk graph (``rules.Match``:
``G_i = sum_k L_k,i^T R_k,i``)."""
from __future__ import annotations

import torch
import torch.fx as fx

from .rules import Factor, Match, shape_of

aten = torch.ops.aten


class Emitter:
    """``emit(target, *args, **kwargs)``: a new call node, its ``val`` computed on fake tensors."""

    def __init__(self, graph: fx.Graph, fake_mode):
        self.graph, self.fake_mode = graph, fake_mode

    def __call__(self, target, *args, **kwargs) -> fx.Node:
        node = self.graph.call_function(target, args, kwargs)
        vals = fx.node.map_arg((args, kwargs), lambda a: a.meta["val"])
        with self.fake_mode:
            node.meta["val"] = target(*vals[0], **vals[1])
        return node


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class Leaf:
    """Emits the ghost norm and the book-kept sum of one matched leaf."""

    def __init__(self, emit: Emitter, state: Match, m: int, acc: torch.dtype):
        self.e, self.s, self.m, self.acc = emit, state, m, acc
        self._dense: dict[int, fx.Node] = {}

    def forget_views(self) -> None:
        """Emit fresh views of the factors from here on (the earlier ones are dead by then)."""
        self._dense.clear()

    def dense(self, f: Factor, dtype: torch.dtype) -> fx.Node:
        """``[m, T, n]`` in ``dtype``."""
        key = (id(f), dtype)
        if key not in self._dense:
            e, x = self.e, f.node
            if f.layout == "mnt":
                x = e(aten.transpose.int, x, 1, 2)
            elif f.layout == "tmn":
                x = e(aten.permute.default, e(aten.reshape.default, x, [f.T, self.m, f.n]), [1, 0, 2])
            if shape_of(x) != (self.m, f.T, f.n):
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
        return x if shape_of(x) == (self.m, f.T) else e(aten.reshape.default, x, [self.m, f.T])

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
