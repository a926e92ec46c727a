import math

import pytest
import torch

import fxmem_kernels.clip_accumulate as ca
from fxmem.profiling import step_perf
from fxmem_kernels.clip_accumulate import (
    clip_accumulate_op,
    clip_and_accumulate,
    clipped_sum,
    per_example_norms,
    per_example_norms_op,
)

from .util import cuda_test

# Parameter shapes (without the example dim): a matrix, a bias, a scalar, a 3-D tensor.
SHAPES = [[(3, 4), (7,), (), (2, 3, 5)], [(16,)], [(5, 6), (6,)]]
IMPLS = ["torch", "triton"]
F32 = dict(rtol=1e-5, atol=1e-6)


def _grads(m, shapes, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(m, *s, generator=g) * scale).to(dtype) for s in shapes]


def _noncontiguous(m, seed=0):
    """Grads whose [m, n] view is strided (sliced), does not exist (transposed), or has a zero
    example stride (expanded)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(m, 4, 3, generator=g).transpose(1, 2),     # no flat view
            torch.randn(m, 10, generator=g)[:, ::2],               # flat view, column stride 2
            torch.randn(2 * m, 6, generator=g)[::2],               # flat view, row stride 12
            torch.randn(1, 5, generator=g).expand(m, 5),           # example stride 0
            torch.randn(3, m, generator=g).t()]                    # column-major [m, 3]


def _reference(grads, clipping_norm, eps=1e-6):
    """The plain expression, in float64: norms of the concatenated flattened per-example
    grads, the factor, and ``(g * factor).sum(0)``."""
    m = grads[0].shape[0]
    flat = torch.cat([g.reshape(m, -1).double() for g in grads], dim=1)
    norms = torch.linalg.vector_norm(flat, dim=1)
    c = math.inf if clipping_norm is None else clipping_norm
    factor = (c / (norms + eps)).clamp(max=1.0)
    sums = [(g.double() * factor.view(-1, *[1] * (g.dim() - 1))).sum(0) for g in grads]
    return sums, norms


def _loop_reference(grads, clipping_norm, eps=1e-6):
    """An explicit per-example loop: clip each example's gradients, then add them up."""
    sums = [torch.zeros(g.shape[1:], dtype=torch.float64) for g in grads]
    norms = []
    for i in range(grads[0].shape[0]):
        example = [g[i].double() for g in grads]
        norm = math.sqrt(sum(float((e * e).sum()) for e in example))
        factor = 1.0 if clipping_norm is None else min(1.0, clipping_norm / (norm + eps))
        for s, e in zip(sums, example):
            s += factor * e
        norms.append(norm)
    return sums, torch.tensor(norms, dtype=torch.float64)


def _assert_close(got_sums, got_norms, want_sums, want_norms, **tol):
    tol = tol or F32
    assert got_norms.dtype == torch.float32
    torch.testing.assert_close(got_norms.double(), want_norms.double(), **tol)
    assert len(got_sums) == len(want_sums)
    for a, b in zip(got_sums, want_sums):
        assert a.shape == b.shape
        torch.testing.assert_close(a.double(), b.double(), **tol)


def _peak_bytes(fn):
    """Exact peak of the allocations made while ``fn`` runs (CPU allocator events)."""
    with step_perf("cpu") as perf:
        out = fn()
    del out
    return perf.result.peak_bytes


def _median_norm(grads):
    return float(_reference(grads, None)[1].median())


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("shapes", SHAPES)
@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("clip", ["some", "none", "all", "inf"])
def test_matches_plain_expression_fp32(impl, shapes, m, clip):
    grads = _grads(m, shapes, seed=m)
    c = {"some": _median_norm(grads), "none": None, "all": 1e-3, "inf": math.inf}[clip]
    sums, norms = clipped_sum(grads, c, impl=impl)
    _assert_close(sums, norms, *_reference(grads, c))
    _assert_close(sums, norms, *_loop_reference(grads, None if c == math.inf else c))
    factor = (c / (norms + 1e-6)).clamp(max=1) if c is not None else torch.ones(m)
    if clip == "some" and m > 2:  # the grid really has clipped and unclipped examples
        assert (factor < 1).any() and (factor == 1).any()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("acc_dtype", [torch.float32, torch.float64])
