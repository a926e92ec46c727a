import pytest
import torch
import torch.nn.functional as F

from fxmem.profiling import saved_tensor_bytes
from fxmem_kernels.bias_gelu import bias_gelu, bias_gelu_backward_op, bias_gelu_op

from .util import assert_same, assert_triton_matches_portable, cuda_test

SHAPES = [(7,), (3, 5), (2, 3, 17)]


def _ref(x, b, approximate):
    return F.gelu(x + b if b is not None else x, approximate=approximate)


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("with_bias", [True, False])
def test_matches_plain_pytorch_fp32(impl, approximate, shape, with_bias):
    x = torch.randn(shape, requires_grad=True)
    b = torch.randn(shape[-1], requires_grad=True) if with_bias else None
    assert_same(lambda x, b: bias_gelu(x, b, approximate, impl),
                lambda x, b: _ref(x, b, approximate), [x, b])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_matches(dtype):
    x = torch.randn(4, 33, dtype=dtype, requires_grad=True)
    b = torch.randn(33, dtype=dtype, requires_grad=True)
    assert_same(lambda x, b: bias_gelu(x, b, "tanh", "torch"),
                lambda x, b: _ref(x, b, "tanh"), [x, b], dtype=dtype)


def test_vmap_grad_gives_per_example_gradients():
    x, b = torch.randn(4, 6, 8), torch.randn(8)
    loss = lambda fn: (lambda b, x: fn(x, b).pow(2).sum())
    got = torch.func.vmap(torch.func.grad(loss(bias_gelu)), (None, 0))(b, x)
    want = torch.func.vmap(torch.func.grad(loss(lambda x, b: _ref(x, b, "none"))), (None, 0))(b, x)
    assert got.shape == (4, 8)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # Batched bias too (the vmap rule's per-example path).
    got = torch.func.vmap(lambda x, b: bias_gelu(x, b))(x, torch.randn(4, 8))
    assert got.shape == x.shape


def test_keeps_no_more_than_unfused():
    x = torch.randn(64, 256, requires_grad=True)
    b = torch.randn(256, requires_grad=True)
    fused = saved_tensor_bytes(lambda x, b: bias_gelu(x, b), x, b)
    plain = saved_tensor_bytes(lambda x, b: _ref(x, b, "none"), x, b)
    assert fused == 0 < plain == 64 * 256 * 4  # fused keeps only its (given) inputs


def test_double_backward_raises():
    x = torch.randn(3, 4, requires_grad=True)
    b = torch.randn(4, requires_grad=True)
    with pytest.raises(RuntimeError, match="double backward is not supported"):
        torch.autograd.grad(bias_gelu(x, b).sum(), x, create_graph=True)
    f = lambda b: bias_gelu(x.detach(), b).pow(2).sum()
    with pytest.raises(RuntimeError, match="double backward is not supported"):
        torch.func.grad(lambda b: torch.func.grad(f)(b).sum())(b.detach())


def test_bad_arguments_name_what_is_allowed():
    with pytest.raises(ValueError, match="approximate must be one of"):
        bias_gelu(torch.randn(2, 3), None, "fast")
    with pytest.raises(ValueError, match=r"bias must have shape \[3\]"):
        bias_gelu(torch.randn(2, 3), torch.randn(4))
    with pytest.raises(ValueError, match="impl must be one of"):
        bias_gelu(torch.randn(2, 3), None, "none", "cuda")


def test_opcheck():
    x, b = torch.randn(3, 8), torch.randn(8)
    torch.library.opcheck(bias_gelu_op, (x, b, "tanh", "torch"))
    torch.library.opcheck(bias_gelu_backward_op, (torch.randn(3, 8), x, b, "none", "torch"))


def test_compiles_into_a_graph():
    x = torch.randn(3, 8, requires_grad=True)
    b = torch.randn(8, requires_grad=True)
    compiled = torch.compile(lambda x, b: bias_gelu(x, b), backend="aot_eager", fullgraph=True)
    assert_same(compiled, lambda x, b: _ref(x, b, "none"), [x, b])


@cuda_test
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_cuda_triton_matches(dtype, approximate):
    x = torch.randn(64, 1000, device="cuda", dtype=dtype, requires_grad=True)
    b = torch.randn(1000, device="cuda", dtype=dtype, requires_grad=True)
    assert_triton_matches_portable(lambda x, b, impl: bias_gelu(x, b, approximate, impl=impl),
                                   lambda x, b: _ref(x, b, approximate), [x, b], dtype=dtype)
