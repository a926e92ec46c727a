"""Step time and peak memory of training steps, exact on CPU and CUDA.

    state = PerfState(warmup=1)
    for batch in batches:
        with step_perf("cpu", batch_size=8) as perf:
            loss = model(batch).sum()
            perf.mark("forward")
            loss.backward()
        state.add(perf.result)
    state.to_dict(prefix="fxmem/")

Peak memory is *relative*: the highest number of bytes live at any moment of the block minus
the bytes live at its entry, i.e. the peak of the step's own allocations (never below 0).

- CPU: the block runs under ``torch.profiler`` with ``profile_memory=True``; the allocator's
  ``"[memory]"`` events (+nbytes on allocation, -nbytes on free, exact requested sizes) summed in
  time order give live bytes. RSS is useless for this (glibc keeps freed memory). The profiler
  slows the block down; pass ``memory=False`` to time it without the profiler. Free the last
  step's tensors before the block: torch keeps the size of every block allocated under a profiler
  until a profiler sees it freed, so a tensor made outside any profiler at the address of one
  that died outside a profiler is reported at that stale size when the block frees it, and hides
  that much of the peak (which depends on what ran earlier in the process).
- CUDA: allocator statistics (``max_memory_allocated`` after ``reset_peak_memory_stats``).
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import itertools
import logging
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Optional, Union

import torch

__all__ = [
    "Mark",
    "PerfState",
    "StepPerf",
    "StepResult",
    "get_memory_stats",
    "print_memory",
    "reset_peak_memory",
    "saved_tensor_bytes",
    "step_perf",
]

log = logging.getLogger("fxmem")

DeviceLike = Union[str, torch.device]
_MARK_PREFIX = "fxmem.mark."


def _device(device: DeviceLike) -> torch.device:
    """Parse and check ``device``: only CPU and (available) CUDA are measurable."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"fxmem.profiling: bad device {device!r}: {e}") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"fxmem.profiling: device {device!r} requested but CUDA is not available")
        return torch.device("cuda", dev.index if dev.index is not None else torch.cuda.current_device())
    if dev.type != "cpu":
        raise ValueError(f"fxmem.profiling: unsupported device {device!r} (use 'cpu' or 'cuda[:N]')")
    return dev


@dataclass(frozen=True)
class Mark:
    """A point inside a step: seconds since the block started, live bytes at that moment and
    the peak so far, both relative to the block's entry (live_bytes may be negative if the block
    freed memory it did not allocate). Memory figures are None when not measured."""

    name: str
    time_s: float
    live_bytes: Optional[int]
    peak_bytes: Optional[int]


@dataclass(frozen=True)
class StepResult:
    """What ``step_perf`` measured. ``peak_bytes`` is relative to ``baseline_bytes`` (bytes live
    at entry: known on CUDA, None on CPU); None when memory was not measured."""

    device: str
    time_s: float
    peak_bytes: Optional[int]
    baseline_bytes: Optional[int] = None
    batch_size: Optional[int] = None
    marks: tuple[Mark, ...] = ()

    @property
    def peak_gb(self) -> Optional[float]:
        return None if self.peak_bytes is None else self.peak_bytes / 1e9

    @property
    def throughput(self) -> Optional[float]:
        """Samples per second, or None without a batch size."""
        if self.batch_size is None or self.time_s <= 0:
            return None
        return self.batch_size / self.time_s