def test_low_and_high_precision_grads(impl, dtype, acc_dtype):
    # Low-precision inputs are exact in float64, and the kernels sum in float32 or better:
    # the float32 tolerance applies.
    grads = _grads(6, SHAPES[0], dtype=dtype, seed=1)
    c = _median_norm(grads)
    sums, norms = clipped_sum(grads, c, impl=impl, dtype=acc_dtype)
    assert all(s.dtype == acc_dtype for s in sums)
    _assert_close(sums, norms, *_reference(grads, c))
    _assert_close(sums, norms, *_loop_reference(grads, c))


@pytest.mark.parametrize("impl", IMPLS)
def test_noncontiguous_grads_and_accumulators(impl):
    grads = _noncontiguous(5)
    c = _median_norm(grads)
    want_sums, want_norms = _reference(grads, c)
    sums, norms = clipped_sum(grads, c, impl=impl)
    _assert_close(sums, norms, want_sums, want_norms)
    # Non-contiguous accumulators (transposed, strided) of both dtypes.
    accs = [torch.zeros(4, 3).t(), torch.zeros(5, 2, dtype=torch.float64)[:, 0],
            torch.zeros(6), torch.zeros(5, 3)[:, 1], torch.zeros(3)]
    norms = clip_and_accumulate(grads, accs, c, impl=impl)
    _assert_close(accs, norms, want_sums, want_norms)
    # Low precision and non-contiguous together (the converted-block paths).
    grads = [g.to(torch.bfloat16) for g in grads]
    _assert_close(*clipped_sum(grads, c, impl=impl), *_reference(grads, c))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocked_conversion_paths(monkeypatch, dtype):
    # Tiny blocks force the column-block (flat view) and example-block (no flat view) loops.
    monkeypatch.setattr(ca, "_CHUNK", 7)
    grads = [g.to(dtype) for g in _noncontiguous(5)] + _grads(5, [(3, 9)], dtype=dtype)
    c = _median_norm(grads)
    for acc_dtype in (torch.float32, torch.float64):
        _assert_close(*clipped_sum(grads, c, impl="torch", dtype=acc_dtype),
                      *_reference(grads, c))


@pytest.mark.parametrize("impl", IMPLS)
def test_accumulates_over_calls(impl):
    a, b = _grads(4, SHAPES[0], seed=2), _grads(3, SHAPES[0], seed=3)
    accs = [torch.full(s, 0.5) for s in SHAPES[0]]
    na = clip_and_accumulate(a, accs, 1.0, impl=impl)
    nb = clip_and_accumulate(b, accs, 1.0, impl=impl)
    (sa, ra), (sb, rb) = _reference(a, 1.0), _reference(b, 1.0)
    _assert_close(accs, torch.cat([na, nb]), [x + y + 0.5 for x, y in zip(sa, sb)],
                  torch.cat([ra, rb]))


def test_no_clipping_is_the_plain_sum_and_returns_norms():
    grads = _grads(5, SHAPES[0], seed=4, scale=10.0)
    for c in (None, math.inf, float("inf")):
        sums, norms = clipped_sum(grads, c)
        _assert_close(sums, norms, [g.double().sum(0) for g in grads], _reference(grads, c)[1])
    torch.testing.assert_close(per_example_norms(grads), norms)


