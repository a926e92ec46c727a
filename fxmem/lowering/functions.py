"""What a lowered graph calls: one function per replacement, each a thin call of an
``fxmem_kernels`` autograd API (or, for the per-example cross-entropy, of the kernel's functional
ops through the autograd.Functions below). AOTAutograd traces these calls, so its joint graph
holds the fused forward op and, from the Function's backward, the fused backward op.

Every function takes the tensors first and its settings as keywords, so a graph node reads
``layer_norm(x, w, b, eps=1e-05)``. ``dtype``: under autocast, the dtype autocast would have run
the replaced ops in (:mod:`.amp`); the function casts its floating inputs to it (autocast leaves
the fused ops alone), so the kernels see what the unfused ops saw and gradients come back, through
the casts, in the inputs' dtypes.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

import fxmem_kernels as K

_IMPL = "auto"  # the portable PyTorch implementations; Triton on CUDA with FXMEM_KERNELS_TRITON=1
_KERNEL_WORKSPACE = K.linear_cross_entropy.__kwdefaults__["workspace_bytes"]
MIN_WORKSPACE_BYTES = 16 * 2**20


def workspace_bytes(vocab: int) -> int:
    """Bytes of logits in flight in the fused cross-entropy: 128 fp32 rows (enough for the
    matmuls to run at full speed), at least 16 MiB, at most the kernel's default. On CPU at
    vocab 32768 that is 16 MiB instead of the kernel's 64: the forward's peak drops by 48 MiB
    at the same step time (bench/results/lowering.md)."""
    return int(min(_KERNEL_WORKSPACE, max(MIN_WORKSPACE_BYTES, 128 * 4 * int(vocab))))


def _lce_op():
    return torch.ops.fxmem.linear_cross_entropy.default


def _lce_backward_op():
    return torch.ops.fxmem.linear_cross_entropy_backward.default


def _cast(dtype: Optional[torch.dtype], *tensors: Optional[Tensor]) -> tuple:
    """``tensors`` cast to ``dtype`` (None: as they are), as autocast casts an op's inputs."""
    if dtype is None:
        return tensors
    return tuple(t.to(dtype) if t is not None and t.is_floating_point() and t.dtype != dtype else t
                 for t in tensors)


# -- fused linear cross-entropy --------------------------------------------------------------
def _rows_of(h: Tensor, target: Tensor, index: tuple, hidden: int) -> tuple[Tensor, Tensor]:
    for idx in index:  # the slicing the logits went through, applied to the hidden states
        h = h[idx]
    return h.reshape(-1, hidden), target.reshape(-1)


def _logit_rows(logits: Tensor, index: tuple, vocab: int) -> Optional[Tensor]:
    for idx in index:
        logits = logits[idx]
    try:
        return logits.view(-1, vocab)
    except RuntimeError:  # e.g. sliced along the sequence: rows are not a view; recomputed instead
        return None


def _biased(bias: Optional[Tensor], logit_bias: Optional[Tensor]) -> Optional[Tensor]:
    """The linear's bias plus a [1, vocab] bias added to its output (BART's final_logits_bias)."""
    if logit_bias is None:
        return bias
    extra = logit_bias.reshape(-1)
    return extra if bias is None else bias + extra


def linear_cross_entropy(h: Tensor, weight: Tensor, bias: Optional[Tensor], target: Tensor, *,
                         index: tuple, hidden: int, ignore_index: int, label_smoothing: float,
                         reduction: str, out_dtype: torch.dtype, logits: Optional[Tensor] = None,
                         logit_bias: Optional[Tensor] = None, dtype: Optional[torch.dtype] = None) -> Tensor:
    """``F.cross_entropy((linear(h, weight, bias) + logit_bias)[index].view(-1, V).float(), target,
    ...)`` without the logits (the kernel computes the gradients in the same pass for a reduced
    loss). ``logits``: the full logits when the graph returns them too: read, not recomputed.
    ``dtype``: the matmuls' (autocast's); the loss is computed in fp32 and returned in ``out_dtype``."""
    h, weight, bias = _cast(dtype, h, weight, _biased(bias, logit_bias))
    h2, t = _rows_of(h, target, index, hidden)
    rows = None if logits is None else _logit_rows(logits, index, weight.shape[0])
    return K.linear_cross_entropy(h2, weight, t, bias, ignore_index=ignore_index,
                                  label_smoothing=label_smoothing, reduction=reduction,
                                  workspace_bytes=workspace_bytes(weight.shape[0]), impl=_IMPL, logits=rows,
                                  loss_dtype=out_dtype)


