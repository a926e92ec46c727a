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
:class:`Decision` (``ChunkPlan.ghost``, the report). Anything not matching exactly is left alone;
a rewrite that fails goes through the failure policy (``strict`` raises; otherwise one warning,
and the chunk graph keeps its materialized gradients).

    rules.py     how ``G`` is matched: one rule per op, each returning a Match or a NoMatch with
                 the reason (a linear layer's bmm, an embedding's gradient, a tied weight's add,
                 reshapes and transposes)
    emit.py      the ghost norm and the book-kept sum of a matched leaf
    rewrite.py   the rewrite of a chunk graph: each clip-weighted sum, its norms, the decision
    hook.py      what the chunk compile calls (Pass) and the non-finite fallback (Guarded)

Non-finite values: ``nan_to_num`` on a materialized gradient zeroes single elements, which a
ghost norm cannot do. A ghost norm that is not finite becomes nan, so it poisons the chunk's
sums, and :class:`Guarded` reruns such a chunk with the materialized graph (compiled on first need):
exact semantics, at the price of a finite check per chunk.
"""
from __future__ import annotations

from .hook import Guarded, Pass, _all_finite  # noqa: F401 - _all_finite: reached from here by tests
from .rewrite import Decision, rewrite

__all__ = ["Decision", "Guarded", "Pass", "rewrite"]
