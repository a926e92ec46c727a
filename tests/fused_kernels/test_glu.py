import pytest
import torch
import torch.nn.functional as F

from fxmem.profiling import saved_tensor_bytes
from fxmem_kernels.glu import geglu, glu_backward_op, glu_op, swiglu

from .util import assert_same, assert_triton_matches_portable, cuda_test

SHAPES = [(7,), (3, 5), (2, 3, 17)]
KINDS = ["swiglu", "geglu", "geglu_tanh"]


def _fused(kind, impl="auto"):
    if kind == "swiglu":
        return lambda g, u: swiglu(g, u, impl)
    return lambda g, u: geglu(g, u, "tanh" if kind == "geglu_tanh" else "none", impl)


def _ref(kind):
    if kind == "swiglu":
        return lambda g, u: F.silu(g) * u
    return lambda g, u: F.gelu(g, approximate="tanh" if kind == "geglu_tanh" else "none") * u


def _inputs(shape, dtype=torch.float32, device="cpu"):
    gen = torch.Generator().manual_seed(1)
    gate = (3 * torch.randn(shape, generator=gen)).to(device, dtype).requires_grad_()
    return gate, torch.randn(shape, generator=gen).to(device, dtype).requires_grad_()


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_plain_pytorch_fp32(impl, kind, shape):
    assert_same(_fused(kind, impl), _ref(kind), _inputs(shape))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", KINDS)
def test_low_precision_matches(dtype, kind):
    assert_same(_fused(kind, "torch"), _ref(kind), _inputs((4, 33), dtype), dtype=dtype)


def test_portable_path_is_bit_identical_to_unfused():
    # The portable path runs the unfused expression's own aten ops, each into its output.
    gate, up = _inputs((5, 64))
    for kind in KINDS:
        y, w = _fused(kind, "torch")(gate, up), torch.randn(5, 64)
        r = _ref(kind)(gate, up)
        assert torch.equal(y, r)
        for a, b in zip(torch.autograd.grad((y * w).sum(), (gate, up)),
                        torch.autograd.grad((r * w).sum(), (gate, up))):
            assert torch.equal(a, b)


def test_only_one_input_needs_grad():
    gate, up = _inputs((3, 8))
    (g,) = torch.autograd.grad(swiglu(gate, up.detach()).sum(), gate)
    (r,) = torch.autograd.grad((F.silu(gate) * up.detach()).sum(), gate)
    torch.testing.assert_close(g, r)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_vmap_and_vmap_grad_per_example(impl):
    gate, up = (t.detach() for t in _inputs((4, 3, 8)))
    for kind in ("swiglu", "geglu_tanh"):
        fused, ref = _fused(kind, impl), _ref(kind)
        torch.testing.assert_close(torch.func.vmap(fused)(gate, up), ref(gate, up))
        # Shared `up` (a weight-like input), per-example gradients w.r.t. it and the gate.
        loss = lambda fn: (lambda u, g: fn(g, u).pow(2).sum())
        got = torch.func.vmap(torch.func.grad(loss(fused), argnums=(0, 1)), (None, 0))(up[0], gate)
        want = torch.func.vmap(torch.func.grad(loss(ref), argnums=(0, 1)), (None, 0))(up[0], gate)
        assert got[0].shape == (4, 3, 8)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # Batch dim not in front.
    got = torch.func.vmap(swiglu, in_dims=(1, 1))(gate, up)
    torch.testing.assert_close(got, (F.silu(gate) * up).movedim(1, 0))


@pytest.mark.parametrize("kind", KINDS)
def test_keeps_no_more_than_unfused(kind):
    gate, up = _inputs((64, 256))
    fused = saved_tensor_bytes(_fused(kind), gate, up)
    plain = saved_tensor_bytes(_ref(kind), gate, up)
    assert fused == 0 < plain == 64 * 256 * 4  # fused keeps only its (given) inputs


def test_double_backward_raises():
    gate, up = _inputs((3, 4))
    with pytest.raises(RuntimeError, match="double backward is not supported"):
        torch.autograd.grad(swiglu(gate, up).sum(), gate, create_graph=True)
    f = lambda g: geglu(g, up.detach()).pow(2).sum()
    with pytest.raises(RuntimeError, match="double backward is not supported"):
        torch.func.grad(lambda g: torch.func.grad(f)(g).sum())(gate.detach())


def test_bad_arguments_name_what_is_allowed():
    g = torch.randn(2, 3)
    with pytest.raises(ValueError,
                       match=r"gate and up must have the same shape .*\[2, 3\] and \[3\]"):
        swiglu(g, torch.randn(3))
    with pytest.raises(ValueError, match="gate and up must have the same dtype"):
        swiglu(g, torch.randn(2, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match="approximate must be one of"):
        geglu(g, g, "fast")
    with pytest.raises(ValueError, match="impl must be one of"):
        swiglu(g, g, "cuda")
    with pytest.raises(ValueError, match="activation must be one of"):
        glu_op(g, g, "relu")


def test_opcheck():
    g, u = torch.randn(3, 8), torch.randn(3, 8)
    for act in ("silu", "gelu", "gelu_tanh"):
        torch.library.opcheck(glu_op, (g, u, act, "torch"))
        torch.library.opcheck(glu_backward_op, (torch.randn(3, 8), g, u, act, "torch"))
    torch.library.opcheck(glu_op, (g, u, "silu", "triton"), test_utils=("test_schema",
                                                                         "test_faketensor"))


def test_empty_input():
    g = torch.randn(0, 4, requires_grad=True)
    for impl in ("torch", "triton"):
        y = swiglu(g, g, impl)
        assert y.shape == (0, 4)
        assert torch.autograd.grad(y.sum(), g)[0].shape == (0, 4)


def test_compiles_into_a_graph():
    compiled = torch.compile(lambda g, u: swiglu(g, u), backend="aot_eager", fullgraph=True)
    assert_same(compiled, _ref("swiglu"), _inputs((3, 8)))
    compiled = torch.compile(lambda g, u: geglu(g, u, "tanh"), backend="aot_eager",
                             fullgraph=True)
    assert_same(compiled, _ref("geglu_tanh"), _inputs((3, 8)))


@cuda_test
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", KINDS)
def test_cuda_triton_matches(dtype, kind):
    assert_triton_matches_portable(lambda g, u, impl: _fused(kind, impl)(g, u), _ref(kind),
                                   _inputs((64, 1000), dtype, "cuda"), dtype=dtype)
