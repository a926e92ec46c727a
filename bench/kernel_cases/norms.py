import torch
import torch.nn.functional as F

from fxmem_kernels.norms import layer_norm, rms_norm

from . import Case

TARGETS = {"peak_ratio": 1.0, "time_ratio": 1.5}


def _rms_written_out(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rms_llama(x, w, eps=1e-6):
    """transformers' LlamaRMSNorm.forward."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


def cases(quick: bool):
    n, h = (1024, 512) if quick else (8192, 2048)

    def make(dtype=torch.float32, bias=True):
        def inputs():
            g = torch.Generator().manual_seed(0)
            out = [torch.randn(n, h, generator=g).to(dtype).requires_grad_(),
                   (1 + 0.1 * torch.randn(h, generator=g)).to(dtype).requires_grad_()]
            if bias:
                out.append(torch.randn(h, generator=g).to(dtype).requires_grad_())
            return tuple(out)
        return inputs

    return [
        Case("norms", f"LayerNorm N={n} H={h} fp32", make(), {
            "unfused": lambda x, w, b: F.layer_norm(x, (h,), w, b).sum(),
            "fxmem": lambda x, w, b: layer_norm(x, w, b).sum(),
        }, targets=TARGETS),
        Case("norms", f"RMSNorm N={n} H={h} fp32", make(bias=False), {
            "unfused": lambda x, w: _rms_written_out(x, w).sum(),
            "fxmem": lambda x, w: rms_norm(x, w).sum(),
        }, targets=TARGETS),
        Case("norms", f"RMSNorm (HF Llama form) N={n} H={h} bf16", make(torch.bfloat16, False), {
            "unfused": lambda x, w: _rms_llama(x, w).float().sum(),
            "fxmem": lambda x, w: rms_norm(x, w).float().sum(),
        }, rtol=2e-2, targets=TARGETS,
            notes="unfused = LlamaRMSNorm's expression (fp32 upcast, cast back, weight)"),
    ]
