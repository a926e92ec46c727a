"""A tied embedding's gradient accumulated into its other use's, in the joint graph.

A weight used twice (GPT-2's token embedding and its output head) gets the sum of two
gradients: ``add(head_grad, embedding_dense_backward(grad, ids, vocab, padding_idx, False))``.
The embedding's gradient is a [vocab, hidden] buffer of zeros with the touched rows summed in
(147 MiB for GPT-2 small), allocated at the end of the backward where every other parameter
gradient is alive: the step's peak on a tied LM. :func:`accumulate_tied_embeddings` replaces the
pair by ``fxmem::embedding_backward_add`` (``graph.inplace``), which the planner sizes like the
add (one [vocab, hidden] result, a [tokens, hidden] temporary) and the eager inner compiler runs
in place into the head's gradient where that dies there, as it runs other sums (``graph.reuse``).

Only the undecomposed op is matched: Inductor's joint graph holds torch's decomposition (a
scatter into zeros), which ``fences.scatter_into_sums`` scatters into the other summand instead.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ..graph.inplace import EMBEDDING_BACKWARD_ADD, sum_into

aten = torch.ops.aten


def _embedding_grad(n: object, like: torch.Tensor) -> bool:
    """``n`` is an unscaled ``embedding_dense_backward`` read only by the sum, shaped like ``like``."""
    if not (isinstance(n, fx.Node) and n.target is aten.embedding_dense_backward.default and len(n.users) == 1):
        return False
    v = n.meta.get("val")
    return (len(n.args) == 5 and n.args[4] is False and isinstance(n.args[3], int)
            and isinstance(v, torch.Tensor) and v.shape == like.shape and v.dtype == like.dtype)


def accumulate_tied_embeddings(gm: fx.GraphModule) -> int:
    """Rewrite ``gm`` in place: ``add(a, embedding_dense_backward(g, ids, n, pad, False))`` (either
    order) -> ``embedding_backward_add(a, g, ids, pad)``. Returns how many sums were rewritten."""
    count = 0
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or n.target is not aten.add.Tensor or n.kwargs or len(n.args) != 2:
            continue
        out = n.meta.get("val")
        if not isinstance(out, torch.Tensor):
            continue
        for a, e in (n.args, n.args[::-1]):
            va = a.meta.get("val") if isinstance(a, fx.Node) else None
            if not (_embedding_grad(e, out) and isinstance(va, torch.Tensor) and va.shape == out.shape
                    and va.dtype == out.dtype):
                continue
            grad, ids, _, pad, _ = e.args
            sum_into(gm, n, e, EMBEDDING_BACKWARD_ADD, (a, grad, ids, pad))
            count += 1
            break
    if count:
        gm.graph.lint()
        gm.recompile()
    return count
