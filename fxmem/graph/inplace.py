"""In-place forms of out-of-place ops: what the eager inner compiler may rewrite a node into.

Kept apart from the rewrite itself (``fxmem.graph.reuse``) because liveness reads
:data:`WRITES_INTO_FIRST` too: a call that writes into its first argument allocates nothing.
Also here: ``fxmem::embedding_backward_add``, the one op fxmem puts into a joint graph so that it
has an in-place form (``remat.tied``: a tied embedding's gradient added to its other use's).
"""

from __future__ import annotations

import torch
import torch.fx as fx

aten = torch.ops.aten

# out-of-place op -> in-place op writing into its first argument (same values, bit for bit)
INPLACE = {aten.add.Tensor: aten.add_.Tensor, aten.sub.Tensor: aten.sub_.Tensor,
         aten.mul.Tensor: aten.mul_.Tensor, aten.div.Tensor: aten.div_.Tensor}
COMMUTATIVE = {aten.add.Tensor, aten.mul.Tensor}


def _log_softmax_backward_into_grad(grad, output, dim, dtype):
    # Row-wise two-pass kernel (sum, then write at the index it read): safe to alias grad and
    # the result; tests/test_inner.py checks bit equality.
    return aten._log_softmax_backward_data.out(grad, output, dim, dtype, out=grad)


def _softmax_backward_into_grad(grad, output, dim, dtype):
    return aten._softmax_backward_data.out(grad, output, dim, dtype, grad_input=grad)


def _dropout_backward_into_grad(grad, mask, scale):
    # ATen computes ``grad * mask * scale`` into a new tensor through a temporary: in place, the
    # same two products in the same order (bit for bit), and only the mask's float copy is
    # allocated (the scratch model's ``native_dropout_backward`` temporary).
    return grad.mul_(mask).mul_(scale)


def _embedding_backward_into(other, grad, indices, padding_idx):
    """``other += embedding_dense_backward(grad, indices, len(other), padding_idx, False)``
    without the [num_weights, dim] gradient: the rows the indices touch are summed by the same
    kernel, over the indices renumbered to those rows, into a [rows touched, dim] buffer (in the
    same order: the same sums), then added to ``other``'s rows. Bit for bit the out-of-place sum
    on CPU (a row nobody touched gets ``+ 0.0``: a -0.0 entry becomes 0.0; tests/test_loss_floor.py)."""
    if other.device.type == "meta":  # no values to sum (torch.unique has no meta kernel): the shape is the result
        return other
    flat = indices.reshape(-1)
    rows, renumbered = torch.unique(flat, return_inverse=True)
    grad = grad.reshape(flat.numel(), other.shape[1])
    if padding_idx >= 0:  # the padding row gets nothing: its entries add zeros
        grad = grad.masked_fill((flat == padding_idx).unsqueeze(1), 0)
    summed = aten.embedding_dense_backward.default(grad, renumbered, rows.numel(), -1, False)
    return other.index_add_(0, rows, summed)


def _select_scatter_into(base, src, dim, index):
    # The slot written is a copy either way (``remat.scan_grads``: a loop's slice gradients).
    base.select(dim, index).copy_(src)
    return base


def _slice_scatter_into(base, src, dim=0, start=None, end=None, step=1):
    aten.slice.Tensor(base, dim, start, end, step).copy_(src)
    return base


@torch.library.custom_op("fxmem::embedding_backward_add", mutates_args=())
def embedding_backward_add(other: torch.Tensor, grad: torch.Tensor, indices: torch.Tensor,
                           padding_idx: int) -> torch.Tensor:
    """``other + embedding_dense_backward(grad, indices, other.shape[0], padding_idx, False)``:
    a tied embedding's gradient added to its other use's, with one [num_weights, dim] result.
    The eager inner compiler writes it into ``other`` where ``other`` dies here (``INTO_FIRST``)."""
    return _embedding_backward_into(other.clone(memory_format=torch.contiguous_format), grad, indices, padding_idx)


@embedding_backward_add.register_fake
def _(other, grad, indices, padding_idx):
    return torch.empty_like(other, memory_format=torch.contiguous_format)


EMBEDDING_BACKWARD_ADD = torch.ops.fxmem.embedding_backward_add.default

# ops whose first argument (the incoming gradient) can receive their result
INTO_FIRST = {aten._log_softmax_backward_data.default: _log_softmax_backward_into_grad,
              aten._softmax_backward_data.default: _softmax_backward_into_grad,
              aten.native_dropout_backward.default: _dropout_backward_into_grad,
              EMBEDDING_BACKWARD_ADD: _embedding_backward_into,
              aten.select_scatter.default: _select_scatter_into,
              aten.slice_scatter.default: _slice_scatter_into}

# functions whose result is their first argument's storage (liveness: no new allocation)
WRITES_INTO_FIRST = frozenset(INTO_FIRST.values())


def sum_into(gm: fx.GraphModule, add: fx.Node, summand: fx.Node, target, args: tuple) -> fx.Node:
    """Replace ``add`` (a sum of an accumulator and ``summand``) by ``target(*args)``, one op that
    computes the same sum into the accumulator's buffer where the inner compiler runs in place;
    ``summand``'s node, read only by ``add``, is erased with it (``remat.tied``, ``remat.scan_grads``)."""
    with gm.graph.inserting_before(add):
        new = gm.graph.call_function(target, args)
    new.meta = dict(add.meta)
    add.replace_all_uses_with(new)
    gm.graph.erase_node(add)
    gm.graph.erase_node(summand)
    return new
