"""The temporaries liveness counts inside ops (``fxmem.graph.scratch``), against the allocator's
events of the CPU kernels, and the allocation of an op's several outputs at the op."""

import itertools
import operator

import pytest
import sympy
import torch
from torch._prims.rng_prims import run_and_save_rng_state, run_with_rng_state
from torch.fx.experimental.proxy_tensor import make_fx

from fxmem.graph.liveness import simulate
from fxmem.graph.scratch import op_scratch
from fxmem.graph.sizes import SymbolicSizes
from fxmem.profiling import step_perf

aten = torch.ops.aten


def _nbytes(t):
    return t.untyped_storage().nbytes()


def measured(f, *args):
    """Bytes ``f(*args)`` allocated at its peak beyond the fresh tensors it returns."""
    with step_perf("cpu") as perf:
        out = f(*args)
    ins = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
    outs = [o for o in (out if isinstance(out, (tuple, list)) else [out]) for o in (o if isinstance(o, tuple) else [o])]
    fresh = sum(_nbytes(o) for o in outs if isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() not in ins)
    return perf.result.peak_bytes - fresh, out


def _bn_backward_args(x):
    c = x.shape[1]
    w, rm, rv = torch.randn(c), torch.zeros(c), torch.ones(c)
    _, mean, rstd, *_ = aten._native_batch_norm_legit_functional.default(x, w, w, rm, rv, True, 0.1, 1e-5)
    return (x, x, w, rm, rv, mean, rstd, True, 1e-5, [True, True, True])


CASES = {
    "native_dropout": (aten.native_dropout.default, lambda x: (x, 0.1, True)),
    "native_dropout_backward": (aten.native_dropout_backward.default, lambda x: (x, torch.rand(x.shape) > 0.1, 1.1)),
    "native_batch_norm_backward": (aten.native_batch_norm_backward.default, _bn_backward_args),
    "_safe_softmax": (aten._safe_softmax.default, lambda x: (x, -1)),
}


@pytest.mark.parametrize("shape", [(2, 8, 6, 5), (4, 16, 32, 32)])
@pytest.mark.parametrize("case", list(CASES))
def test_cpu_kernel_temporaries_match_the_allocator(case, shape):
    op, make = CASES[case]
    args = make(torch.randn(shape))
    got, out = measured(op, *args)
    predicted = int(op_scratch(op, args, {}, out))
    assert got > 0 and abs(predicted - got) <= 16 + 0.01 * got, (case, shape, predicted, got)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_replay_wrappers_add_their_own_temporaries(dtype):
    x = torch.randn(4, 64, 32).to(dtype)
    got, out = measured(lambda x: run_and_save_rng_state(aten.native_dropout.default, x, 0.1, True), x)
    assert int(op_scratch(run_and_save_rng_state, (aten.native_dropout.default, x, 0.1, True), {}, out)) == got
    state = torch.get_rng_state()
    got, out = measured(lambda s, x: run_with_rng_state(s, aten.native_dropout.default, x, 0.1, True), state, x)
    assert int(op_scratch(run_with_rng_state, (state, aten.native_dropout.default, x, 0.1, True), {}, out)) == got


def test_no_temporary_without_training_or_off_cpu():
    x = torch.randn(4, 8, device="meta")
    assert op_scratch(aten.native_dropout.default, (x, 0.1, True), {}, None) == 0
    assert op_scratch(aten.native_dropout.default, (torch.randn(4, 8), 0.1, False), {}, None) == 0
    assert op_scratch(aten.mm.default, (torch.randn(4, 8), torch.randn(8, 2)), {}, None) == 0


