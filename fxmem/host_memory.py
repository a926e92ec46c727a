"""Host memory for offloaded activations: the two graph ops a plan with ``offload`` runs, and the
pool of host buffers they copy into.

``fxmem::offload(x)`` copies a saved activation into a host buffer and returns that buffer; the
forward hands the buffer to the backward instead of ``x``, so ``x``'s device storage dies at its
last forward read. ``fxmem::reload(h)`` copies it back into a new device tensor (same size,
strides and dtype) just before the backward's first read of it. Both are plain copies: a plan with
offload computes bit for bit what the same plan without it computes.

The pool (:class:`HostPool`) keeps host buffers across steps, keyed by size: a buffer is free once
the host tensor made from it has died (the backward freed its saved tensors), so a training loop
allocates host memory in its first step only. :func:`host_pool` is the process's pool, as torch's
caching allocator is the process's: the ops have no other way to reach it.

- **CUDA**: pinned host buffers; both copies are queued on the current stream without blocking
  the host (``non_blocking``), so a later kernel that reuses the device memory runs after the copy
  out, and the backward's first read after the copy in. The copies do not overlap the stream's
  compute (no side stream yet): the planner prices them as not hidden.
- **CPU** (the test machines): the "host" buffers come from numpy, outside torch's CPU allocator,
  so the allocator's peak (``fxmem.profiling``, torch.profiler's memory events) counts the device
  bytes alone, as a GPU's allocator would, and every correctness test runs here. Host bytes are
  counted separately (:meth:`HostPool.stats`, and the planner's ``host_bytes``).
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

OFFLOAD_TAG = "fxmem_host"  # node.meta key: the node's value lives in host memory (no device bytes)


@dataclass(frozen=True)
class PoolStats:
    """Host bytes the pool holds (``allocated``) and, of those, lent to live host tensors."""
    allocated: int
    in_use: int
    buffers: int


class HostPool:
    """Host buffers reused across steps. ``take(nbytes, pinned, make)`` lends a uint8 buffer of
    ``nbytes`` rounded up to 512 and returns ``make(buffer)``; the buffer is free again once that
    tensor has died (a tensor's Python object lives as long as the tensor: autograd's saved
    tensors keep it)."""

    ALIGN = 512

    def __init__(self):
        self._lock = threading.Lock()
        self._buffers: dict[tuple[int, bool], list[list]] = {}  # (bytes, pinned) -> [[buffer, lender ref]]

    def take(self, nbytes: int, pinned: bool, make: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        size = max(self.ALIGN, -(-nbytes // self.ALIGN) * self.ALIGN)
        with self._lock:
            entries = self._buffers.setdefault((size, pinned), [])
            entry = next((e for e in entries if e[1] is None or e[1]() is None), None)
            if entry is None:
                buf = (torch.empty(size, dtype=torch.uint8, pin_memory=True) if pinned
                       else torch.from_numpy(np.empty(size, dtype=np.uint8)))
                entry = [buf, None]
                entries.append(entry)
            out = make(entry[0])
            entry[1] = weakref.ref(out)
            return out

    def stats(self) -> PoolStats:
        with self._lock:
            entries = [e for es in self._buffers.values() for e in es]
            used = sum(e[0].numel() for e in entries if e[1] is not None and e[1]() is not None)
            return PoolStats(sum(e[0].numel() for e in entries), used, len(entries))

    def clear(self) -> None:
        """Drop the free buffers (those lent stay with their tensors)."""
        with self._lock:
            for key, entries in list(self._buffers.items()):
                kept = [e for e in entries if e[1] is not None and e[1]() is not None]
                if kept:
                    self._buffers[key] = kept
                else:
                    del self._buffers[key]


_POOL = HostPool()


def host_pool() -> HostPool:
    """The process's pool of host buffers for offloaded activations."""
    return _POOL


