"""Every Triton kernel, as the CPU tests launch it through the interpreter, also compiles for a
CUDA GPU (sm_90): the interpreter runs kernels as Python and accepts constructs the compiler
rejects. The launches are recorded from real calls, so signatures and constexprs are the real
ones."""
import pytest
import torch

triton = pytest.importorskip("triton")

import fxmem_kernels  # noqa: E402
from fxmem_kernels import _common  # noqa: E402

_DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16",
           torch.float64: "fp64", torch.int64: "i64", torch.int32: "i32", torch.bool: "i1",
           torch.uint8: "u8", torch.int8: "i8"}


def _calls():
    def leaf(*shape):
        return torch.randn(*shape, requires_grad=True)

    x, g, w, b = leaf(4, 40), leaf(4, 40), leaf(40), leaf(40)
    h, W = leaf(6, 16), leaf(50, 16)
    t = torch.randint(0, 50, (6,))
    yield lambda: fxmem_kernels.bias_gelu(x, b, "tanh", impl="triton")
    yield lambda: fxmem_kernels.layer_norm(x, w, b, impl="triton")
    yield lambda: fxmem_kernels.rms_norm(x, w, impl="triton")
    yield lambda: fxmem_kernels.swiglu(x, g, impl="triton")
    yield lambda: fxmem_kernels.geglu(x, g, "tanh", impl="triton")
    yield lambda: fxmem_kernels.seeded_dropout(x, 0.1, seed=3, impl="triton")
    yield lambda: fxmem_kernels.linear_cross_entropy(h, W, t, impl="triton")
    yield lambda: fxmem_kernels.linear_cross_entropy(h, W, t, reduction="none", impl="triton")
    yield lambda: fxmem_kernels.clipped_sum([g.detach(), x.detach()[:, :7]], 1.0, impl="triton")


def _record(monkeypatch):
    launches = []
    real = _common._interpreted

    class Recorder:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append((self.kernel, args, kwargs))
                return real(self.kernel)[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(_common, "_interpreted", Recorder)
    for call in _calls():
        x = call()
        out = x if isinstance(x, torch.Tensor) else None
        if out is not None and out.requires_grad:
            out.float().sum().backward()
    return launches


def _signature(kernel, args, kwargs):
    names = kernel.arg_names
    sig, consts = {}, {}
    values = dict(zip(names, args), **kwargs)
    for i, name in enumerate(names):
        if kernel.params[i].is_constexpr:
            sig[name], consts[name] = "constexpr", values[name]
            continue
        v = values[name]
        if isinstance(v, torch.Tensor):
            sig[name] = "*" + _DTYPES[v.dtype]
        elif isinstance(v, bool):
            sig[name] = "i1"
        elif isinstance(v, int):
            sig[name] = "i64" if abs(v) >= 2**31 else "i32"
        elif isinstance(v, float):
            sig[name] = "fp32"
        else:
            raise TypeError(f"{kernel.fn.__name__}: cannot type argument {name}={v!r}")
    return sig, consts


@pytest.mark.slow
def test_every_interpreted_kernel_compiles_for_cuda(monkeypatch):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    torch.manual_seed(0)
    launches = _record(monkeypatch)
    seen = {}
    for kernel, args, kwargs in launches:
        sig, consts = _signature(kernel, args, kwargs)
        seen.setdefault((kernel.fn.__qualname__, repr(sorted(sig.items())), repr(sorted(consts.items()))),
                        (kernel, sig, consts))
    assert len({k[0] for k in seen}) >= 10, sorted({k[0] for k in seen})
    for kernel, sig, consts in seen.values():
        try:
            compiled = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=consts),
                                      target=GPUTarget("cuda", 90, 32))
        except (FileNotFoundError, PermissionError) as e:  # no ptxas in this triton install
            pytest.skip(f"cannot compile for CUDA here: {e}")
        assert compiled.asm.get("cubin"), kernel.fn.__qualname__
