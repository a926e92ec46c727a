"""Microbatches of a per-example region, shared by the backend's chunked step (``run.py``) and
``fxmem.dpsgd.clipped_grad``: the option check, the one chunk loop (:func:`run_chunks`) and the
one ``"auto"`` size search (:func:`search`). Both callers use these and keep no loop or search of
their own.

    sums, per_example = run_chunks(B, m, run, dtypes)   # run(start, size) -> one chunk's results
    # inside: for start, size in spans(B, m) (B = 0 runs no chunk at all), the chunk's batch sums
    # added up in float32 or wider and rounded once, its per-example outputs joined

The backend runs the last chunk at its own size (one more chunk graph); ``clipped_grad`` pads
it to ``m`` with :func:`pad` (the padding's weight 0 multiplies its clip factor, so it adds
exactly 0) so that one compile serves every Poisson-sampled batch size.

``microbatch_size="auto"`` (:func:`search`): the largest chunk size whose measured step peak
fits ``memory_budget``. Peaks grow about linearly in m (not exactly: ghost norms and allocator
effects bend the line), so each next size is read off the line through the two nearest
measurements (through the origin while there is only one: every byte counted per example, an
over-estimate of the slope at small m), then bracketed until the largest fitting size is next
to a measured size over the budget, or until ``max_measures`` sizes were measured or the best
fit is within ``tolerance`` of the budget (each measurement is a compile for ``clipped_grad``).
The search starts from sizes measured exactly (the backend: each measurement is one run) or,
where a measurement is a compile (``clipped_grad``), from the line through two cheap probes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch
from torch.utils import _pytree as pytree

from ..options import OptionError, parse_bytes
from ..profiling import step_perf

__all__ = ["Accumulator", "AutoChoice", "auto_budget", "line_peak", "measured_peak", "pad", "run_chunks",
           "search", "spans"]


# --- the option ---------------------------------------------------------------------------------


def auto_budget(memory_budget: Any) -> int:
    """The byte budget that ``microbatch_size="auto"`` needs, or an OptionError (a ValueError)
    naming both options and what is allowed."""
    if memory_budget is None or isinstance(memory_budget, float):
        raise OptionError("option 'microbatch_size': 'auto' needs memory_budget in bytes (an int or a "
                          f"string such as '128MB'), got {memory_budget!r}: the largest microbatch "
                          "whose step fits in it is chosen")
    return parse_bytes(memory_budget, "memory_budget")


# --- the chunk loop -----------------------------------------------------------------------------


def spans(batch: int, m: int) -> list[tuple[int, int]]:
    """``(start, size)`` of every chunk of at most ``m`` examples (none for an empty batch)."""
    return [(start, min(m, batch - start)) for start in range(0, batch, m)]


def _pad_leaf(t: Any, start: int, size: int, m: int) -> Any:
    if not isinstance(t, torch.Tensor):
        return t
    part = t.narrow(0, start, size)
    if size == m:
        return part
    fill = part[-1:].expand(m - size, *part.shape[1:])
    return torch.cat([part, fill])


def pad(args: Sequence[Any], batch_argnums: Sequence[int], start: int, size: int, m: int,
        device: torch.device) -> tuple[list[Any], torch.Tensor]:
    """``args`` with every batch argument's examples ``start .. start + size`` padded to ``m``
    by repeating the last one (valid data for any model, finite where the real example is), and
    the examples' weights: ``[m]`` float32, 1 real, 0 padding."""
    out = list(args)
    for i in batch_argnums:
        out[i] = pytree.tree_map(lambda t: _pad_leaf(t, start, size, m), args[i])
    weights = torch.zeros(m, dtype=torch.float32, device=device)
    weights[:size] = 1.0
    return out, weights