class StepPerf:
    """Context manager returned by ``step_perf``; ``result`` is set when the block ends normally."""

    def __init__(self, device: DeviceLike, batch_size: Optional[int] = None, memory: bool = True):
        self.device = _device(device)
        if batch_size is not None and (not isinstance(batch_size, int) or batch_size <= 0):
            raise ValueError(f"fxmem.profiling: batch_size must be a positive int, got {batch_size!r}")
        self.batch_size = batch_size
        self.memory = bool(memory)
        self.result: Optional[StepResult] = None
        self._active = False
        self._prof = None
        self._marks: list[tuple[str, float, Optional[int], Optional[int]]] = []
        self._gc_was_enabled = True

    # -- CUDA helpers ------------------------------------------------------------------------
    def _cuda_sync(self) -> None:
        torch.cuda.synchronize(self.device)

    # -- context manager ---------------------------------------------------------------------
    def __enter__(self) -> "StepPerf":
        if self._active:
            raise RuntimeError("fxmem.profiling: step_perf block is not reentrant")
        self._marks, self.result, self._baseline = [], None, None
        cpu_mem = self.memory and self.device.type == "cpu"
        if cpu_mem:
            if torch.autograd._profiler_enabled():
                # Two profilers cannot run at once; say so rather than fail inside torch.
                raise RuntimeError("fxmem.profiling: a torch profiler is already running; "
                                   "use step_perf(..., memory=False) inside it")
            # Collect earlier garbage now and not during the step: a cycle of an earlier
            # compile's tensors freed mid-step shows as a negative event (allocated before the
            # profiler started) and hides that much of the step's peak.
            gc.collect()
            self._gc_was_enabled = gc.isenabled()
            gc.disable()
            self._prof = torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU],
                profile_memory=True,
                record_shapes=False,
            )
            with _quiet_stderr():
                self._prof.__enter__()
        elif self.device.type == "cuda":
            self._cuda_sync()  # earlier queued work must not count in this step's time
            if self.memory:
                self._baseline = torch.cuda.memory_allocated(self.device)
                torch.cuda.reset_peak_memory_stats(self.device)
        self._active = True
        # Start the clock after the profiler is up so its start-up cost is not counted.
        self._t0 = time.perf_counter()
        return self

    def mark(self, name: str) -> None:
        """Record time and memory at this point of the step."""
        if not self._active:
            raise RuntimeError("fxmem.profiling: mark() called outside its step_perf block")
        live = peak = None
        if self.device.type == "cuda":
            self._cuda_sync()
            if self.memory:
                live = torch.cuda.memory_allocated(self.device) - self._baseline
                peak = max(0, torch.cuda.max_memory_allocated(self.device) - self._baseline)
        t = time.perf_counter() - self._t0
        if self._prof is not None:
            # An empty range in the profiler's own clock locates the mark among the memory
            # events; its index in the name survives repeated mark names.
            with torch.profiler.record_function(f"{_MARK_PREFIX}{len(self._marks)}"):
                pass
        self._marks.append((str(name), t, live, peak))

    def __exit__(self, exc_type, exc, tb) -> bool:
        if self.device.type == "cuda":
            self._cuda_sync()
        elapsed = time.perf_counter() - self._t0  # before profiler teardown
        self._active = False
        prof, self._prof = self._prof, None
        if prof is not None:
            with _quiet_stderr():
                prof.__exit__(exc_type, exc, tb)
            if self._gc_was_enabled:
                gc.enable()
        if exc_type is not None:
            return False

        marks = self._marks
        peak: Optional[int] = None
        if prof is not None:
            peak, marks = _cpu_timeline(prof, marks)
        elif self.device.type == "cuda" and self.memory:
            peak = max(0, torch.cuda.max_memory_allocated(self.device) - self._baseline)
        self.result = StepResult(
            device=str(self.device),
            time_s=elapsed,
            peak_bytes=peak,
            baseline_bytes=self._baseline,
            batch_size=self.batch_size,
            marks=tuple(Mark(*m) for m in marks),
        )
        return False


@contextlib.contextmanager
def _quiet_stderr():
    """Kineto prints 'USDT ... profiler_start/stop' lines to fd 2 from C++ when a profiler starts
    and stops; silence only those two calls (the user's code runs with stderr as it was)."""
    try:
        saved = os.dup(2)
    except OSError:  # no fd 2 (embedded interpreters): nothing to silence
        yield
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        sys.stderr.flush()
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def _cpu_timeline(prof, marks):
    """Peak and per-mark figures from the profiler's CPU allocator events."""
    events = prof.profiler.kineto_results.events()
    cpu = torch._C._autograd.DeviceType.CPU
    mem = sorted(
        (e for e in events if e.name() == "[memory]" and e.device_type() == cpu),
        key=lambda e: e.start_ns(),
    )
    times = [e.start_ns() for e in mem]
    # Live bytes relative to entry. Frees of blocks allocated earlier under some profiler show
    # up as negative events, so the sum can dip below 0; the peak is floored at 0.
    live = list(itertools.accumulate(e.nbytes() for e in mem))
    running_peak = list(itertools.accumulate(live, max, initial=0))[1:]
    peak = running_peak[-1] if running_peak else 0

    stamps = {}
    for e in events:
        n = e.name()
        if n.startswith(_MARK_PREFIX):
            stamps[int(n[len(_MARK_PREFIX):])] = e.start_ns()
    out = []
    for i, (name, t, _, _) in enumerate(marks):
        k = bisect.bisect_right(times, stamps[i])  # memory events up to the mark
        out.append((name, t, live[k - 1] if k else 0, running_peak[k - 1] if k else 0))
    return peak, out