def per_example_linear_cross_entropy(h: Tensor, weight: Tensor, bias: Optional[Tensor],
                                     target: Tensor, *, index: tuple, hidden: int,
                                     ignore_index: int, label_smoothing: float, reduction: str,
                                     out_dtype: torch.dtype, logit_bias: Optional[Tensor] = None,
                                     dtype: Optional[torch.dtype] = None) -> Tensor:
    """The same inside a ``vmap(grad(...))`` region: per-token losses (the forward op folds the
    batch into its rows: one call), reduced here; the backward op runs once per example."""
    h, weight, bias = _cast(dtype, h, weight, _biased(bias, logit_bias))
    h2, t = _rows_of(h, target, index, hidden)
    rows, _ = _RowsLCE.apply(h2, weight, bias, t, (ignore_index, label_smoothing, out_dtype))
    if reduction == "none":
        return rows
    total = rows.sum()
    return total / (t != ignore_index).sum() if reduction == "mean" else total


class _RowsLCE(torch.autograd.Function):
    """Per-token linear cross-entropy from the kernel's functional ops.

    The kernel's own autograd API computes the gradients in its forward for a reduced loss, and
    under ``vmap`` its ops run a per-example loop that calls the Python implementation directly
    (which AOTAutograd cannot trace: its target check reads a tensor's value). Here the forward
    op is called with reduction "none" (batched rows fold into one call) and the backward op
    through :class:`_RowsLCEBackward`, whose vmap rule calls the op once per example."""

    generate_vmap_rule = True

    @staticmethod
    def forward(h, weight, bias, target, opts):
        ignore_index, label_smoothing, loss_dtype = opts
        out = _lce_op()(h, weight, bias, target, ignore_index=ignore_index,
                        label_smoothing=label_smoothing, reduction="none",
                        workspace_bytes=workspace_bytes(weight.shape[0]), impl=_IMPL, loss_dtype=loss_dtype)
        return out[0], out[1]

    @staticmethod
    def setup_context(ctx, inputs, output):
        h, weight, bias, target, ctx.opts = inputs
        ctx.mark_non_differentiable(output[1])
        ctx.save_for_backward(h, weight, bias, target, output[1])

    @staticmethod
    def backward(ctx, grad_rows, _grad_lse):
        h, weight, bias, target, lse = ctx.saved_tensors
        need = (ctx.needs_input_grad[0], ctx.needs_input_grad[1],
                bias is not None and ctx.needs_input_grad[2])
        dh, dw, db = _RowsLCEBackward.apply(grad_rows, h, weight, bias, target, lse, ctx.opts, need)
        return (dh if need[0] else None, dw if need[1] else None, db if need[2] else None,
                None, None)


def _lce_backward(grad_rows, h, weight, bias, target, lse, opts, need):
    ignore_index, label_smoothing = opts[:2]
    return _lce_backward_op()(grad_rows, h, weight, bias, target, lse, ignore_index=ignore_index,
                              label_smoothing=label_smoothing, workspace_bytes=workspace_bytes(weight.shape[0]),
                              impl=_IMPL, grad_hidden=need[0],
                              grad_weight=need[1], grad_bias=need[2])