def dim_order(x: torch.Tensor) -> list[int]:
    """``x``'s dimensions from the outermost in memory to the innermost, where its strides are
    dense (a saved activation's layout, channels-last or transposed included); else (an expanded
    tensor, which a saved-tensor hook may be given) the contiguous order. For a traced value,
    symbolic strides are ordered by their values at the traced shape."""
    def hint(v):
        return v if type(v) is int else v.node.hint

    shape, stride = [hint(v) for v in x.shape], [hint(v) for v in x.stride()]
    if None in shape or None in stride or not _dense(shape, stride):
        return list(range(x.dim()))
    return sorted(range(x.dim()), key=lambda d: (-stride[d], d))


def _dense(shape, stride) -> bool:
    """Every element of the span stored once: sorted by stride, each dimension steps over
    exactly the ones inside it."""
    expected = 1
    for step, size in sorted((st, sz) for st, sz in zip(stride, shape) if sz != 1):
        if step != expected:
            return False
        expected *= size
    return True


def _empty(shape, order: list[int], dtype: torch.dtype, device, pin: Callable | None = None) -> torch.Tensor:
    """A dense tensor of ``shape`` laid out in ``order`` (outermost dimension first): allocated
    by ``pin(nbytes)`` (a uint8 buffer, from the pool) when given, else on ``device``."""
    if sorted(order) != list(range(len(shape))):
        raise ValueError(f"fxmem host copy: dimension order {order} is no permutation of {len(shape)} dimensions")
    physical = [shape[d] for d in order]
    if pin is None:
        out = torch.empty(physical, dtype=dtype, device=device)
    else:
        numel = 1
        for n in physical:
            numel *= n
        out = pin(numel * dtype.itemsize).view(dtype)[:numel].view(physical)
    inverse = sorted(range(len(order)), key=order.__getitem__)
    return out.permute(inverse)


# The layout is an argument, the same for both ops and their fake kernels: what the forward hands
# over and what the backward gets back have the strides the graph was traced with, whatever layout
# the inner compiler gave the value (Inductor may store one transposed: the forward would then
# copy the host tensor back to the device to return it in the traced layout).
@torch.library.custom_op("fxmem::offload", mutates_args=())
def offload(x: torch.Tensor, order: list[int]) -> torch.Tensor:
    """``x`` copied into a host buffer from the pool, laid out in ``order`` (see :func:`dim_order`)."""
    pinned = x.is_cuda
    h = _POOL.take(x.numel() * x.element_size(), pinned,
                   lambda buf: _empty(x.shape, order, x.dtype, "cpu", pin=lambda n: buf[:n]))
    h.copy_(x, non_blocking=pinned)
    return h


@offload.register_fake
def _(x, order):
    return _empty(x.shape, order, x.dtype, "cpu")


@torch.library.custom_op("fxmem::reload", mutates_args=())
def reload(h: torch.Tensor, device: torch.device, order: list[int]) -> torch.Tensor:
    """``h`` (an offloaded activation) copied back into a new tensor on ``device``, laid out in ``order``."""
    out = _empty(h.shape, order, h.dtype, device)
    out.copy_(h, non_blocking=out.is_cuda)
    return out


@reload.register_fake
def _(h, device, order):
    return _empty(h.shape, order, h.dtype, device)


def save_on_host():
    """``torch.autograd.graph.save_on_cpu`` into this pool: every tensor autograd saves in the
    block is copied to host memory (pinned on CUDA) and back when the backward reads it. The seed
    documents' manual recipe (with checkpointing), for comparison with planned offload: on a CPU
    its host copies, like fxmem's, are outside torch's allocator (``save_on_cpu`` itself copies
    CPU tensors into the allocator, so its "host" bytes would count as device bytes there)."""
    def pack(t: torch.Tensor):
        order = dim_order(t)
        return t.device, order, torch.ops.fxmem.offload(t, order)

    def unpack(packed) -> torch.Tensor:
        device, order, h = packed
        return torch.ops.fxmem.reload(h, device, order)

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)
