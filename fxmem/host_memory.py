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


def _span(shape, stride) -> int:
    """Elements from a tensor's first to one past its last (its strides' extent)."""
    if any(s == 0 for s in shape):
        return 0
    return 1 + sum((s - 1) * st for s, st in zip(shape, stride))


def _host_stride(x: torch.Tensor) -> tuple[int, ...]:
    """The strides of ``x``'s host copy: its own where they are dense (no element twice, no gap:
    a saved activation's layout, channels-last included, kept), else contiguous (an expanded
    tensor, which a saved-tensor hook may be given)."""
    if not all(type(v) is int for v in (*x.shape, *x.stride())):  # traced: an op's own output, dense
        return x.stride()
    return x.stride() if _dense(x.shape, x.stride()) else torch.empty(x.shape, device="meta").stride()


def _dense(shape, stride) -> bool:
    """Every element of the span stored once: sorted by stride, each dimension steps over
    exactly the ones inside it."""
    expected = 1
    for step, size in sorted((st, sz) for st, sz in zip(stride, shape) if sz != 1):
        if step != expected:
            return False
        expected *= size
    return True


def _strided_like(base: torch.Tensor, like: torch.Tensor, stride: tuple[int, ...]) -> torch.Tensor:
    """``base``'s bytes viewed with ``like``'s dtype and size and ``stride`` (offset 0)."""
    flat = base.view(like.dtype)
    return flat.as_strided(like.shape, stride)


@torch.library.custom_op("fxmem::offload", mutates_args=())
def offload(x: torch.Tensor) -> torch.Tensor:
    """``x`` copied into a host buffer from the pool (same size, strides, dtype)."""
    pinned, stride = x.is_cuda, _host_stride(x)
    h = _POOL.take(_span(x.shape, stride) * x.element_size(), pinned, lambda buf: _strided_like(buf, x, stride))
    h.copy_(x, non_blocking=pinned)
    return h


@offload.register_fake
def _(x):
    return torch.empty_strided(x.shape, _host_stride(x), dtype=x.dtype, device="cpu")


@torch.library.custom_op("fxmem::reload", mutates_args=())
def reload(h: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``h`` (an offloaded activation) copied back into a new tensor on ``device``."""
    out = torch.empty_strided(h.shape, h.stride(), dtype=h.dtype, device=device)
    out.copy_(h, non_blocking=out.is_cuda)
    return out


@reload.register_fake
def _(h, device):
    return torch.empty_strided(h.shape, h.stride(), dtype=h.dtype, device=device)


def save_on_host():
    """``torch.autograd.graph.save_on_cpu`` into this pool: every tensor autograd saves in the
    block is copied to host memory (pinned on CUDA) and back when the backward reads it. The seed
    documents' manual recipe (with checkpointing), for comparison with planned offload: on a CPU
    its host copies, like fxmem's, are outside torch's allocator (``save_on_cpu`` itself copies
    CPU tensors into the allocator, so its "host" bytes would count as device bytes there)."""
    def pack(t: torch.Tensor):
        return t.device, torch.ops.fxmem.offload(t)

    def unpack(packed) -> torch.Tensor:
        device, h = packed
        return torch.ops.fxmem.reload(h, device)

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)