def test_eps_convention_is_opacus():
    # One example, one parameter, norm 5: factor = C / (5 + eps).
    g = [torch.tensor([[3.0, 4.0]])]
    for eps in (1e-6, 0.0, 0.5):
        sums, norms = clipped_sum(g, 1.0, eps=eps)
        assert norms.item() == 5.0
        torch.testing.assert_close(sums[0], torch.tensor([3.0, 4.0]) / (5.0 + eps))
    sums, _ = clipped_sum([torch.zeros(2, 3)], 1.0, eps=0.0)  # 1 / 0 = inf -> factor 1
    assert torch.equal(sums[0], torch.zeros(3))


@pytest.mark.parametrize("impl", IMPLS)
def test_sensitivity_is_at_most_the_clipping_norm(impl):
    # Replacing one example changes the clipped sum by at most 2C, adding or removing one by
    # at most C (the L2 sensitivity of DP-SGD's sum, add/remove neighbours).
    c = 0.7
    base = _grads(6, SHAPES[0], seed=5, scale=3.0)
    s0, _ = clipped_sum(base, c, impl=impl)
    for seed in range(3):
        other = _grads(1, SHAPES[0], seed=10 + seed, scale=10.0 ** seed)
        added = [torch.cat([g, o]) for g, o in zip(base, other)]
        removed = [g[1:] for g in base]
        replaced = [torch.cat([o, g[1:]]) for g, o in zip(base, other)]
        for neighbour, bound in ((added, c), (removed, c), (replaced, 2 * c)):
            s1, _ = clipped_sum(neighbour, c, impl=impl)
            diff = math.sqrt(sum(float((a.double() - b.double()).square().sum())
                                 for a, b in zip(s0, s1)))
            assert diff <= bound * (1 + 1e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_empty_batch_and_empty_parameters(impl):
    grads = [torch.randn(0, 3), torch.randn(0)]
    accs = [torch.ones(3), torch.ones(())]
    norms = clip_and_accumulate(grads, accs, 1.0, impl=impl)
    assert norms.shape == (0,) and all(torch.equal(a, torch.ones_like(a)) for a in accs)
    grads = [torch.randn(4, 0, 2), torch.randn(4, 3)]
    _assert_close(*clipped_sum(grads, 1.0, impl=impl), *_reference(grads, 1.0))


@pytest.mark.parametrize("impl,n", [("torch", 1 << 20), ("triton", 1 << 14)])
def test_norms_of_long_rows_are_accurate(impl, n):
    # One float32 reduction over a row of a million elements is off by ~1e-5 (2e-4 at a large
    # stride); the norms are summed in short runs and combined in float64.
    g = torch.randn(2, n, generator=torch.Generator().manual_seed(8))
    for x in (g, g.t().contiguous().t(), g.view(2, 64, -1).transpose(1, 2),
              g.to(torch.bfloat16)):
        want = x.double().flatten(1).norm(dim=1)
        got = per_example_norms([x], impl=impl).double()
        assert ((got - want) / want).abs().max() < 5e-7


def test_pytorch_path_makes_no_full_size_copy():
    m, n = 16, 1 << 18
    g32 = torch.randn(m, n)
    g16 = g32.to(torch.bfloat16)
    acc = torch.zeros(n)
    # float32: nothing beyond [m] vectors and [m, n / 1024] partial norms; bfloat16: one
    # converted block at a time.
    small = m * n * 4 // 100
    assert _peak_bytes(lambda: clip_and_accumulate([g32], [acc], 1.0, impl="torch")) < small
    column_major = g32.t().contiguous().t()
    assert _peak_bytes(lambda: clip_and_accumulate([column_major], [acc], 1.0,
                                                   impl="torch")) < small
    low = _peak_bytes(lambda: clip_and_accumulate([g16], [acc], 1.0, impl="torch"))
    assert low <= ca._CHUNK * 4 + small < m * n * 4
    factor = torch.rand(m)
    unfused = _peak_bytes(lambda: (g32 * factor.view(-1, 1)).sum(0))
    assert unfused >= m * n * 4  # the clipped copy


def test_requires_grad_raises_unless_no_grad():
    grads = [torch.randn(3, 4, requires_grad=True)]
    with pytest.raises(RuntimeError, match=r"not differentiable, but grads\[0\] requires grad"):
        clipped_sum(grads, 1.0)
    with pytest.raises(RuntimeError, match=r"accumulators\[0\] requires grad"):
        clip_and_accumulate([torch.randn(3, 4)], [torch.zeros(4, requires_grad=True)], 1.0)
    with torch.no_grad():
        sums, norms = clipped_sum(grads, 1.0)
    assert not sums[0].requires_grad and not norms.requires_grad
    _assert_close(sums, norms, *_reference([grads[0].detach()], 1.0))


def test_bad_arguments_name_what_is_wrong():
    g = [torch.randn(3, 4), torch.randn(3, 2, 2)]
    acc = [torch.zeros(4), torch.zeros(2, 2)]
    cases = [
        (([], [], 1.0), r"grads is empty"),
        ((torch.randn(3, 4), acc, 1.0), r"grads must be a list"),
        (([g[0], torch.randn(2, 2, 2)], acc, 1.0),
         r"grads\[1\] has 2 examples .* grads\[0\] has 3"),
        (([torch.randn(())], [torch.zeros(())], 1.0), r"grads\[0\] is a scalar"),
        (([torch.ones(3, 4, dtype=torch.int64)], acc[:1], 1.0),
         r"grads\[0\] has dtype torch.int64"),
        ((g, acc[:1], 1.0), r"1 accumulators for 2 grads"),
        ((g, [acc[0], torch.zeros(4)], 1.0),
         r"accumulators\[1\] has shape \[4\], expected \[2, 2\]"),
        ((g, [acc[0], torch.zeros(2, 2, dtype=torch.bfloat16)], 1.0),
         r"accumulators\[1\] has dtype torch.bfloat16"),
        ((g, acc, 0.0), r"clipping_norm must be > 0"),
        ((g, acc, -1.0), r"clipping_norm must be > 0"),
        ((g, acc, float("nan")), r"clipping_norm must be > 0"),
    ]
    for args, match in cases:
        with pytest.raises(ValueError, match=match):
            clip_and_accumulate(*args)
    with pytest.raises(ValueError, match=r"eps must be finite and >= 0"):
        clip_and_accumulate(g, acc, 1.0, eps=-1e-6)
    with pytest.raises(ValueError, match=r"impl must be one of"):
        clip_and_accumulate(g, acc, 1.0, impl="cuda")
    with pytest.raises(ValueError, match=r"grads is empty"):
        clipped_sum([], 1.0)
    with pytest.raises(ValueError, match=r"norms must be a float32 tensor of shape \[3\]"):
        clip_accumulate_op(g, acc, torch.ones(2), 1.0, 1e-6)
    assert all(torch.equal(a, torch.zeros_like(a)) for a in acc)  # nothing was touched


def test_opcheck():
    grads = _noncontiguous(4) + _grads(4, [(3, 2)], dtype=torch.bfloat16)
    accs = [torch.zeros(g.shape[1:], dtype=torch.float64 if i == 1 else torch.float32)
            for i, g in enumerate(grads)]
    norms = per_example_norms_op(grads, "torch")
    torch.library.opcheck(per_example_norms_op, (grads, "torch"))
    torch.library.opcheck(clip_accumulate_op, (grads, accs, norms, 1.0, 1e-6, "torch"))
    torch.library.opcheck(clip_accumulate_op, (grads, accs, norms, math.inf, 0.0, "torch"))


def test_compiles_into_a_graph():
    grads = _grads(4, SHAPES[0], seed=6)
    c = _median_norm(grads)

    def step(grads, accs):
        return clip_and_accumulate(grads, accs, c)

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return torch._dynamo.backends.debugging.aot_eager(gm, example_inputs)

    compiled = torch.compile(step, backend=backend, fullgraph=True)
    accs = [torch.ones(s) for s in SHAPES[0]]
    norms = compiled(grads, accs)
    want_sums, want_norms = _reference(grads, c)
    _assert_close(accs, norms, [s + 1 for s in want_sums], want_norms)
    code = graphs[0].code
    assert "fxmem.per_example_norms" in code and "fxmem.clip_accumulate_" in code
    # Again, through a compiled convenience function.
    got = torch.compile(lambda g: clipped_sum(g, None), backend="aot_eager", fullgraph=True)(grads)
    _assert_close(*got, *_reference(grads, None))


def test_matches_opake():
    opake_clipping = pytest.importorskip("opake.dpsgd.clipping")
    gen = torch.Generator().manual_seed(7)
    w, b = torch.randn(3, 4, generator=gen), torch.randn(3, generator=gen)
    x, y = torch.randn(6, 4, generator=gen), torch.randn(6, 3, generator=gen)

    def loss(params, x, y):
        w, b = params
        return ((x @ w.T + b - y) ** 2).sum()

    per_example = torch.func.vmap(torch.func.grad(loss), (None, 0, 0))((w, b), x, y)
    c = _median_norm(list(per_example))
    fn, state = opake_clipping.clipped_grad(loss, clipping_norm=c, batch_argnums=(1, 2),
                                            return_aux=True)
    (want, aux), _ = fn((w, b), x, y, state=state)
    sums, norms = clipped_sum(list(per_example), c, eps=0.0)  # opake: min(1, C / norm)
    _assert_close(sums, norms, list(want.pytree), aux.grad_norms)


@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")
def test_triton_kernels_compile_for_cuda():
    # The interpreter runs the kernels' Python; this compiles them for an sm_90 GPU (no GPU
    # needed) so a construct that only the interpreter accepts fails here.
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", 90, 32)
    specs = [(ca._sq_norm_kernel, dict(g_ptr="*bf16", part_ptr="*fp32", k="i32", n="i32",
                                       stride_m="i64", stride_n="i32", span="i32"),
              dict(BLOCK_M=16, BLOCK_N=ca._NORM_BLOCK_N)),
             (ca._accumulate_kernel, dict(g_ptr="*fp16", f_ptr="*fp64", acc_ptr="*fp64",
                                          k="i32", n="i32", stride_m="i64", stride_n="i32"),
              dict(BLOCK=ca._ACC_BLOCK))]
    for kernel, sig, consts in specs:
        sig.update({k: "constexpr" for k in consts})
        try:
            compiled = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=consts),
                                      target=target)
        except (FileNotFoundError, PermissionError) as e:  # no ptxas in this triton install
            pytest.skip(f"cannot compile for CUDA here: {e}")
        assert compiled.asm.get("cubin")


@cuda_test
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_triton_matches(dtype):
    m = 32
    grads = [g.cuda() for g in _grads(m, [(300, 257), (257,), (4, 8, 33)], dtype=dtype)]
    grads.append(torch.randn(m, 64, 48, device="cuda", dtype=dtype).transpose(1, 2))
    c = _median_norm([g.cpu() for g in grads])
    want_sums, want_norms = _reference([g.cpu() for g in grads], c)
    got = {}
    for impl in ("triton", "torch"):
        sums, norms = clipped_sum(grads, c, impl=impl)
        got[impl] = [s.cpu() for s in sums], norms.cpu()
        _assert_close(*got[impl], want_sums, want_norms, rtol=1e-4, atol=1e-5)
    _assert_close(*got["triton"], *got["torch"], rtol=1e-4, atol=1e-5)
    for impl in ("triton", "torch"):
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        accs = [torch.zeros(g.shape[1:], device="cuda") for g in grads]
        clip_and_accumulate(grads, accs, c, impl=impl)
        extra = torch.cuda.max_memory_allocated() - base - sum(a.numel() * 4 for a in accs)
        assert extra < max(g.numel() * g.element_size() for g in grads), impl  # no clipped copy
