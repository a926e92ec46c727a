"""What the planner is asked for, derived once from the options: :class:`PlanSettings` (the level,
the rules, one budget, strictness, the plan shape) and the :class:`Target` it plans for (the inner
compiler's memory model, as an object: the planner never reads ``options.inner``).

The backend derives one :class:`PlanSettings` per compile (a per-example chunk graph's without
budgets: there ``memory_budget`` chooses the microbatch size) and passes it down unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

import torch.fx as fx

from ..graph.reuse import reuse_dead_buffers, scatter_candidates, write_candidates
from ..options import Options, Rule
from .fences import for_inductor, random_in_order
from .split import Split


@dataclass(frozen=True)
class Target:
    """The inner compiler's memory model. ``reuses_buffers``: elementwise ops write into a dead
    intermediate (the eager inner compiler's ``reuse_dead_buffers``; Inductor reuses buffers by
    its own rules): the simulator counts that reuse. ``input_views``: the forward may hand views
    of its inputs to the backward (Inductor: not, ``split.input_view_bases``). :meth:`finish`
    turns a split into the graphs the inner compiler gets. ``exact_peak``: the simulated peak
    is what runs (Inductor: not; it fuses ops the simulator allocates, :func:`~.plan.plan`)."""
    name: str
    reuses_buffers: bool
    input_views: bool
    exact_peak: bool
    # ``reuses_buffers`` off, an accumulating scatter still writes into a summand that dies there
    # (Inductor re-inplaces it): the tied embedding's gradient scattered into the head's
    # (``fences.scatter_into_sums``, applied to the joint graph before planning)
    inplace_scatters: bool = False

    def writes(self) -> Callable[[fx.Node], list] | None:
        """Which arguments an op may write its result into (``graph.reuse``) as this inner compiler
        runs it, for the step simulator; None: none."""
        return write_candidates if self.reuses_buffers else scatter_candidates if self.inplace_scatters else None

    def finish(self, split: Split, memory_first: bool = False) -> tuple[fx.GraphModule, fx.GraphModule]:
        """The forward and backward graphs for the inner compiler. Eager: the split's own graphs
        with dead buffers reused in place (what runs is what the report reads). Inductor: the
        backward copied with its fences (``remat.fences``: recomputation runs where it is needed;
        weight gradients where the plan put them only where ``memory_first``), the forward copied
        with its random ops in order where it has several."""
        if self.reuses_buffers:
            reuse_dead_buffers(split.fw)
            reuse_dead_buffers(split.bw)
            return split.fw, split.bw
        # a reload runs where the split put it, as a recompute entry does
        late = {n.name for n in (*split.recomputed, *split.offloaded)}
        return random_in_order(split.fw), for_inductor(split.bw, late, weight_gradients=memory_first)


EAGER = Target("eager", reuses_buffers=True, input_views=True, exact_peak=True)
INDUCTOR = Target("inductor", reuses_buffers=False, input_views=False, exact_peak=False, inplace_scatters=True)
TARGETS = {t.name: t for t in (EAGER, INDUCTOR)}


@dataclass(frozen=True)
class PlanSettings:
    """The planner's settings (see :class:`fxmem.options.Options` for each)."""
    level: int = 0
    config: tuple[Rule, ...] = ()
    memory_budget: int | float | None = None
    peak_budget: int | None = None
    strict: bool = False
    plan_shape: Mapping[str, tuple[int, ...]] | None = None
    target: Target = INDUCTOR
    # graph inputs whose gradient the optimizer takes where it is made (``step_in_backward``)
    in_backward: frozenset[int] = frozenset()
    offload: bool = False  # saved values may go to host memory (``remat.offload``)
    # Dynamo compiled the graph at a graph break: its frame goes on after it, so more of the step
    # runs while what it keeps is alive (``GraphCompileReason.graph_break``; not at a frame's return)
    continued: bool = False

    @classmethod
    def of(cls, options: Options, *, inner: str | None = None, budgets: bool = True,
           fit_budget: int | None = None, plan_shape: Mapping[str, tuple[int, ...]] | None = None,
           continued: bool = False) -> "PlanSettings":
        """``options``' settings; ``inner`` where a stage plans for another target;
        ``budgets=False`` leaves the budgets out (a per-example chunk graph); ``fit_budget``: the
        ``peak_budget`` that the ``fit`` option leaves for this graph (:func:`fxmem.fit.peak_budget`);
        ``plan_shape``: ``options.plan_shape`` in the graph's input names (``graph.sizes.check_plan_shape``);
        ``continued``: the graph was compiled at a graph break (``backend.continued``)."""
        peak = fit_budget if options.fit is not None else options.peak_budget
        shape = options.plan_shape if plan_shape is None else plan_shape
        return cls(options.level, options.config, options.memory_budget if budgets else None,
                   peak if budgets else None, options.strict, shape, TARGETS[inner or options.inner],
                   offload=options.offload and budgets, continued=continued)

    @property
    def budgeted(self) -> bool:
        return self.memory_budget is not None or self.peak_budget is not None

    @property
    def memory_first(self) -> bool:
        """Memory over speed: level >= 1, a budget or offload (``Options.memory_first``)."""
        return self.level >= 1 or self.budgeted or self.offload

    def key(self) -> str:
        """A stable string of every setting: goes into Inductor's cache key."""
        return repr((self.level, self.config, self.memory_budget, self.peak_budget, self.strict,
                     None if self.plan_shape is None else sorted(self.plan_shape.items()), self.target.name,
                     sorted(self.in_backward), self.offload, self.continued))
