"""Bytes an op allocates and frees inside itself, invisible as graph values, where known.

Liveness adds them as a transient allocation at the op, on top of what is alive there (its
inputs and its outputs). Known:

- fxmem's fused linear cross-entropy, which keeps a chunk of logits in flight (its workspace),
  its attention's slices of scores, and its other kernels' PyTorch paths (fp32 casts, ``x + bias``, per-row sums);
- ATen's CPU kernels that build a full-size temporary, measured with the profiler's allocator
  events (``tests/test_scratch.py`` measures each again): ``native_dropout`` draws a float mask
  the size of its input before casting it to bool, ``native_dropout_backward`` multiplies by the
  mask into a temporary, ``native_batch_norm_backward`` centres its input, ``_safe_softmax``
  builds a bool mask of the -inf entries;
- the random-op replay wrappers: their op's temporaries, and ``run_with_rng_state`` a copy of
  the generator's state (to restore it after drawing);
- an optimizer's step in the backward (``step_in_backward``): the node carries its own, per byte
  of the gradient it takes (``meta["scratch_per_byte"]``);
- CPU convolutions, forward and backward: by a formula per kernel path where one holds
  (:func:`conv_formula`: THNN's im2col columns, oneDNN's depthwise kernels, its groups-1 forward),
  else, for every other shape class (grouped, dilated, transposed, 1D/3D, bf16, the groups-1
  backward), measured per configuration, shapes and strides (:mod:`.measured`; oneDNN picks a
  layout and an implementation per shape and input layout).

- ATen's CPU flash attention (``_scaled_dot_product_flash_attention_for_cpu`` and its backward,
  :func:`_cpu_flash`): per thread, a block of scores (and in the backward their gradients) and
  a few rows; the backward also copies ``grad_out`` into the kernel's [batch, seq, heads, dim]
  layout where it is not already contiguous there (measured: 12 KiB of a 225 KiB PatchTST step).

Not counted (small): CUDA kernels' workspaces; the CPU bf16 matmul's packing buffers (a few
hundred KiB per call, measured up to 400 KiB at GPT-2's sizes).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import sympy
import torch
import torch.fx as fx
from torch._prims.rng_prims import run_and_save_rng_state, run_with_rng_state

from .measured import MEASURED, _hint, measured_scratch, value_of
from .sizes import dim_expr, tensor_bytes

aten = torch.ops.aten
ZERO = sympy.Integer(0)


def _numel(v: torch.Tensor) -> sympy.Expr:
    return sympy.Mul(*[dim_expr(d) for d in v.shape], sympy.Integer(1))


def _arguments(target, args: Sequence, kwargs: dict) -> dict[str, Any]:
    schema = target._schema
    return {a.name: args[i] if i < len(args) else kwargs.get(a.name, a.default_value)
            for i, a in enumerate(schema.arguments)}


def _linear_cross_entropy(target, args, kwargs, out) -> sympy.Expr:
    from fxmem_kernels._common import use_triton
    from fxmem_kernels.linear_cross_entropy import row_bytes

    a = _arguments(target, args, kwargs)
    target = target._schema.name
    h, w, t = (value_of(a[k]) for k in ("hidden", "weight", "target"))
    triton_path = h.is_cuda and use_triton(a["impl"], h)  # the path the kernel will take
    row = row_bytes(int(w.shape[0]), h.dtype, a["softcap"], triton_path)
    rows = _numel(t)
    cap = max(1, a["workspace_bytes"] // row)
    chunk = sympy.Min(rows, cap)
    backward = target == "fxmem::linear_cross_entropy_backward"
    weight_grad = a["grad_weight"] and (backward or a["reduction"] != "none")
    # A low-precision weight's gradient is accumulated over the chunks in an fp32 buffer, then
    # cast into the output (bf16 under autocast: 4 bytes per weight entry, GPT-2's 154 MB).
    accumulator = 4 * int(w.numel()) if weight_grad and w.dtype != torch.float32 else 0
    if triton_path:
        return chunk * row + accumulator
    # The PyTorch path's per-row vectors (targets, picked logits, maxima, lse, loss; measured
    # with int64 targets and default options): per chunk row, per row of the whole batch, and
    # per row again once the batch takes several chunks (the chunks' losses are gathered).
    if backward:
        per_chunk, per_row, fixed = 17, 0, 12
    elif a["reduction"] != "none" and (a["grad_hidden"] or a["grad_weight"] or a["grad_bias"]):
        per_chunk, per_row, fixed = 41, 5, 12
    else:
        per_chunk, per_row, fixed = 37, 1, 4
    gathered = 0 if backward else sympy.Piecewise((8 * rows, sympy.StrictGreaterThan(rows, cap)), (0, True))
    return chunk * (row + per_chunk) + per_row * rows + gathered + fixed + accumulator


def _cpu(f: Callable[[Any], sympy.Expr], arg: int = 0) -> Callable:
    """A temporary of the CPU kernel only, sized from the tensor argument ``arg``."""
    def scratch(target, args, kwargs, out):
        v = value_of(args[arg]) if len(args) > arg else None
        return f(v) if isinstance(v, torch.Tensor) and v.device.type == "cpu" else ZERO
    return scratch


_cpu_bytes = _cpu(tensor_bytes)  # a temporary the size of the first argument


def _dropout(target, args, kwargs, out) -> sympy.Expr:
    train = args[2] if len(args) > 2 else kwargs.get("train")
    return _cpu_bytes(target, args, kwargs, out) if train is not False else ZERO


def _safe_softmax_mask(v: torch.Tensor) -> sympy.Expr:  # bool per entry, then per row
    return _numel(v) + _numel(v) / dim_expr(v.shape[-1]) if v.dim() else sympy.Integer(2)


def _contiguous_copy(v: torch.Tensor) -> sympy.Expr:
    """The kernel's ``input.contiguous()``: a copy of a non-contiguous input (CPU softmax's; a
    channels-last logits map out of an interpolation's kernel, SegFormer's loss)."""
    return ZERO if v.is_contiguous() else tensor_bytes(v)


def _run_with_rng_state(target, args, kwargs, out) -> sympy.Expr:  # (state, op, *args)
    return tensor_bytes(value_of(args[0])) + op_scratch(args[1], args[2:], kwargs, out)


def _run_and_save_rng_state(target, args, kwargs, out) -> sympy.Expr:  # (op, *args) -> (state, out)
    return op_scratch(args[0], args[1:], kwargs, out[1] if isinstance(out, (tuple, list)) else None)


def _cpu_flash(target, args, kwargs, out) -> sympy.Expr:
    """ATen's CPU flash attention kernel (``FlashAttentionKernel.cpp``): blocks of ``qs`` query
    rows by ``kvs`` keys (``qs`` 32, 64 from 192 query rows, 256 from 768; ``kvs`` 512, each at
    most the sequence), one buffer per thread in the accumulation type: the forward's scores, row
    maxima and sums and an output block; the backward's scores and their gradient, and a row sum
    per thread; the backward also copies ``grad_out`` where its [batch, seq, heads, dim]
    transpose is not contiguous (``grad_out.contiguous()``). Measured with the profiler's
    allocator events (``tests/test_scratch.py``)."""
    backward = target is aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    q, k, v = (value_of(a) for a in (args[1:4] if backward else args[:3]))
    if not all(isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.dim() == 4 for t in (q, k, v)):
        return ZERO
    L, S = dim_expr(q.shape[2]), dim_expr(k.shape[2])
    qs = sympy.Min(L, sympy.Piecewise((256, sympy.Ge(L, 768)), (64, sympy.Ge(L, 192)), (32, True)))
    kvs = sympy.Min(S, 512)
    acc = 8 if q.dtype == torch.float64 else 4
    threads = torch.get_num_threads()
    if not backward:
        return acc * threads * (qs * kvs + 2 * qs + qs * dim_expr(v.shape[3]))
    reduced = q.element_size() * 2 * qs * kvs if q.dtype in (torch.float16, torch.bfloat16) else 0
    g = value_of(args[0])
    sizes, strides = [_hint(d) for d in g.shape], [_hint(st) for st in g.stride()]
    order = (0, 2, 1, 3)  # the kernel's layout: [batch, seq, heads, dim]
    expected, contiguous = 1, True
    for i in reversed(order):
        if sizes[i] != 1 and strides[i] != expected:
            contiguous = False
        expected *= sizes[i]
    copy = ZERO if contiguous else tensor_bytes(g)
    return copy + threads * (acc * (2 * qs * kvs + qs) + reduced)


def _embedding_dense_backward(target, args, kwargs, out) -> sympy.Expr:
    """The CPU kernel's ``grad.contiguous()``: a copy of a gradient that is not contiguous
    (measured: the whole gradient, e.g. an ``nn.GRU`` LM's, transposed back from time-major)."""
    g = value_of(args[0])
    if not (isinstance(g, torch.Tensor) and g.device.type == "cpu"):
        return ZERO
    expected = 1
    for size, stride in reversed(list(zip(_hints(g.shape), _hints(g.stride())))):
        if size != 1 and stride != expected:
            return tensor_bytes(g)
        expected *= size
    return ZERO


def _fxmem_cpu(f: Callable[..., sympy.Expr]) -> Callable:
    """A temporary of an fxmem kernel's PyTorch path (CPU): ``f(n, d, rows, low, a)`` with ``n``
    the elements of its input ``x``, ``d`` its last dim, ``rows`` = n / d, ``low`` whether it is
    below fp32 (the path computes in fp32) and ``a`` the arguments by name."""
    def scratch(target, args, kwargs, out):
        from fxmem_kernels._common import use_triton

        a = _arguments(target, args, kwargs)
        x = value_of(a["x"])
        if not (isinstance(x, torch.Tensor) and x.device.type == "cpu" and x.dim()) or use_triton(a["impl"], x):
            return ZERO
        n, d = _numel(x), dim_expr(x.shape[-1])
        return sympy.sympify(f(n, d, n / d, x.dtype != torch.float32, a))
    return scratch


def _embedding_backward_add(target, args, kwargs, out) -> sympy.Expr:
    """``graph.inplace._embedding_backward_into``: the unique ids and their renumbering (int64
    each), the touched rows' sums (at most the gradient's size), a masked gradient copy where a
    padding row is set."""
    grad, ids = value_of(args[1]), value_of(args[2])
    pad = args[3] if len(args) > 3 else -1
    return 16 * _numel(ids) + tensor_bytes(grad) * (2 if isinstance(pad, int) and pad >= 0 else 1)


def _bool_mask(mask: Any) -> str:
    """How ``fxmem_kernels.attention`` slices a bool mask ("": none or a float mask)."""
    if not (isinstance(mask, torch.Tensor) and mask.dtype == torch.bool):
        return ""
    return "per_head" if mask.dim() >= 3 and mask.shape[-3] != 1 else "shared"


def _attention(target, args, kwargs, out) -> sympy.Expr:
    """``fxmem_kernels.attention``'s slices (its own formula, measured by ``tests/test_scratch.py``)."""
    from fxmem_kernels.attention import scratch_bytes as attention_scratch

    a = _arguments(target, args, kwargs)
    q, k, v, mask = (value_of(a[n]) for n in ("q", "k", "v", "attn_mask"))
    shape = (lambda t: [dim_expr(d) for d in t.shape])
    return sympy.sympify(attention_scratch(
        shape(q), shape(k), dim_expr(v.shape[-1]), low=q.dtype in (torch.float16, torch.bfloat16),
        bool_mask=_bool_mask(mask),
        backward=target._schema.name == "fxmem::attention_backward", slice_bytes=a["slice_bytes"]))


def _gelu_block(rows: sympy.Expr, d: sympy.Expr) -> sympy.Expr:
    """Elements of one block of ``fxmem_kernels.bias_gelu``'s portable backward (whole rows)."""
    from fxmem_kernels.bias_gelu import BACKWARD_BLOCK_ELEMENTS

    return sympy.Min(rows, sympy.Max(1, sympy.floor(BACKWARD_BLOCK_ELEMENTS / d))) * d


def _strided_copies(a: dict, *names: str) -> sympy.Expr:
    """Bytes of the contiguous copies a kernel makes of its non-contiguous (3-D and up) inputs."""
    vals = [value_of(a[n]) for n in names]
    return sum((tensor_bytes(v) for v in vals if isinstance(v, torch.Tensor) and v.dim() > 2
                and not v.is_contiguous()), ZERO)


def _has(a: dict, name: str) -> int:
    return int(a.get(name) is not None)


# CPU convolutions (fp32, 2-D, not transposed, undilated): which kernel torch runs, and the
# temporaries of the paths that follow a formula, measured with the profiler's allocator events on
# a grid of kernels 1/3/5/7, strides 1/2, groups 1 and depthwise, 3-64 channels, batch 1-4, images
# 8-16 px, contiguous and channels-last (tests/test_scratch.py asserts each formula against the
# allocator). oneDNN's formulas hold on AVX-512 CPUs (its blocked layouts are 16 channels wide
# there: a weight's reorder is padded to whole blocks), its groups-1 formulas on 16, 32 and 64
# channels (48 took another implementation). Everywhere else, and for every call without a formula
# (bf16, 1-D/3-D, dilated, transposed, grouped, 2x2/4x4 patch kernels, groups-1 backward, mixed
# layouts: no formula held on the grid, oneDNN picks an implementation per shape), the
# temporaries are measured at the plan shape instead (:mod:`.measured`).
ONEDNN_BLOCK = 16  # channels per block of oneDNN's fp32 layouts on AVX-512


def _hints(shape) -> list[int]:
    return [_hint(d) for d in shape]


def _channels_last(v: torch.Tensor) -> bool:
    """``v`` (4-D) is in channels-last order and not also contiguous (torch's
    ``suggest_memory_format``), read off the hints of its strides."""
    n, c, h, w = _hints(v.shape)
    want = {0: h * w * c, 1: 1, 2: w * c, 3: c}
    cl = all(size == 1 or _hint(st) == want[i] for i, (size, st) in enumerate(zip((n, c, h, w), v.stride())))
    return cl and not v.is_contiguous()


def conv_path(x: torch.Tensor, w: torch.Tensor, stride, padding, dilation, transposed: bool, groups: int) -> str:
    """The CPU kernel torch 2.13 runs a float convolution on (``torch._C._select_conv_backend``,
    ``aten/src/ATen/native/Convolution.cpp``'s ``use_mkldnn``): ``"mkldnn"`` (oneDNN), ``"slow2d"``
    (THNN's im2col + gemm: small fp32 inputs of batch 1, or 1x1 kernels on one thread), or
    ``"other"`` (paths without a formula here). Decided at the hints of symbolic sizes."""
    if x.dim() != 4 or transposed or any(_hint(d) != 1 for d in dilation):
        return "other"
    if x.dtype != torch.float32:
        return "mkldnn" if x.dtype == torch.bfloat16 else "other"
    n, *_ = xs = _hints(x.shape)
    kh, kw = _hints(w.shape)[-2:]
    strided = any(_hint(s) != 1 for s in stride)
    numel = xs[0] * xs[1] * xs[2] * xs[3]
    if ((strided or n >= 16 or kh != 1 or kw != 1 or torch.get_num_threads() > 1)
            and (groups > 1 or (kh > 3 and kw > 3) or n > 1 or numel > 20480)):
        return "mkldnn"
    return "slow2d"


def _out_dim(d, k: int, s: int, p: int) -> sympy.Expr:
    return sympy.floor((dim_expr(d) + 2 * p - k) / s) + 1


def _conv_slow2d(x, w, stride, padding, groups, weight_pass: bool, forward: bool,
                 input_pass: bool) -> sympy.Expr | None:
    """THNN's ``slow_conv2d``: the im2col ``columns`` of the whole batch, ``N x (C/g * kh * kw) x
    (Ho * Wo)`` elements, built by the forward and by the weight gradient (none for a 1x1 kernel of
    stride 1 without padding: the input is its own column matrix); the input gradient needs none.
    A channels-last input: the weight is copied to channels-last first (unless it already is: a
    1x1 kernel). Measured: exactly this on every batch-1 case of the grid (8-64 channels, 3x3 and
    1x1 kernels, strides 1 and 2)."""
    if groups != 1:
        return None
    kh, kw = _hints(w.shape)[-2:]
    (sh, sw), (ph, pw) = _hints(stride), _hints(padding)
    columns = ZERO
    if forward or weight_pass:
        if (kh, kw, sh, sw, ph, pw) != (1, 1, 1, 1, 0, 0):
            columns = (dim_expr(x.shape[0]) * dim_expr(x.shape[1]) * kh * kw * _out_dim(x.shape[2], kh, sh, ph)
                       * _out_dim(x.shape[3], kw, sw, pw) * x.element_size())
    copied = _channels_last(x) and kh * kw > 1 and (forward or weight_pass or input_pass)
    return columns + (tensor_bytes(w) if copied else ZERO)


def _blocks(c: int) -> int:
    return -(-c // ONEDNN_BLOCK) * ONEDNN_BLOCK


def _pow2_blocks(c: int) -> bool:
    """``c`` is a power-of-two number of oneDNN blocks (16, 32, 64, ... channels: a groups-1
    formula's domain, measured on 16-64)."""
    return c >= ONEDNN_BLOCK and c % ONEDNN_BLOCK == 0 and (c // ONEDNN_BLOCK) & (c // ONEDNN_BLOCK - 1) == 0


def _onednn_formulas() -> bool:
    """Whether oneDNN's formulas apply here: the CPU capability they were measured on."""
    return torch.backends.cpu.get_cpu_capability() == "AVX512"


def _conv_mkldnn_depthwise(x, w, stride, padding, weight_pass: bool, forward: bool,
                           bias: bool) -> sympy.Expr | None:
    """oneDNN, depthwise (one input channel per group, as many outputs), channels-last input and
    gradient (ConvNeXt's 7x7): the forward and the input gradient reorder only the weight, padded
    to whole blocks of channels (``wp``: 3136 bytes for a 7x7 kernel on 3, 8 or 16 channels); the
    weight gradient (computed whenever the weight's or the bias's is asked for) holds ``257 wb``
    for 5x5 and 7x7 kernels, whatever the batch, image size, stride and thread count (1-4; oneDNN's
    per-thread weight accumulators: 3.2 MB for a 7x7 on 64 channels, the largest temporary of a
    ConvNeXt step) and ``2 wb`` for 3x3 (channels a whole number of blocks), plus the bias
    gradient's bytes. A contiguous input: the forward reorders the input and the weight (their
    bytes; channels a whole number of blocks); its backward follows no formula on the grid.
    Images below the grid's 8 px are measured instead: a 3x3 weight gradient on 2x2 images of
    128 channels (SegFormer's last stage at 64 px) held 1.1 MiB, not ``2 wb`` (9 KiB)."""
    kh, kw = _hints(w.shape)[-2:]
    c = _hint(w.shape[0])
    if kh != kw or kh not in (3, 5, 7) or min(_hints(x.shape[2:])) < 8:
        return None
    wb = tensor_bytes(w)
    whole = c % ONEDNN_BLOCK == 0
    if not _channels_last(x):
        return tensor_bytes(x) + wb if forward and whole else None
    if forward or not weight_pass:
        return _blocks(c) * kh * kw * w.element_size()
    if kh == 3 and not whole:
        return None
    return (2 if kh == 3 else 257) * wb + (dim_expr(w.shape[0]) * x.element_size() if bias else ZERO)


def _conv_mkldnn_dense(x, w, stride, padding, masks: tuple[bool, bool, bool] | None) -> sympy.Expr | None:
    """oneDNN, groups 1, the forward (``masks`` None), 3x3 and 7x7 kernels (and 1x1 of stride 1),
    contiguous input, input and output channels a power-of-two number of blocks: it reorders the
    input and the weight into blocked layouts and writes a blocked output it then copies,
    ``max(xb + wb, ob)`` beyond the output (exact on the grid, and on a ResNet's convolutions at
    batch 8). Not covered (measured): the backward (``max(wb, xb + ob)`` for the weight gradient on
    batches 1-4, but 45 KB more at batch 8 with 32 channels, 16 px: oneDNN's per-thread partial
    sums), the channels-last forward (``2 wb`` plus a per-thread scratchpad of ``4096 + 4120 *
    threads`` bytes on 16-64 channels, but the reordered weight padded to 4/3 of it at 48 channels
    on some image sizes)."""
    kh, kw = _hints(w.shape)[-2:]
    s = _hints(stride)
    if masks is not None or _channels_last(x) or kh != kw or kh not in (1, 3, 7) or s[0] != s[1] or s[0] not in (1, 2):
        return None
    if not all(_pow2_blocks(_hint(c)) for c in (x.shape[1], w.shape[0])):
        return None  # other implementations: no formula held on 3, 8, 24, 40 or 48 channels
    k, s = kh, s[0]
    if k == 1 and s != 1:
        return None
    p = _hints(padding)
    ob = (dim_expr(x.shape[0]) * dim_expr(w.shape[0]) * _out_dim(x.shape[2], k, s, p[0])
          * _out_dim(x.shape[3], k, s, p[1]) * x.element_size())
    return sympy.Max(tensor_bytes(x) + tensor_bytes(w), ob)


def conv_formula(target, args: Sequence) -> sympy.Expr | None:
    """A CPU convolution's (or its backward's) temporary bytes by the formula of the kernel torch
    runs it on, or None where no formula covers the call (then it is measured)."""
    backward = target is aten.convolution_backward.default
    if backward:
        grad, x, w, bias_sizes, stride, padding, dilation, transposed, _, groups, masks = args
        grad = value_of(grad)
    else:
        x, w, bias, stride, padding, dilation, transposed, _, groups = args
    x, w = value_of(x), value_of(w)
    if not (isinstance(x, torch.Tensor) and isinstance(w, torch.Tensor) and x.device.type == "cpu"):
        return None
    groups, stride, padding, dilation = _hint(groups), [_hint(v) for v in stride], [_hint(v) for v in padding], \
        [_hint(v) for v in dilation]
    path = conv_path(x, w, stride, padding, dilation, transposed, groups)
    if x.dtype != torch.float32 or path == "other":
        return None
    if backward:
        masks = tuple(bool(m) for m in masks)
        if not isinstance(grad, torch.Tensor) or _channels_last(grad) != _channels_last(x):
            return None  # a gradient in another layout than its input: copied, not covered
    if path == "mkldnn" and not _onednn_formulas():
        return None
    if path == "slow2d":
        return _conv_slow2d(x, w, stride, padding, groups, forward=not backward,
                            weight_pass=backward and masks[1], input_pass=backward and masks[0])
    c, o = _hint(x.shape[1]), _hint(w.shape[0])
    if groups == c == o and _hint(w.shape[1]) == 1:
        return _conv_mkldnn_depthwise(x, w, stride, padding, forward=not backward,
                                      weight_pass=backward and (masks[1] or masks[2]),
                                      bias=backward and masks[2])
    if groups == 1:
        return _conv_mkldnn_dense(x, w, stride, padding, masks if backward else None)
    return None


def _convolution(target, args, kwargs, out) -> sympy.Expr:
    """A CPU convolution's temporaries: its kernel's formula (:func:`conv_formula`), else measured."""
    if not kwargs:
        try:
            found = conv_formula(target, args)
        except (TypeError, ValueError):  # an argument list of another form: measured
            found = None
        if found is not None:
            return sympy.sympify(found)
    return measured_scratch(target, args, kwargs, out, covered=_covered)


def _covered(target, args) -> bool:
    try:
        return conv_formula(target, args) is not None
    except (TypeError, ValueError):
        return False


# Measured on CPU in fp32 and bf16 (tests/test_scratch.py): the fp32 casts of low-precision
# inputs, ``x + bias`` before the GELU derivative (a block of rows at a time), fp32 copies of a
# norm's weight, per-row sums.
_FXMEM_KERNELS = {
    "fxmem::bias_gelu": lambda n, d, rows, low, a: (6 * n + 4 * d * _has(a, "bias")) if low else 0,
    "fxmem::bias_gelu_backward": lambda n, d, rows, low, a: ((12 if low else 4 * _has(a, "bias")) * _gelu_block(rows, d)
                                                             + _strided_copies(a, "grad_y", "x")),
    "fxmem::layer_norm": lambda n, d, rows, low, a: 8 * d if low else 0,
    "fxmem::layer_norm_backward": lambda n, d, rows, low, a: 16 * d if low else 8 * d,
    "fxmem::rms_norm": lambda n, d, rows, low, a: 10 * n if low else 4 * n + 4 * d + 12,
    "fxmem::rms_norm_backward": lambda n, d, rows, low, a: 18 * n + 6 * d if low else 4 * n + 4 * d + 8 * rows,
}

_SCRATCH: dict[Any, Callable[..., sympy.Expr]] = {
    "fxmem::linear_cross_entropy": _linear_cross_entropy,
    "fxmem::linear_cross_entropy_backward": _linear_cross_entropy,
    "fxmem::embedding_backward_add": _embedding_backward_add,
    "fxmem::attention": _attention,
    "fxmem::attention_backward": _attention,
    aten.native_dropout.default: _dropout,
    aten.native_dropout_backward.default: _cpu_bytes,
    aten.native_batch_norm_backward.default: _cpu(tensor_bytes, arg=1),
    aten._safe_softmax.default: _cpu(_safe_softmax_mask),
    aten._softmax.default: _cpu(_contiguous_copy),
    aten._log_softmax.default: _cpu(_contiguous_copy),
    aten.embedding_dense_backward.default: _embedding_dense_backward,
    aten._scaled_dot_product_flash_attention_for_cpu.default: _cpu_flash,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: _cpu_flash,
    run_with_rng_state: _run_with_rng_state,
    run_and_save_rng_state: _run_and_save_rng_state,
    **{op: _convolution for op in MEASURED},
    **{name: _fxmem_cpu(f) for name, f in _FXMEM_KERNELS.items()},
}


def op_scratch(target, args: Sequence, kwargs: dict, out: Any) -> sympy.Expr:
    """Temporary bytes of ``target`` called on ``args`` (graph nodes or values) returning ``out``."""
    f = _SCRATCH.get(target)
    if f is None:
        f = _SCRATCH.get(getattr(getattr(target, "overloadpacket", None), "_qualified_op_name", None))
    return f(target, args, kwargs, out) if f is not None else ZERO


def scratch_bytes(node: fx.Node) -> sympy.Expr:
    """``node``'s temporaries: as its op's (``op_scratch``), or, where the pass that made the node
    knows them (``step_in_backward``'s optimizer step), ``meta["scratch_per_byte"]`` bytes per byte
    of its first argument, or of ``meta["scratch_block"]`` bytes where the op works in blocks of
    that size."""
    per_byte = node.meta.get("scratch_per_byte")
    if per_byte is not None:
        nbytes = tensor_bytes(node.args[0].meta["val"])
        block = node.meta.get("scratch_block")
        return sympy.nsimplify(per_byte) * (nbytes if block is None else sympy.Min(nbytes, block))
    return op_scratch(node.target, node.args, node.kwargs, node.meta.get("val"))
