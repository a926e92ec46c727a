import torch

from fxmem_kernels.dropout import seeded_dropout

from . import Case

P, SEED = 0.1, 1234


def _unfused(x):
    """Plain PyTorch dropout drawing fxmem's mask (so losses and gradients compare), keeping for
    backward what ``F.dropout`` keeps on that device: a float noise tensor on CPU (aten's
    ``_dropout_impl``: ``x * bernoulli(1 - p) / (1 - p)``), a bool mask on CUDA (native_dropout)."""
    with torch.no_grad():
        if x.is_cuda:  # fxmem runs Triton there: take its mask
            noise = seeded_dropout(torch.ones_like(x), P, SEED) != 0
        else:  # fxmem's portable mask: the seeded generator's uniforms >= p
            u = torch.rand(x.shape, generator=torch.Generator(x.device).manual_seed(SEED),
                           device=x.device)
            noise = (u >= P).to(x.dtype).div_(1 - P)
            del u
    y = x * noise * (1 / (1 - P)) if x.is_cuda else x * noise
    return y.sum()


def cases(quick: bool):
    n, h = (1024, 512) if quick else (8192, 4096)

    def make():
        return (torch.randn(n, h, generator=torch.Generator().manual_seed(0), requires_grad=True),)

    return [Case("dropout", f"N={n} H={h} p={P} fp32", make, {
        "unfused": _unfused,
        "fxmem": lambda x: seeded_dropout(x, P, SEED).sum(),
    }, notes="reference = plain PyTorch dropout with fxmem's mask (same seed), keeping F.dropout's "
             "noise tensor")]