def test_an_op_returning_several_outputs_allocates_them_all_while_its_inputs_live():
    def f(x):
        y = torch.exp(x)  # dies at the layer norm, which allocates out, mean and rstd beside it
        out, mean, rstd = aten.native_layer_norm.default(y, [64], None, None, 1e-5)
        return out, mean, rstd

    x = torch.randn(8, 64)
    gm = make_fx(f, tracing_mode="fake")(x)
    live = simulate(gm, SymbolicSizes(), inputs_freed=False)
    n = 8 * 64 * 4
    assert live.peak == n + n + n + 2 * 8 * 4 and live.peak_at.startswith("getitem")  # x, y, out, mean, rstd
    with step_perf("cpu") as perf:
        gm(x)
    assert abs(perf.result.peak_bytes - (live.peak - n)) <= 16  # x exists before the call


def test_an_op_output_lives_until_its_tuple_is_last_read():
    """A getitem taken late keeps the op's tuple, and so every output of it, alive (the split's
    backward takes a recomputed norm's rstd after its output died): the output is freed at the
    last getitem, not at its own last read."""
    def f(x):
        out, mean, rstd = aten.native_layer_norm.default(x, [64], None, None, 1e-5)
        a = out * 2  # out's last read
        b = a * 3  # allocated while the tuple still holds out
        return b + rstd  # rstd's getitem moved here below

    x = torch.randn(8, 64)
    gm = make_fx(f, tracing_mode="fake")(x)
    late = next(n for n in gm.graph.nodes if n.target is operator.getitem and n.args[1] == 2)
    add = next(n for n in gm.graph.nodes if n.target is aten.add.Tensor)
    add.prepend(late)
    gm.recompile()
    n = 8 * 64 * 4
    live = simulate(gm, SymbolicSizes(), inputs_freed=False)
    assert live.peak == n + n + n + n + 2 * 8 * 4  # x, out (held), a, b, mean and rstd
    with step_perf("cpu") as perf:
        gm(x)
    assert abs(perf.result.peak_bytes - (live.peak - n)) <= 16  # x exists before the call


CONVS = [  # (input, weight, stride, padding): oneDNN's reorders differ with each; no formula covers these
    ((2, 3, 16, 16), (8, 3, 4, 4), 4, 0),
    ((2, 16, 16, 16), (8, 16, 1, 1), 2, 0),
    ((2, 8, 12, 12), (8, 8, 5, 5), 1, 2),
]


@pytest.mark.parametrize("x_shape,w_shape,stride,padding", CONVS)
def test_convolution_temporaries_are_measured_once_per_configuration(x_shape, w_shape, stride, padding,
                                                                     tmp_path, monkeypatch):
    import fxmem.graph.measured as measured_mod

    monkeypatch.setenv("FXMEM_CACHE", str(tmp_path))
    measured_mod.known.cache_clear()
    x, w = torch.randn(x_shape), torch.randn(w_shape)
    fwd = (x, w, None, [stride] * 2, [padding] * 2, [1, 1], False, [0, 0], 1)
    out = aten.convolution.default(*fwd)
    bwd = (torch.randn_like(out), x, w, None, [stride] * 2, [padding] * 2, [1, 1], False, [0, 0], 1,
           [True, True, False])
    with step_perf("cpu"):  # a profiler running in the caller: the child process measures
        predicted = [int(op_scratch(aten.convolution.default, fwd, {}, None)),
                     int(op_scratch(aten.convolution_backward.default, bwd, {}, None))]
    for op, args, p in zip((aten.convolution.default, aten.convolution_backward.default), (fwd, bwd), predicted):
        op(*args)  # oneDNN's primitive cache warm, as in the child
        got, _ = measured(op, *args)
        assert p == got, (op, p, got)
    assert (tmp_path / "scratch.json").exists() and len(measured_mod.known()) == 2
    measured_mod.known.cache_clear()  # a new process reads the disk cache
    assert int(op_scratch(aten.convolution.default, fwd, {}, None)) == predicted[0]
    assert len(measured_mod.known()) == 2
    monkeypatch.setenv("FXMEM_MEASURE_SCRATCH", "0")
    assert op_scratch(aten.convolution.default, fwd, {}, None) == 0
    measured_mod.known.cache_clear()  # the next test reads the real cache again