def aliases(outputs: Sequence[torch.Tensor], inputs: Sequence[Any]) -> bool:
    """Whether an output shares storage with an input (any tensor leaf of ``inputs``) or with
    another output: then the outputs are not the caller's to keep and add into."""
    seen = {t.untyped_storage().data_ptr() for t in pytree.tree_leaves(inputs) if isinstance(t, torch.Tensor)}
    for t in outputs:
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen:
            return True
        seen.add(ptr)
    return False


class Accumulator:
    """Sums of the chunks' batch sums (in float32 or wider, rounded to ``dtypes`` once at the
    end) and the real examples' slices of their per-example outputs, joined along each one's
    batch dim (``dims``, default 0)."""

    def __init__(self, dims: Sequence[int] | None = None) -> None:
        self.sums: list[torch.Tensor] | None = None
        self.per_example: list[list[torch.Tensor]] = []
        self.dims = dims

    def add(self, sums: Sequence[torch.Tensor], per_example: Sequence[torch.Tensor], size: int,
            inputs: Sequence[Any] | None = None) -> None:
        """Add one chunk's results. ``inputs``: the chunk's inputs; where given, the first
        chunk's sums become the running sums without a copy unless one of them shares storage
        with an input or another sum (:func:`aliases`): a copy would double the sums' bytes while
        the chunk's output is alive."""
        if self.sums is None:
            copy = inputs is None or aliases(sums, inputs)
            self.sums = [s.to(torch.promote_types(s.dtype, torch.float32), copy=copy) for s in sums]
            self.per_example = [[] for _ in per_example]
        else:
            for a, s in zip(self.sums, sums):
                a.add_(s)
        dims = self.dims or [0] * len(per_example)
        for parts, t, d in zip(self.per_example, per_example, dims):
            parts.append(t if t.shape[d] == size else t.narrow(d, 0, size))

    def result(self, dtypes: Sequence[torch.dtype]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        dims = self.dims or [0] * len(self.per_example)
        sums = [a.to(d) for a, d in zip(self.sums, dtypes)]
        return sums, [torch.cat(parts, d) for parts, d in zip(self.per_example, dims)]


def run_chunks(batch: int, m: int, run: Callable[[int, int], tuple], dtypes: Sequence[torch.dtype],
               dims: Sequence[int] | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The chunk loop: ``run(start, size)`` runs the chunk of examples ``start .. start + size``
    and returns ``(sums, per_example, inputs)``: its batch sums, its per-example outputs and the
    inputs it ran on (see :meth:`Accumulator.add`). Returns the batch's sums, rounded to
    ``dtypes``, and its per-example outputs, joined along ``dims``. A chunk's results are
    dropped before the next chunk runs: between chunks only the running sums stay alive."""
    acc = Accumulator(dims)
    for start, size in spans(batch, m):
        sums, per_example, inputs = run(start, size)
        acc.add(sums, per_example, size, inputs=inputs)
        del sums, per_example, inputs
    return acc.result(dtypes)


def measured_peak(device: torch.device | str, run: Callable[[], Any],
                  warm_up: Callable[[], Any] | None = None) -> int:
    """The exact peak in bytes of ``run()`` above what is live when it starts
    (``fxmem.profiling.step_perf``), after ``warm_up()``: a first call's allocations (a compile,
    caches) are not the step's. What ``run`` returns is dropped inside the measurement."""
    if warm_up is not None:
        warm_up()
    with step_perf(device) as perf:
        out = run()
    del out
    return perf.result.peak_bytes


# --- "auto" -------------------------------------------------------------------------------------


@dataclass
class AutoChoice:
    """What ``"auto"`` decided: the budget, the largest size allowed, the measured step peaks
    (bytes) of every size tried, the sizes the search started from, and the size chosen."""
    budget: int
    max_size: int
    measured: dict[int, int] = field(default_factory=dict)
    eager: dict[int, int] = field(default_factory=dict)       # clipped_grad's uncompiled probes
    predicted: dict[int, int] = field(default_factory=dict)   # the line's peak at each start size
    chosen: int | None = None

    def peak(self, m: int) -> int:
        """The step peak at m (:func:`line_peak` of the measurements)."""
        return line_peak(self.measured, m)


def line_peak(points: Mapping[int, int], m: int) -> int:
    """The step peak at m: measured where ``points`` (size -> measured peak) has it, else on the
    line through the two nearest measured sizes."""
    if m in points:
        return points[m]
    near = sorted(points, key=lambda k: (abs(k - m), k))[:2]
    if len(near) < 2:
        return points[near[0]]
    (m1, p1), (m2, p2) = sorted((k, points[k]) for k in near)
    return int(p1 + (p2 - p1) * (m - m1) / (m2 - m1))


def _next_size(points: dict[int, int], budget: int) -> int:
    """Where the line through the measurements around the budget crosses it (through the origin
    while only one size is measured)."""
    if len(points) == 1:
        (m, p), = points.items()
        return int(budget // max(p / m, 1.0))
    below = max((m for m, p in points.items() if p <= budget), default=1)
    above = [m for m, p in points.items() if p > budget]
    m2 = min(above) if above else max(points)
    m1 = below if m2 != below else min(points)
    if m1 == m2:
        return below + 1
    p1, p2 = points[m1], points[m2]
    slope = (p2 - p1) / (m2 - m1)
    return int(m1 + (budget - p1) // slope) if slope > 0 else 1 << 30


def _probe_start(c: AutoChoice, probe: Callable[[int], int], overhead: int) -> int:
    """Where the line through ``probe(1)`` and ``probe(2)`` (peaks of a cheap run that
    over-estimates, e.g. an uncompiled step that keeps every per-example gradient), plus
    ``overhead`` bytes, crosses the budget; records the probes in ``c.eager`` and the line's peak
    there in ``c.predicted``."""
    c.eager = {m: probe(m) for m in (1, 2)}
    slope = max(c.eager[2] - c.eager[1], 1)
    base = c.eager[1] - slope + overhead
    first = int(min(c.max_size, max(1, (c.budget - base) // slope)))
    c.predicted[first] = int(base + slope * first)
    return first


def search(c: AutoChoice, measure: Callable[[int], int], start: Sequence[int] = (), *,
           probe: Callable[[int], int] | None = None, overhead: int = 0,
           max_measures: int | None = None, tolerance: float = 0.0, what: str = "fxmem") -> int:
    """The ``"auto"`` search: the largest size in ``1 .. c.max_size`` whose ``measure(m)`` (a
    step's peak in bytes) fits ``c.budget``; records every measurement in ``c.measured`` and the
    choice in ``c.chosen``. It starts from the sizes ``start``, or, with ``probe``, from the one
    size where the line through two probes crosses the budget (:func:`_probe_start`: for a
    caller whose every measurement is a compile). Raises MemoryError when one example at a time
    is measured over the budget."""
    if probe is not None:
        start = (_probe_start(c, probe, overhead),)

    def take(m: int) -> int:
        m = min(max(m, 1), c.max_size)
        if m not in c.measured:
            c.measured[m] = measure(m)
        if m == 1 and c.measured[1] > c.budget:
            raise MemoryError(f"{what}: memory_budget {c.budget} bytes is below the peak of one example "
                              f"at a time ({c.measured[1]} bytes measured); the smallest feasible "
                              f"budget is {c.measured[1]}")
        return m

    for m in start:
        take(m)
    while True:
        fits = [m for m, p in c.measured.items() if p <= c.budget]
        over = [m for m, p in c.measured.items() if p > c.budget]
        lo, hi = max(fits, default=0), min(over, default=c.max_size + 1)
        done = hi - lo <= 1 or (max_measures is not None and len(c.measured) >= max_measures) or \
            (fits and c.measured[lo] >= (1 - tolerance) * c.budget and tolerance > 0)
        if done:
            break
        take(min(max(_next_size(c.measured, c.budget), lo + 1), hi - 1))
    if lo == 0:  # every size tried was over: one at a time, or the error
        lo = take(1)
    c.chosen = lo
    return lo
