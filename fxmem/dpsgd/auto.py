"""``microbatch_size="auto"`` for :func:`clipped_grad`: the largest fixed chunk size whose step
fits ``memory_budget``, found with one compile in the common case (two at most).

    peak(m) = a + b * m + sums            per-example memory grows linearly in m; ``sums`` is the
                                          running float32 sum of the chunks (parameter-sized)

1. predict: ``a`` and ``b`` from the uncompiled step run eagerly on chunks of 1 and 2 examples
   (no compile; eager keeps every per-example gradient, so the line over-estimates fxmem's peak
   and its ``m`` is safe);
2. compile at that ``m`` and measure the compiled step once (the check);
3. unless that measurement is already within ``TOLERANCE`` of the budget, compile once more at
   the ``m`` that the measurement's own slope (``peak(m) / m``: every byte per example, an
   over-estimate at small m; peaks are convex in m, so a secant through a small intercept
   would under-estimate them) says fits; measure it too, and keep the largest measured size
   within the budget.

The choice is cached on the :class:`ClippedGradFn`: every later batch runs at that size.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

__all__ = ["AutoChoice", "choose"]

TOLERANCE = 0.25  # a measured peak within 25% of the predicted one keeps the first compile


@dataclass
class AutoChoice:
    """What ``"auto"`` decided: the budget, the eager peaks at m = 1, 2, the predicted and the
    measured step peaks (bytes) of each compiled size, and the size chosen."""
    budget: int
    max_size: int
    eager: dict[int, int] = field(default_factory=dict)
    predicted: dict[int, int] = field(default_factory=dict)
    measured: dict[int, int] = field(default_factory=dict)
    chosen: int | None = None


def _fit(budget: int, base: float, slope: float, max_size: int) -> int:
    return int(min(max_size, max(1, (budget - base) // max(slope, 1.0))))


def choose(budget: int, max_size: int, sums_bytes: int, eager_peak: Callable[[int], int],
           compile_and_measure: Callable[[int], int]) -> AutoChoice:
    """The chunk size for ``budget`` bytes, at most ``max_size``. ``eager_peak(m)``: the
    uncompiled step's peak on m examples; ``compile_and_measure(m)``: compile the step at m and
    return the measured peak of a step (with its running sums). Raises MemoryError when even
    one example at a time does not fit."""
    c = AutoChoice(budget, max_size)
    c.eager = {m: eager_peak(m) for m in (1, 2)}
    slope = max(c.eager[2] - c.eager[1], 1)
    base = c.eager[1] - slope + sums_bytes
    if c.eager[1] + sums_bytes > budget:
        one = compile_and_measure(1)  # eager over-estimates: the compiled step may still fit
        c.predicted[1], c.measured[1] = c.eager[1] + sums_bytes, one
        if one > budget:
            raise MemoryError(f"fxmem clipped_grad: memory_budget {budget} bytes is below the peak of one "
                              f"example at a time ({one} bytes measured); the smallest feasible budget is {one}")
        c.chosen = 1
        return c
    m = _fit(budget, base, slope, max_size)
    c.predicted[m] = int(base + slope * m)
    c.measured[m] = compile_and_measure(m)
    if c.measured[m] > budget or (c.measured[m] < (1 - TOLERANCE) * budget and m < max_size):
        slope_c = max(c.measured[m] / m, 1.0)
        m2 = _fit(budget, 0, slope_c, max_size)
        if m2 != m:
            c.predicted[m2] = int(slope_c * m2)
            c.measured[m2] = compile_and_measure(m2)
    fits = [k for k, v in c.measured.items() if v <= budget]
    c.chosen = max(fits) if fits else min(c.measured)
    return c