# Every shape class of convolution (input, weight, stride, padding, dilation, transposed, groups,
# channels-last input and gradient): oneDNN's temporaries differ with each, and with the layout.
CONV_CLASSES = {
    "depthwise-3x3": ((2, 32, 28, 28), (32, 1, 3, 3), 1, 1, 1, False, 32, False),
    "depthwise-7x7": ((2, 32, 28, 28), (32, 1, 7, 7), 1, 3, 1, False, 32, False),
    "depthwise-7x7-channels-last": ((2, 32, 28, 28), (32, 1, 7, 7), 1, 3, 1, False, 32, True),
    "grouped": ((2, 32, 16, 16), (64, 8, 3, 3), 1, 1, 1, False, 4, False),
    "dilated": ((2, 16, 16, 16), (16, 16, 3, 3), 1, 2, 2, False, 1, False),
    "transposed": ((2, 16, 8, 8), (16, 8, 4, 4), 2, 1, 1, True, 1, False),
    "1d-strided": ((2, 1, 400), (16, 1, 10), 5, 0, 1, False, 1, False),
    "1d-transposed": ((2, 16, 32), (16, 8, 4), 2, 1, 1, True, 1, False),
    "3d": ((2, 4, 8, 8, 8), (8, 4, 3, 3, 3), 1, 1, 1, False, 1, False),
    "2d-channels-last": ((2, 16, 16, 16), (32, 16, 3, 3), 1, 1, 1, False, 1, True),
}


def _conv_calls(case):
    """(forward args, backward args) of a convolution of shape class ``case``."""
    x_shape, w_shape, stride, padding, dilation, transposed, groups, channels_last = CONV_CLASSES[case]
    torch.manual_seed(0)
    k = len(x_shape) - 2
    x, w = torch.randn(x_shape), torch.randn(w_shape)
    fwd = [x, w, None, [stride] * k, [padding] * k, [dilation] * k, transposed, [0] * k, groups]
    grad = torch.randn_like(aten.convolution.default(*fwd))
    if channels_last:
        fwd[0] = x.contiguous(memory_format=torch.channels_last)
        grad = grad.contiguous(memory_format=torch.channels_last)
    return tuple(fwd), (grad, *fwd[:2], None, *fwd[3:], [True, True, False])


@pytest.mark.parametrize("case", [c if c == "depthwise-7x7-channels-last" else pytest.param(c, marks=pytest.mark.slow)
                                  for c in CONV_CLASSES])
def test_every_convolution_shape_class_predicts_its_temporaries_exactly(case, tmp_path, monkeypatch):
    """Predicted (measured in a child process at the call's shapes and strides) equals the
    allocator's count here, forward and backward."""
    import fxmem.graph.measured as measured_mod

    monkeypatch.setenv("FXMEM_CACHE", str(tmp_path))
    measured_mod.known.cache_clear()
    try:
        calls = list(zip((aten.convolution.default, aten.convolution_backward.default), _conv_calls(case)))
        predicted = [int(op_scratch(op, args, {}, None)) for op, args in calls]  # the child measures
    finally:
        measured_mod.known.cache_clear()  # the next test reads the real cache again
    for (op, args), p in zip(calls, predicted):
        op(*args)  # oneDNN's primitive cache warm, as in the child
        got, _ = measured(op, *args)
        assert p == got, (case, op, p, got)


# The convolution formulas (fxmem.graph.scratch.conv_formula), per kernel path: each class a grid
# of kernels, strides, channels (whole 16-channel blocks and not), image sizes and batches, in its
# layout; every call the formula covers must equal the allocator's count exactly, and the listed
# calls must be covered.
MASKS = {"TTF": [True, True, False], "TFF": [True, False, False], "FTF": [False, True, False],
         "TTT": [True, True, True], "FTT": [False, True, True]}
