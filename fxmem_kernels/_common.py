"""What every kernel family shares: choosing Triton or PyTorch, launching Triton kernels (through
the interpreter for CPU tensors, so tests run them without a GPU), vmap rules for the functional
ops, and the once-differentiable guard for the autograd wrappers.

The pattern each family follows (see NOTES.md, "Custom ops, vmap and grad"):
- a functional forward op and a functional backward op (``torch.library``), each with a fake
  implementation and a vmap rule, so a graph pass can place them into a differentiated graph;
- a new-style ``torch.autograd.Function`` (``setup_context``, ``generate_vmap_rule=True``) whose
  backward calls :func:`once_differentiable` and then the backward op under ``no_grad``, so the
  eager API works under ``torch.func.grad`` and ``vmap(grad(...))``.
"""
from __future__ import annotations

import functools
import os
from typing import Callable

import torch

try:  # Triton is optional: the portable path needs only PyTorch.
    import triton  # noqa: F401
    from triton.runtime.interpreter import InterpretedFunction

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only where triton is absent
    HAS_TRITON = False

IMPLS = ("auto", "torch", "triton")

# The Triton kernels have run only in Triton's interpreter and been compiled for sm_90 here, not
# yet run on a GPU: until the CUDA tests (``pytest -m cuda``, which compare them with the portable
# implementations) pass on one, ``impl="auto"`` runs the portable PyTorch implementations on CUDA
# too (correct on any device), and this variable opts in to Triton there. Read at each call;
# under torch.compile, when the call is traced.
ENV_TRITON = "FXMEM_KERNELS_TRITON"
_ON, _OFF = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


def env_flag(name: str, value: str | None, default: bool = False) -> bool:
    """An on/off environment variable's value: 1/true/yes/on or 0/false/no/off (any case),
    ``default`` when unset or empty; anything else is a ``ValueError`` naming the variable."""
    text = (value or "").strip().lower()
    if not text:
        return default
    if text not in _ON + _OFF:
        raise ValueError(f"environment variable {name}: got {value!r}; allowed: 1/true/yes/on or 0/false/no/off "
                         f"(unset: {'on' if default else 'off'})")
    return text in _ON


def triton_on_cuda() -> bool:
    """Whether ``impl="auto"`` runs the Triton kernels on CUDA tensors: ``FXMEM_KERNELS_TRITON=1``
    (default off: the portable implementations)."""
    return env_flag(ENV_TRITON, os.environ.get(ENV_TRITON))


def use_triton(impl: str, x: torch.Tensor) -> bool:
    """Whether to run the Triton kernels: ``impl="auto"`` means the PyTorch implementation, or
    Triton on CUDA tensors when :func:`triton_on_cuda` (``FXMEM_KERNELS_TRITON=1``); ``"triton"``
    always Triton (on CPU tensors through the interpreter: tests), ``"torch"`` always the PyTorch
    implementation."""
    if impl not in IMPLS:
        raise ValueError(f"fxmem_kernels: impl must be one of {IMPLS}, got {impl!r}")
    if impl == "torch":
        return False
    if impl == "triton":
        if not HAS_TRITON:
            raise RuntimeError("fxmem_kernels: impl='triton' needs the triton package")
        return True
    return HAS_TRITON and x.is_cuda and triton_on_cuda()


@functools.lru_cache(maxsize=None)
def _interpreted(kernel):
    # Only this kernel is interpreted: kernels must not call other @triton.jit functions.
    return InterpretedFunction(kernel.fn)


def launcher(kernel, x: torch.Tensor):
    """``kernel`` ready to index with a grid: wrapped for Inductor on CUDA (``wrap_triton``, so
    a compiled graph sees into it), the interpreter for CPU tensors."""
    if x.is_cuda:
        return torch.library.wrap_triton(kernel)
    return _interpreted(kernel)


def take_example(args, in_dims, i):
    return [a.select(d, i) if d is not None else a for a, d in zip(args, in_dims)]


def _stack(outs):
    if isinstance(outs[0], (tuple, list)):
        return tuple(torch.stack(o) for o in zip(*outs)), (0,) * len(outs[0])
    return torch.stack(outs), 0


def loop_vmap(op) -> Callable:
    """A vmap rule that calls ``op`` once per example and stacks: right for any op, and what
    backward ops need (a parameter's gradient must stay per example under ``vmap(grad)``)."""

    def rule(info, in_dims, *args, **kwargs):
        return _stack([op(*take_example(args, in_dims, i), **kwargs) for i in range(info.batch_size)])

    return rule


def rowwise_vmap(op, row_args: tuple[int, ...]) -> Callable:
    """A vmap rule for ops that treat every leading dim of their ``row_args`` as rows (norms,
    activations): when only row arguments are batched, the batch dim becomes one more row dim
    and the op runs once; otherwise it falls back to :func:`loop_vmap`."""
    loop = loop_vmap(op)

    def rule(info, in_dims, *args, **kwargs):
        if any(d is not None for i, d in enumerate(in_dims) if i not in row_args):
            return loop(info, in_dims, *args, **kwargs)
        args = list(args)
        for i in row_args:
            a, d = args[i], in_dims[i]
            args[i] = a.movedim(d, 0) if d is not None else a.expand(info.batch_size, *a.shape)
        out = op(*args, **kwargs)
        return out, (tuple(0 for _ in out) if isinstance(out, (tuple, list)) else 0)

    return rule


def once_differentiable(name: str) -> None:
    """Call first in a fused op's ``backward``: raise for double backward (``create_graph=True``
    in eager, or nested ``grad(grad(...))``) instead of silently returning zeros."""
    if torch.compiler.is_compiling():
        return
    from torch._C._functorch import TransformType
    from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

    keys = [i.key() for i in retrieve_all_functorch_interpreters()]
    nested = sum(k in (TransformType.Grad, TransformType.Jvp) for k in keys) > 1
    if nested or (not keys and torch.is_grad_enabled()):
        raise RuntimeError(f"fxmem_kernels.{name}: double backward is not supported "
                           "(its backward is a fused kernel without a derivative)")