class _RowsLCEBackward(torch.autograd.Function):
    """The backward op as a Function: under vmap, one op call per example, results stacked (a
    per-example weight gradient is per example whatever the kernel does)."""

    @staticmethod
    def forward(grad_rows, h, weight, bias, target, lse, opts, need):
        return _lce_backward(grad_rows, h, weight, bias, target, lse, opts, need)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError("fxmem lowering: double backward through the fused linear "
                           "cross-entropy is not supported")

    @staticmethod
    def vmap(info, in_dims, grad_rows, h, weight, bias, target, lse, opts, need):
        tensors = (grad_rows, h, weight, bias, target, lse)

        def example(i):
            return [t if t is None or d is None else t.select(d, i)
                    for t, d in zip(tensors, in_dims[:6])]

        outs = [_lce_backward(*example(i), opts, need) for i in range(info.batch_size)]
        return tuple(torch.stack(o) for o in zip(*outs)), (0, 0, 0)


def returned_logits(h: Tensor, weight: Tensor, bias: Optional[Tensor] = None,
                    logit_bias: Optional[Tensor] = None, *, dtype: Optional[torch.dtype] = None) -> Tensor:
    """``F.linear`` (plus the logit bias) for logits a graph returns beside a fused loss, which
    reads them too: computed once. Differentiable; a graph compiled whole returns
    :func:`detached_logits` instead (:mod:`.returned`)."""
    return torch.nn.functional.linear(*_cast(dtype, h, weight, _biased(bias, logit_bias)))


def detached_logits(h: Tensor, weight: Tensor, bias: Optional[Tensor] = None,
                    logit_bias: Optional[Tensor] = None, *, dtype: Optional[torch.dtype] = None) -> Tensor:
    """:func:`returned_logits` without a gradient: the compiled graph returns them as an output
    AOTAutograd gives no tangent (a differentiable one gets a [tokens, vocab] zero gradient
    whenever the caller differentiates the loss only); :class:`.returned.Reattached` gives them
    their gradient outside the graph, computed only when the caller differentiates them."""
    with torch.no_grad():
        return returned_logits(h, weight, bias, logit_bias, dtype=dtype)


def returned_alias(logits: Tensor, h: Tensor, weight: Tensor, bias: Optional[Tensor] = None,
                   logit_bias: Optional[Tensor] = None, *, dtype: Optional[torch.dtype] = None) -> Tensor:
    """``logits`` (the output of ``F.linear(h, weight, bias)`` plus the logit bias), where a graph
    returns them beside a loss that reads them unfused (the fused loss declined as futile): the
    graph's output use only; the loss reads ``logits`` themselves. A graph compiled whole returns
    :func:`detached_alias` instead (:mod:`.returned`), as it does :func:`detached_logits` beside a
    fused loss: the operands tell :class:`.returned.Reattached` how to give them their gradient."""
    return logits


def detached_alias(logits: Tensor, h: Tensor, weight: Tensor, bias: Optional[Tensor] = None,
                   logit_bias: Optional[Tensor] = None, *, dtype: Optional[torch.dtype] = None) -> Tensor:
    """:func:`returned_alias` without a gradient: the same storage, an output AOTAutograd gives no
    tangent (else a [tokens, vocab] zero gradient would be held through the loss's backward)."""
    return logits.detach()


def linear_backward(grad: Tensor, h: Tensor, weight: Tensor, bias: Optional[Tensor],
                    logit_bias: Optional[Tensor], dtype: Optional[torch.dtype], need: tuple) -> tuple:
    """The gradients of :func:`returned_logits` for the logits' gradient ``grad`` (None where
    ``need``, one flag per input h, weight, bias, logit_bias, is false): the matmuls in the dtype
    the forward ran them in, each gradient cast back to its input's dtype, as autograd through the
    casts gives them."""
    hc, wc = _cast(dtype, h, weight)
    g2 = grad.reshape(-1, grad.shape[-1])
    dh = (grad @ wc).to(h.dtype) if need[0] else None
    dw = (g2.t() @ hc.reshape(-1, hc.shape[-1])).to(weight.dtype) if need[1] else None
    total = g2.sum(0) if need[2] or need[3] else None
    db = total.to(bias.dtype) if need[2] else None
    dlb = total.reshape(logit_bias.shape).to(logit_bias.dtype) if need[3] else None
    return dh, dw, db, dlb


