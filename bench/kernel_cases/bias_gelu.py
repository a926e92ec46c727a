import torch
import torch.nn.functional as F

from fxmem_kernels.bias_gelu import bias_gelu

from . import Case


def cases(quick: bool):
    n, h = (1024, 512) if quick else (8192, 3072)

    def make():
        g = torch.Generator().manual_seed(0)
        return (torch.randn(n, h, generator=g, requires_grad=True),
                torch.randn(h, generator=g, requires_grad=True))

    return [Case("bias_gelu", f"N={n} H={h} fp32 {a}", make, {
        "unfused": lambda x, b, a=a: F.gelu(x + b, approximate=a).sum(),
        "fxmem": lambda x, b, a=a: bias_gelu(x, b, a).sum(),
    }) for a in ("none", "tanh")]
