import torch
import torch.nn.functional as F

from fxmem_kernels.glu import geglu, swiglu

from . import Case


def cases(quick: bool):
    n, h = (1024, 512) if quick else (8192, 4096)

    def make():
        g = torch.Generator().manual_seed(0)
        return (torch.randn(n, h, generator=g, requires_grad=True),
                torch.randn(n, h, generator=g, requires_grad=True))

    out = [Case("glu", f"SwiGLU N={n} H={h} fp32", make, {
        "unfused": lambda gate, up: (F.silu(gate) * up).sum(),
        "fxmem": lambda gate, up: swiglu(gate, up).sum(),
    })]
    out += [Case("glu", f"GeGLU-{a} N={n} H={h} fp32", make, {
        "unfused": lambda gate, up, a=a: (F.gelu(gate, approximate=a) * up).sum(),
        "fxmem": lambda gate, up, a=a: geglu(gate, up, a).sum(),
    }) for a in ("none", "tanh")]
    return out