# -- norms, activations, dropout --------------------------------------------------------------
def layer_norm(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], *, eps: float,
               dtype: Optional[torch.dtype] = None) -> Tensor:
    return K.layer_norm(*_cast(dtype, x, weight, bias), eps, impl=_IMPL)


def rms_norm(x: Tensor, weight: Optional[Tensor], *, eps: float) -> Tensor:
    return K.rms_norm(x, weight, eps, impl=_IMPL)


def bias_gelu(x: Tensor, bias: Optional[Tensor], *, approximate: str) -> Tensor:
    return K.bias_gelu(x, bias, approximate, impl=_IMPL)


def linear_bias_gelu(x: Tensor, weight: Tensor, bias: Tensor, *, approximate: str,
                     dtype: Optional[torch.dtype] = None) -> Tensor:
    """``gelu(F.linear(x, weight, bias))``: the bias moves from the matmul into the activation."""
    x, weight, bias = _cast(dtype, x, weight, bias)
    return K.bias_gelu(torch.nn.functional.linear(x, weight), bias, approximate, impl=_IMPL)


def addmm_bias_gelu(bias: Tensor, x: Tensor, weight: Tensor, *, shape: tuple | None,
                    approximate: str, dtype: Optional[torch.dtype] = None) -> Tensor:
    """``gelu(torch.addmm(bias, x, weight).view(shape))`` (GPT-2's Conv1D, then its MLP)."""
    bias, x, weight = _cast(dtype, bias, x, weight)
    y = torch.mm(x, weight)
    if shape is not None:
        y = y.view(shape)
    return K.bias_gelu(y, bias, approximate, impl=_IMPL)


def glu(gate: Tensor, up: Tensor, *, activation: str) -> Tensor:
    if activation == "silu":
        return K.swiglu(gate, up, impl=_IMPL)
    return K.geglu(gate, up, approximate="tanh" if activation == "gelu_tanh" else "none", impl=_IMPL)


def dropout(x: Tensor, *, p: float) -> Tensor:
    return K.seeded_dropout(x, p, impl=_IMPL)


def _seeded_keep_mask(q: Tensor, k: Tensor, dropout_p: float) -> Tensor:
    """``fxmem::attention_dropout_mask`` under Inductor: ``rand >= p``, which Inductor draws from its
    seeds as it draws dropout's (``native_dropout`` decomposes to ``rand_like > p``); aten's CPU
    ``bernoulli`` would draw from the generator wherever Inductor schedules it."""
    return torch.rand((*q.shape[:3], k.shape[2]), dtype=torch.float32, device=q.device) >= dropout_p


def _register_inductor_decomposition() -> None:
    """Inductor's random decompositions (used unless ``fallback_random``) take the seeded mask."""
    from torch._decomp.decompositions_for_rng import extra_random_decomps
    from torch._inductor.decomposition import fast_random_decomps

    extra_random_decomps[torch.ops.fxmem.attention_dropout_mask.default] = _seeded_keep_mask
    fast_random_decomps.cache_clear()


_register_inductor_decomposition()


def attention(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor], *, dropout_p: float,
              scale: Optional[float], is_causal: bool, dtype: Optional[torch.dtype] = None) -> Tensor:
    """``F.scaled_dot_product_attention`` with dropout, in slices. The dropout mask is drawn here
    as torch's CPU dropout draws it (the same generator, the same numbers; under Inductor from its
    seeds, as it draws dropout), then handed to the kernel; the planner sees it as the random op
    it is (replayed, never redrawn, if recomputed)."""
    q, k, v, attn_mask = _cast(dtype, q, k, v, attn_mask)  # autocast casts a float mask too (a bool one stays)
    if is_causal:  # the math path's mask: lower triangle kept
        attn_mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    keep = K.attention_dropout_mask(q, k, dropout_p)
    return K.attention(q, k, v, attn_mask, keep, dropout_p, scale=scale)