FORMULA_GRIDS = {  # class: (groups, channels-last, kernels, (C, O) pairs, batches, image sizes)
    "slow2d": ("dense", False, (1, 3), ((3, 16), (16, 32), (32, 16)), (1,), (8, 11)),
    "slow2d-channels-last": ("dense", True, (1, 3), ((16, 16), (16, 32)), (1,), (8,)),
    "dense": ("dense", False, (1, 3, 7), ((16, 32), (64, 64), (3, 16), (48, 48)), (2, 3), (8, 13)),
    "depthwise": ("depthwise", False, (3, 7), ((16, 16), (24, 24)), (2,), (8, 13)),
    "depthwise-channels-last": ("depthwise", True, (3, 5, 7), ((16, 16), (48, 48), (3, 3), (24, 24)), (2, 3),
                                (8, 13)),
}
MUST_COVER = {  # (kernel, stride, C, call) that a class's formula covers, at every batch and size
    "slow2d": [(3, 1, 3, "f"), (3, 2, 16, "TTF"), (1, 2, 32, "FTT"), (3, 1, 16, "TFF")],
    "slow2d-channels-last": [(3, 1, 16, "f"), (3, 2, 16, "TTF")],
    "dense": [(3, 1, 16, "f"), (3, 2, 64, "f"), (7, 2, 16, "f"), (1, 1, 64, "f")],
    "depthwise": [(7, 1, 16, "f"), (3, 2, 16, "f")],
    "depthwise-channels-last": [(7, 1, 3, "TTT"), (7, 2, 24, "FTF"), (5, 1, 16, "TTF"), (3, 1, 48, "TTF"),
                                (3, 2, 24, "f"), (7, 1, 16, "TFF")],
}


