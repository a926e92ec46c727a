"""Shared checks for the kernel tests: compare a fused function with its plain PyTorch
expression (values and gradients), eagerly and under vmap(grad)."""
import functools

import pytest
import torch

# Tolerances by dtype: fp32 fused math differs from PyTorch's only by summation order.
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
       torch.float16: dict(rtol=5e-3, atol=5e-3)}


def grads(fn, inputs, weight=None):
    """Output of ``fn(*inputs)`` and the gradients of ``sum(out * weight)`` w.r.t. the inputs
    that require grad (a random ``weight`` so every output element matters)."""
    inputs = [t.detach().clone().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor)
              else t for t in inputs]
    out = fn(*inputs)
    if weight is None:
        weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(0)).to(out)
    diff = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    return out, torch.autograd.grad((out.float() * weight.float()).sum(), diff)


def assert_same(fused, reference, inputs, dtype=torch.float32):
    """``fused`` and ``reference`` agree on outputs and gradients for ``inputs``."""
    out, g = grads(fused, inputs)
    ref_out, ref_g = grads(reference, inputs)
    torch.testing.assert_close(out, ref_out, **TOL[dtype])
    assert len(g) == len(ref_g)
    for a, b in zip(g, ref_g):
        torch.testing.assert_close(a, b, **TOL[dtype])


def cuda_test(fn):
    """A test that needs a CUDA GPU: skipped without one; ``pytest -m cuda`` selects them. The
    Triton kernels run on CUDA by default only once these pass on a GPU (fxmem_kernels/_common.py:
    until then ``impl="auto"`` is the portable implementation, ``FXMEM_KERNELS_TRITON=1`` opts in)."""
    return pytest.mark.cuda(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")(fn))


def assert_triton_matches_portable(fused, reference, inputs, dtype=torch.float32):
    """``fused(*inputs, impl=...)`` with ``impl="triton"`` and ``impl="torch"`` each agree with
    ``reference`` and with each other, on outputs and gradients."""
    triton, portable = functools.partial(fused, impl="triton"), functools.partial(fused, impl="torch")
    assert_same(triton, reference, inputs, dtype)
    assert_same(portable, reference, inputs, dtype)
    assert_same(triton, portable, inputs, dtype)
