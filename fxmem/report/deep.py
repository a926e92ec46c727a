"""Plans of models too deep to trace in full: plan two depths, extrapolate to the real one.

A model of identical layers has a step peak affine in the layer count: each layer adds its
parameters, their gradients and what the plan keeps at its boundary, while the working set of
one layer's backward and of the loss stays the same. ``explain_layers`` builds the model at two
small depths (``probes``), explains each, and answers for ``layers`` by the line through them:
tracing cost grows with the probes, not with the model (a Llama-7B config on the meta device is
planned from 2 and 3 layers; ``fxmem.explain_layers`` builds it). tests/test_realistic.py checks
the line against a real compile.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable

from ..options import parse_bytes
from .memory import MemoryReport
from .model import batch_peak, largest_batch


@dataclass(frozen=True)
class LayerScaledReport:
    layers: int
    probes: tuple[tuple[int, MemoryReport], tuple[int, MemoryReport]]  # (depth, its report), shallow first

    def _line(self, f: Callable[[MemoryReport], int]) -> int:
        (a, ra), (b, rb) = self.probes
        return _through(a, f(ra), b, f(rb), self.layers)

    def predict_peak(self, **shapes: Any) -> int:
        """The step's predicted peak at ``layers`` (see ``MemoryReport.predict_peak``).

        Each probe's plan was chosen at the planned shape; at another shape its formulas are
        that plan's, and two probes' plans (level 1's least peak) may grow differently with the
        batch, even so that the deeper one grows slower. A layer never adds less to the step
        than it does at the planned shape, so the line's slope is at least that one there."""
        (a, ra), (b, rb) = self.probes
        fa, fb = ra.predict_peak(**shapes), rb.predict_peak(**shapes)
        return _through(a, fa, b, fa + max(fb - fa, self._planned_slope), self.layers)

    @cached_property
    def _planned_slope(self) -> int:
        """The deeper probe's peak above the shallower one's, both at the planned shape."""
        (_, ra), (_, rb) = self.probes
        return rb.predict_peak() - ra.predict_peak()

    def host_bytes(self, **shapes: Any) -> int:
        """Host bytes the step holds at ``layers`` (``offload``; see ``MemoryReport.host_bytes``)."""
        return self._line(lambda r: r.host_bytes(**shapes))

    def resident_bytes(self, optimizer: str | float | None = None) -> int:
        """Parameters, buffers and optimizer state at ``layers`` (see ``MemoryReport.resident_bytes``)."""
        return self._line(lambda r: r.resident_bytes(optimizer))

    def max_batch(self, cap: int | str, limit: int = 1 << 20, optimizer: str | float | None = None,
                  **shapes: Any) -> int:
        """The largest batch whose step fits in ``cap`` beside the model (see ``MemoryReport.max_batch``)."""
        cap_bytes, state = parse_bytes(cap, "cap"), self.resident_bytes(optimizer)
        (a, ra), (b, rb) = self.probes
        pa, pb = batch_peak(ra._graph(), shapes), batch_peak(rb._graph(), shapes)

        def fits(n: int) -> bool:
            fa = pa(n)
            return state + _through(a, fa, b, fa + max(pb(n) - fa, self._planned_slope), self.layers) <= cap_bytes

        return largest_batch(fits, limit)

    def peak_breakdown(self, **shapes: Any) -> dict:
        """What is alive at the predicted peak of the deeper probe (``MemoryReport.peak_breakdown``),
        its ``"peak"`` extrapolated to ``layers``; ``"layers"``: the probe's depth."""
        (_, _), (b, rb) = self.probes
        return {**rb.peak_breakdown(**shapes), "peak": self.predict_peak(**shapes), "layers": b}

    def owners(self) -> dict[str, str]:
        """Scheduled value name -> module that made it, in the deeper probe."""
        return self.probes[1][1]._graph().owners

    def __str__(self) -> str:
        (a, ra), (b, rb) = self.probes
        g = rb._graph()
        shape = ", ".join(f"{n} = {g.values[s]}" for s, n in g.symbols.items()) or "the compiled shape"
        peak = self.predict_peak()
        return (f"fxmem plan of {self.layers} layers, extrapolated from {a} and {b}: predicted step peak "
                f"{peak:,} bytes ({peak / 2**30:.2f} GiB) at {shape}; parameters and buffers "
                f"{self.resident_bytes():,} bytes\n\nthe plan of {b} layers:\n{rb}")


def _through(a: int, fa: int, b: int, fb: int, x: int) -> int:
    """The line through (a, fa) and (b, fb), at x (exact integers)."""
    return fa + ((fb - fa) * (x - a)) // (b - a)
