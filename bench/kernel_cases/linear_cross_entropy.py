import torch
import torch.nn.functional as F
from torch.func import grad_and_value, vmap

from fxmem_kernels.linear_cross_entropy import DEFAULT_WORKSPACE_BYTES, linear_cross_entropy

from . import Case

TARGETS = {"peak_ratio": 0.15, "time_ratio": 1.3}


def _inputs(n, h, v, batch=None):
    def make():
        g = torch.Generator().manual_seed(0)
        lead = (n,) if batch is None else (batch, n // batch)
        hidden = torch.randn(*lead, h, generator=g, requires_grad=True)
        weight = (torch.randn(v, h, generator=g) / h**0.5).requires_grad_()
        target = torch.randint(0, v, lead, generator=g)
        target.view(-1)[::7] = -100  # some ignored tokens (padding)
        return hidden, weight, target

    return make


def _per_example_grads(fn, inputs):
    """Per-example losses and their gradients w.r.t. the shared weight and each example's
    hidden states: ``vmap(grad(loss))`` over the examples (weight not batched)."""
    hidden, weight, target = inputs
    (dw, dh), loss = vmap(grad_and_value(fn, argnums=(0, 1)), in_dims=(None, 0, 0))(
        weight.detach(), hidden.detach(), target)
    return loss, (dw, dh)


def cases(quick: bool):
    n, h, v = (1024, 32, 4096) if quick else (4096, 256, 32768)
    b = 4
    # Workspace = 1/8 of the logits: the default (64 MiB) at the bar shapes; the quick shapes'
    # logits would fit the default whole, so they get 2 MiB to show the chunking.
    ws = n * v * 4 // 8
    assert quick or ws == DEFAULT_WORKSPACE_BYTES
    fused = lambda x, w, t: linear_cross_entropy(x, w, t, workspace_bytes=ws)
    return [
        Case("linear_cross_entropy", f"N={n} H={h} V={v} fp32 mean", _inputs(n, h, v), {
            "unfused": lambda x, w, t: F.cross_entropy(F.linear(x, w), t),
            "fxmem": fused,
        }, targets=TARGETS, notes="forward + backward of the mean loss; dW and dh"),
        Case("linear_cross_entropy", f"vmap(grad) B={b}x{n // b} H={h} V={v} fp32",
             _inputs(n, h, v, batch=b), {
                 "unfused": lambda w, x, t: F.cross_entropy(F.linear(x, w), t),
                 "fxmem": lambda w, x, t: fused(x, w, t),
             }, grad_of=_per_example_grads, targets=TARGETS,
             notes="per-example losses; per-example dW [B, V, H] and dh"),
    ]