def step_perf(device: DeviceLike, batch_size: Optional[int] = None, memory: bool = True) -> StepPerf:
    """Measure one step: ``with step_perf("cpu", batch_size=8) as perf: ...; perf.mark("fwd")``;
    afterwards ``perf.result`` is a ``StepResult``. ``memory=False`` measures time only (on CPU:
    without the profiler's overhead)."""
    return StepPerf(device, batch_size=batch_size, memory=memory)


class PerfState:
    """Accumulates StepResults; statistics skip the first ``warmup`` results (compilation)."""

    def __init__(self, warmup: int = 1):
        if not isinstance(warmup, int) or warmup < 0:
            raise ValueError(f"fxmem.profiling: warmup must be an int >= 0, got {warmup!r}")
        self.warmup = warmup
        self._results: list[StepResult] = []

    def add(self, result: StepResult) -> None:
        if not isinstance(result, StepResult):
            raise TypeError(f"fxmem.profiling: expected a StepResult, got {type(result).__name__}")
        self._results.append(result)

    @property
    def results(self) -> tuple[StepResult, ...]:
        """All results added, warm-up included."""
        return tuple(self._results)

    @property
    def measured(self) -> tuple[StepResult, ...]:
        """Results the statistics use: those after the warm-up."""
        return tuple(self._results[self.warmup:])

    @property
    def median_time_s(self) -> Optional[float]:
        m = self.measured
        return statistics.median(r.time_s for r in m) if m else None

    @property
    def max_peak_bytes(self) -> Optional[int]:
        peaks = [r.peak_bytes for r in self.measured if r.peak_bytes is not None]
        return max(peaks) if peaks else None

    @property
    def median_throughput(self) -> Optional[float]:
        tp = [r.throughput for r in self.measured if r.throughput is not None]
        return statistics.median(tp) if tp else None

    def to_dict(self, prefix: str = "") -> dict:
        """Flat summary over the measured steps; ``steps`` counts them (warm-up excluded)."""
        peak = self.max_peak_bytes
        return {
            prefix + "step_time_median_s": self.median_time_s,
            prefix + "peak_bytes": peak,
            prefix + "peak_gb": None if peak is None else peak / 1e9,
            prefix + "steps": len(self.measured),
            prefix + "throughput": self.median_throughput,
        }


def get_memory_stats(device: DeviceLike) -> dict:
    """Current memory figures. CUDA: allocator statistics. CPU: process RSS only, which is no
    usable peak (freed memory stays with the process); use ``step_perf`` for CPU peaks."""
    dev = _device(device)
    if dev.type == "cuda":
        return {
            "allocated_bytes": torch.cuda.memory_allocated(dev),
            "reserved_bytes": torch.cuda.memory_reserved(dev),
            "max_allocated_bytes": torch.cuda.max_memory_allocated(dev),
        }
    try:
        with open("/proc/self/statm") as f:
            rss_pages = int(f.read().split()[1])
        rss = rss_pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):  # not Linux
        rss = None
    return {"rss_bytes": rss}


def print_memory(device: DeviceLike, label: str = "") -> str:
    """Log the current memory figures at INFO on the "fxmem" logger and return the line."""
    stats = get_memory_stats(device)
    parts = [f"{k.removesuffix('_bytes')}={_fmt_bytes(v)}" for k, v in stats.items()]
    line = f"{label + ': ' if label else ''}memory[{_device(device)}] " + " ".join(parts)
    log.info(line)
    return line


def _fmt_bytes(n: Optional[int]) -> str:
    return "n/a" if n is None else f"{n / 1e9:.3f}GB"


def reset_peak_memory(device: DeviceLike) -> None:
    """Reset the CUDA peak counter. No-op on CPU: there each step_perf block measures its own peak."""
    dev = _device(device)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)


def saved_tensor_bytes(fn, *args, **kwargs) -> int:
    """Bytes that autograd keeps for backward when ``fn(*args, **kwargs)`` runs: the distinct
    storages saved by its ops (``saved_tensors_hooks``), not counting storages of tensors passed
    in ``args``/``kwargs`` (inputs and parameters that exist anyway). Eager mode only."""
    given = {t.untyped_storage().data_ptr() for t in (*args, *kwargs.values())
             if isinstance(t, torch.Tensor)}
    saved: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in given:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args, **kwargs)
    del out
    return sum(saved.values())