def _formula_calls(case):
    """(kernel, stride, C, call name, op, args) over a class's grid, and torch's backend per config."""
    from fxmem.graph.scratch import conv_path

    kind, channels_last, kernels, pairs, batches, sizes = FORMULA_GRIDS[case]
    torch.manual_seed(0)
    for k, s, (c, o), n, h in itertools.product(kernels, (1, 2), pairs, batches, sizes):
        groups, o = (c, c) if kind == "depthwise" else (1, o)
        x, w = torch.randn(n, c, h, h), torch.randn(o, c // groups, k, k)
        if channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        fwd = (x, w, None, [s, s], [k // 2] * 2, [1, 1], False, [0, 0], groups)
        backend = str(torch._C._select_conv_backend(*fwd, None)).rsplit(".", 1)[-1].lower()
        assert conv_path(x, w, [s, s], [k // 2] * 2, [1, 1], False, groups) == backend, (case, k, s, c, n, h)
        if case.startswith("slow2d") != (backend == "slow2d"):
            continue
        out = aten.convolution.default(*fwd)
        yield k, s, c, "f", aten.convolution.default, fwd
        grad = torch.randn_like(out)  # in the output's layout (channels-last where the input is)
        for name, mask in MASKS.items():
            yield k, s, c, name, aten.convolution_backward.default, (grad, x, w, [o] if mask[2] else None,
                                                                     *fwd[3:], mask)


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() != "AVX512",
                    reason="oneDNN's formulas were measured on AVX-512 (16-channel blocks); measured elsewhere")
@pytest.mark.parametrize("case", list(FORMULA_GRIDS))
def test_convolution_formulas_equal_the_allocator_per_kernel_path(case):
    """Each formula of :func:`fxmem.graph.scratch.conv_formula` equals the allocator's count
    exactly wherever it covers a call (on shapes beyond those it was derived on: 13 px images,
    batch 3, 24 and 48 channels), and covers the listed calls."""
    from fxmem.graph.scratch import conv_formula

    torch.set_num_threads(2)  # a 1x1 kernel on one thread runs on slow2d, not oneDNN (restored by conftest)
    covered = set()
    for k, s, c, name, op, args in _formula_calls(case):
        predicted = conv_formula(op, args)
        if predicted is None:
            continue
        op(*args)  # oneDNN's primitive cache warm
        got, _ = measured(op, *args)
        assert int(predicted) == got, (case, k, s, c, name, [tuple(a.shape) for a in args[:3] if a is not None],
                                       int(predicted), got)
        covered.add((k, s, c, name))
    missing = [m for m in MUST_COVER[case] if m not in covered]
    assert not missing, (case, missing)


def test_convolution_formulas_are_symbolic_and_never_measured(tmp_path, monkeypatch):
    """A graph traced with symbolic sizes: a covered convolution's temporaries are a formula of the
    batch and image size (no child process, no cache file) that equals the allocator's count at
    other shapes; ConvNeXt's depthwise 7x7 weight gradient is the same at every shape."""
    import fxmem.graph.measured as measured_mod

    monkeypatch.setenv("FXMEM_CACHE", str(tmp_path))
    measured_mod.known.cache_clear()

    def f(x, w, d, dw, g):
        out = aten.convolution.default(x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
        return out, aten.convolution_backward.default(g, d, dw, [32], [1, 1], [3, 3], [1, 1], False, [0, 0], 32,
                                                      [True, True, True])

    def args(n, h):
        d = torch.randn(n, 32, h, h).contiguous(memory_format=torch.channels_last)
        return torch.randn(n, 16, h, h), torch.randn(32, 16, 3, 3), d, torch.randn(32, 1, 7, 7), torch.randn_like(d)

    try:
        gm = make_fx(f, tracing_mode="symbolic")(*args(2, 8))
        nodes = [n for n in gm.graph.nodes if n.target in (aten.convolution.default,
                                                           aten.convolution_backward.default)]
        formulas = [op_scratch(n.target, n.args, n.kwargs, n.meta["val"]) for n in nodes]
        inputs = [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"]
        assert inputs[0].shape[0].node.expr in formulas[0].free_symbols, formulas
        traced = {dim.node.expr: v for val, t in zip(inputs, args(2, 8)) for dim, v in zip(val.shape, t.shape)
                  if isinstance(dim, torch.SymInt)}  # the weight's sizes are symbols too under make_fx
        assert formulas[1].subs(traced) == 257 * 32 * 49 * 4 + 32 * 4  # per-thread accumulators
        assert not formulas[1].free_symbols & {inputs[2].shape[0].node.expr, inputs[2].shape[2].node.expr}
        assert not (tmp_path / "scratch.json").exists() and not measured_mod.known()
    finally:
        measured_mod.known.cache_clear()
    for n, h in ((3, 13), (5, 8)):
        x, w, d, dw, g = values = args(n, h)
        at = {dim.node.expr: v for val, t in zip(inputs, values) for dim, v in zip(val.shape, t.shape)
              if isinstance(dim, torch.SymInt)}
        calls = [(aten.convolution.default, (x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)),
                 (aten.convolution_backward.default, (g, d, dw, [32], [1, 1], [3, 3], [1, 1], False, [0, 0], 32,
                                                      [True, True, True]))]
        for e, (op, call) in zip(formulas, calls):
            op(*call)
            got, _ = measured(op, *call)
            assert int(sympy.sympify(e).subs(at)) == got, (op, n, h)


@pytest.mark.parametrize("w_shape,stride,padding", [((16, 3, 4, 4), 4, 0), ((8, 16, 1, 1), 2, 0)])
def test_a_measured_convolution_with_a_symbolic_batch_is_the_line_through_two_batches(w_shape, stride, padding,
                                                                                      tmp_path, monkeypatch):
    """No formula covers these (a 4x4 patch embedding, a strided 1x1 on 8 outputs): measured at
    the plan's batch and one more example, the temporaries at other batches are the line through
    the two (not the plan's bytes scaled by the batch: oneDNN's scratchpads and weight reorders
    are fixed). Exact where they are affine in the batch (the 1x1); where a fixed buffer gives way
    to a per-example one beyond the two (the patch embedding's output reorder from batch 4 on), the
    line is a lower bound (the temporaries are a maximum of affine terms: convex in the batch)."""
    import fxmem.graph.measured as measured_mod

    monkeypatch.setenv("FXMEM_CACHE", str(tmp_path))
    measured_mod.known.cache_clear()
    c = w_shape[1]
    conv = (lambda x, w: aten.convolution.default(x, w, None, [stride] * 2, [padding] * 2, [1, 1], False, [0, 0], 1))
    try:
        gm = make_fx(conv, tracing_mode="symbolic")(torch.randn(2, c, 16, 16), torch.randn(w_shape))
        node = next(n for n in gm.graph.nodes if n.target is aten.convolution.default)
        formula = op_scratch(node.target, node.args, node.kwargs, node.meta["val"])
        assert len(measured_mod.known()) == 2  # batch 2 and 3
    finally:
        measured_mod.known.cache_clear()
    inputs = [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"]
    for n in (2, 3, 4, 6):
        x, w = torch.randn(n, c, 16, 16), torch.randn(w_shape)
        at = {d.node.expr: v for val, t in zip(inputs, (x, w)) for d, v in zip(val.shape, t.shape)
              if isinstance(d, torch.SymInt)}
        conv(x, w)
        got, _ = measured(conv, x, w)
        predicted = int(formula.subs(at))
        if n <= 3 or w_shape[-1] == 1:
            assert predicted == got, (n, predicted, got)
        else:
            assert 0 < predicted <= got, (n, predicted, got)


@pytest.mark.parametrize("rows,vocab,workspace", [(4, 16, 1 << 20), (256, 1000, 1 << 22), (512, 1000, 64000),
                                                  (2048, 100, 40000)])
def test_fused_loss_workspace_and_row_vectors_match_the_allocator(rows, vocab, workspace):
    import fxmem_kernels  # noqa: F401  (registers fxmem::linear_cross_entropy)

    fwd, bwd = torch.ops.fxmem.linear_cross_entropy.default, torch.ops.fxmem.linear_cross_entropy_backward.default
    x, w, t = torch.randn(rows, 8), torch.randn(vocab, 8), torch.randint(0, vocab, (rows,))
    for grads in (False, True):
        kw = dict(grad_hidden=grads, grad_weight=grads, workspace_bytes=workspace)
        got, out = measured(lambda *a: fwd(*a, **kw), x, w, None, t)
        assert int(op_scratch(fwd, (x, w, None, t), kw, out)) == got, (grads, got)
    kw = dict(workspace_bytes=workspace)
    got, out2 = measured(lambda *a: bwd(*a, **kw), torch.ones(rows), x, w, None, t, out[1])
    assert int(op_scratch(bwd, (torch.ones(rows), x, w, None, t, out[1]), kw, out2)) == got


def test_fused_loss_bf16_counts_the_fp32_weight_gradient_accumulator():
    """bf16 inputs (autocast's): the weight gradient is accumulated in an fp32 buffer of the
    weight's size; beyond the model, only the CPU bf16 matmul's packing buffers (measured 40-140 kB
    at these sizes, a few hundred kB at GPT-2's; not counted)."""
    import fxmem_kernels  # noqa: F401  (registers fxmem::linear_cross_entropy)

    fwd, bwd = torch.ops.fxmem.linear_cross_entropy.default, torch.ops.fxmem.linear_cross_entropy_backward.default
    for rows, vocab, workspace in ((256, 1000, 1 << 22), (512, 1000, 64000), (2048, 100, 40000)):
        x, w = torch.randn(rows, 8).to(torch.bfloat16), torch.randn(vocab, 8).to(torch.bfloat16)
        t = torch.randint(0, vocab, (rows,))
        kw = dict(grad_hidden=True, grad_weight=True, workspace_bytes=workspace, loss_dtype=torch.float32)
        got, out = measured(lambda *a: fwd(*a, **kw), x, w, None, t)
        predicted = int(op_scratch(fwd, (x, w, None, t), kw, out))
        assert 0 <= got - predicted <= 150_000 and predicted > 4 * w.numel(), (rows, got, predicted)
        kw = dict(workspace_bytes=workspace)
        got, out2 = measured(lambda *a: bwd(*a, **kw), torch.ones(rows), x, w, None, t, out[1])
        predicted = int(op_scratch(bwd, (torch.ones(rows), x, w, None, t, out[1]), kw, out2))
        assert 0 <= got - predicted <= 150_000, (rows, got, predicted)


def _kernel_calls(x):
    import fxmem_kernels  # noqa: F401  (registers the fxmem ops)

    f = torch.ops.fxmem
    d = x.shape[-1]
    w, b = torch.randn(d, dtype=x.dtype), torch.randn(d, dtype=x.dtype)
    _, mean, rstd = f.layer_norm.default(x, w, b)
    _, r = f.rms_norm.default(x, w)
    return [(f.bias_gelu.default, (x, b)), (f.bias_gelu.default, (x, None)),
            (f.bias_gelu_backward.default, (x, x, b)), (f.bias_gelu_backward.default, (x, x, None)),
            (f.layer_norm.default, (x, w, b)), (f.layer_norm_backward.default, (x, x, w, b, mean, rstd)),
            (f.rms_norm.default, (x, w)), (f.rms_norm_backward.default, (x, x, w, r))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(4, 16, 32), (2, 64, 128)])
def test_fxmem_kernels_portable_path_temporaries_match_the_allocator(shape, dtype):
    """Exact in the terms that grow with the input; within a few weight-sized buffers (ATen's
    layer-norm backward keeps per-thread partial sums of the weight's gradient)."""
    for op, args in _kernel_calls(torch.randn(shape).to(dtype)):
        got, out = measured(op, *args)
        predicted = int(op_scratch(op, args, {}, out))
        assert abs(predicted - got) <= 16 + 32 * shape[-1], (op, dtype, predicted, got)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1024, 3072), (3, 700, 999)])
@pytest.mark.parametrize("bias", [True, False])
def test_bias_gelu_backward_works_in_blocks_of_rows_and_counts_one(shape, dtype, bias):
    """GPT-2's MLP width (several blocks) and rows that do not divide a block: one block's fp32
    pre-activation (and, in bf16, its fp32 casts) is the whole temporary, exactly."""
    import fxmem_kernels  # noqa: F401  (registers fxmem::bias_gelu_backward)

    op = torch.ops.fxmem.bias_gelu_backward.default
    x = torch.randn(shape).to(dtype)
    args = (x, x, torch.randn(shape[-1]).to(dtype) if bias else None)
    got, out = measured(op, *args)
    assert int(op_scratch(op, args, {}, out)) == got
    assert got <= 12 * 2**18 + 12 * shape[-1]  # a block, not the input: 12 bytes per element at most


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bias_gelu_backward_counts_the_copies_of_strided_inputs(dtype):
    import fxmem_kernels  # noqa: F401  (registers fxmem::bias_gelu_backward)

    op = torch.ops.fxmem.bias_gelu_backward.default
    x = torch.randn(8, 512, 256).to(dtype).transpose(0, 1)
    for grad in (x, torch.randn(512, 8, 256).to(dtype)):
        args = (grad, x, torch.randn(256).to(dtype))
        got, out = measured(op, *args)
        assert int(op_scratch(op, args, {}, out)) == got
    assert op(torch.randn(5, 0), torch.randn(5, 0), None).shape == (5, 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mask", [None, "bool", "bool_per_head", "float"])
@pytest.mark.parametrize("shapes", [((2, 12, 512, 64), 512, 64), ((2, 4, 128, 32), 96, 16), ((1, 2, 7, 5), 9, 3),
                                    ((2, 8, 16, 64), 512, 64), ((1, 3, 512, 128), 40, 200)])
def test_attention_slices_are_counted_exactly(shapes, mask, dtype):
    """fxmem::attention and its backward: the largest moment of a slice (its scores' blocks, or
    where the head dim outweighs the lengths, its q/k rows: T5's cross-attention, 16 queries over
    512 keys), a bool mask's additive form, and in bf16 the slice's fp32 operands (GPT-2 small's
    shape: 2 heads a slice). Within 64 bytes (a few scalars)."""
    from fxmem_kernels.attention import dropout_mask

    (b, h, length, dim), keys, v_dim = shapes
    q, k = torch.randn(b, h, length, dim).to(dtype), torch.randn(b, h, keys, dim).to(dtype)
    v, go = torch.randn(b, h, keys, v_dim).to(dtype), torch.randn(b, h, length, v_dim).to(dtype)
    m = {None: None, "bool": torch.rand(length, keys) > 0.2, "bool_per_head": torch.rand(b, h, length, keys) > 0.2,
         "float": torch.randn(b, 1, 1, keys).to(dtype)}[mask]
    keep = dropout_mask(q, k, 0.1)
    for op, args in ((torch.ops.fxmem.attention.default, (q, k, v, m, keep, 0.1)),
                     (torch.ops.fxmem.attention_backward.default, (go, q, k, v, m, keep, 0.1))):
        got, out = measured(op, *args)
        assert abs(int(op_scratch(op, args, {}, out)) - got) <= 64, op


@pytest.mark.parametrize("b, h, q, k, d, causal", [
    (12, 4, 8, 8, 8, False),     # PatchTST's patches
    (4, 2, 64, 64, 16, False),
    (1, 1, 300, 300, 8, False),  # 64-row query blocks from 192 rows; one head: no copy of grad_out
    (4, 4, 32, 16, 8, True),
    (2, 3, 200, 200, 8, False),
])
def test_cpu_flash_attention_blocks_match_the_allocator(b, h, q, k, d, causal):
    """ATen's CPU flash attention: a score block per thread (forward: and its rows and an output
    block; backward: and its gradient and a row sum), and the backward's copy of a ``grad_out``
    whose [batch, seq, heads, dim] transpose is not contiguous."""
    torch.set_num_threads(1)  # the blocks are per thread
    qkv = [torch.randn(b, h, n, d) for n in (q, k, k)]
    forward = aten._scaled_dot_product_flash_attention_for_cpu.default
    got, (out, lse) = measured(lambda *a: forward(*a, 0.0, causal), *qkv)
    assert got == int(op_scratch(forward, (*qkv, 0.0, causal), {}, None)), got
    backward = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    args = (torch.randn_like(out), *qkv, out, lse, 0.0, causal)
    got, _ = measured(backward, *args)
    assert got == int(op_scratch(backward, args, {}, None)), got


def test_views_of_a_cpu_batch_norm_after_a_transpose_are_copies():
    """The traced batch norm keeps its transposed input's strides; the CPU kernel returns a
    contiguous tensor, so the view back after the transpose copies (``graph.layouts``); a view
    of a tensor whose layout agrees stays a view."""
    from fxmem.graph.layouts import mark_copies
    from fxmem.graph.liveness import is_alias

    def f(x, w):
        y = aten._native_batch_norm_legit_functional.default(x.transpose(1, 2), w, w, torch.zeros(8),
                                                             torch.ones(8), True, 0.1, 1e-5)[0]
        return y.transpose(1, 2).view(-1, 8) @ w[:, None], x.view(-1, 8)

    gm = make_fx(f, tracing_mode="fake")(torch.randn(4, 6, 8), torch.randn(8))
    views = [n for n in gm.graph.nodes if n.target is aten.view.default]
    assert mark_copies(gm) == 1
    assert [is_alias(n) for n in views] == [False, True]


@pytest.mark.parametrize("contiguous", [True, False])
def test_cpu_embedding_backward_copies_a_non_contiguous_gradient(contiguous):
    """``embedding_dense_backward`` on CPU makes its gradient contiguous first (an ``nn.GRU``
    LM's gradient arrives transposed back from time-major: its level 1 was predicted 3.3% low)."""
    ids = torch.randint(0, 64, (4, 16))
    grad = torch.randn(4, 16, 32) if contiguous else torch.randn(16, 4, 32).transpose(0, 1)
    op = aten.embedding_dense_backward.default
    args = (grad, ids, 64, -1, False)
    got, out = measured(op, *args)
    assert got == int(op_scratch(op, args, {}, out)) == (0 if contiguous else grad.numel() * 4)
