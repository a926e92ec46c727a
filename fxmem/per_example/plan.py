"""The per-example plan of one graph (``Compilation.chunk_plan``): a frozen value, and the one
place that writes it to the compile's record.

    plan = ChunkPlan(batch, requested=..., microbatch_size=m)  # the stage, at compile time
    record_plan(record, plan)                                  # the record holds it
    update_plan(record, ghost=decisions)                       # later decisions: a new value

The stage decides the plan when it compiles; a few decisions come later, when the chunked step
first runs (``microbatch_size="auto"``'s size and measured peaks, the chunk graph's fused norms,
its ghost-norm decisions). Each is recorded as a new plan replacing the old one, never by
changing a plan: a plan a reader holds stays as it was. The run-time state (the chosen size,
the compiled chunk functions, the running sums, the search in progress) lives on the chunked
step (``run.py``) and in ``microbatch.py``'s objects, not here.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping, Protocol

from .microbatch import line_peak

__all__ = ["ChunkPlan", "record_plan", "update_plan"]


@dataclass(frozen=True)
class ChunkPlan:
    """What the per-example pass decided for one graph (``Compilation.chunk_plan``)."""
    batch_size: int
    microbatch_size: int | None = None
    requested: Any = None                      # the microbatch_size option
    memory_budget: int | None = None
    measured: Mapping[int, int] = field(default_factory=lambda: MappingProxyType({}))  # m -> step peak
    fused_sums: int = 0                        # clip-weighted batch sums done as matvecs
    fused_norms: int = 0                       # global norms taken without concatenating
    reason: str | None = None                  # why the graph was not chunked
    whole_batch: bool = False                  # microbatch_size unset: one chunk (for ghost clipping)
    ghost: list = field(default_factory=list)  # ghost.Decision per weight gradient (never changed in place)

    @property
    def chunked(self) -> bool:
        return self.reason is None

    def predicted_peak(self, m: int) -> int | None:
        """``"auto"``'s step peak at m: measured, or on the line through the nearest measurements
        (None when nothing was measured)."""
        return line_peak(self.measured, m) if self.measured else None

    def summary(self) -> dict:
        """Plain data for reports and JSON."""
        return dict(batch_size=self.batch_size, microbatch_size=self.microbatch_size,
                    requested=self.requested, memory_budget=self.memory_budget,
                    measured={int(k): int(v) for k, v in self.measured.items()},
                    fused_sums=self.fused_sums, fused_norms=self.fused_norms,
                    chunked=self.chunked, reason=self.reason, whole_batch=self.whole_batch,
                    ghost=[d.summary() for d in self.ghost])


class Record(Protocol):
    """Where a plan is recorded: ``fxmem.compilation.Compilation`` (named by its one attribute
    here, since ``compilation.py`` imports this module)."""
    chunk_plan: ChunkPlan | None


def record_plan(record: Record, plan: ChunkPlan) -> ChunkPlan:
    """Make ``plan`` the record's per-example plan; returns it."""
    record.chunk_plan = plan
    return plan


def update_plan(record: Record, **changes: Any) -> ChunkPlan | None:
    """Record a decision taken after the compile (``measured``, ``microbatch_size``,
    ``fused_norms``, ``ghost``) as a new plan replacing the record's; nothing when the record has
    no plan (the graph had no per-example region). Mappings and lists are copied, so that the
    recorded plan shares nothing that its writer goes on changing."""
    if record.chunk_plan is None:
        return None
    if "measured" in changes:
        changes["measured"] = MappingProxyType(dict(changes["measured"]))
    if "ghost" in changes:
        changes["ghost"] = list(changes["ghost"])
    return record_plan(record, dataclasses.replace(record.chunk_plan, **changes))
