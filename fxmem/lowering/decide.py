"""The lowering stage's decision: which matches a graph is compiled with.

Proven matches (they never raise the planned peak: :attr:`.patterns.Match.proven`) are applied as
they are, futile ones (their sizes say they cannot lower it: :attr:`.patterns.Match.futile`) are
declined. Where others match, the graph with every match and the graph with the proven ones alone
are both traced and planned (AOTAutograd with the eager inner compiler, which runs nothing) and
the others are kept only if they lower the planned peak, and plan where the proven-only graph
plans (the report says why otherwise; a tie is declined: the fused kernels' own buffers are the
estimate's least certain part). With the eager inner compiler the chosen trial is the compile
itself (:attr:`Decision.compiled`): the graph is traced once more, not twice.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch.fx as fx

from .. import inner
from ..fallback import is_failure
from ..options import Options
from ..remat.budget import BudgetError
from ..remat.partition import Partitioner, PlannedGraph
from ..remat.settings import EAGER, PlanSettings
from . import Lowering, lower

log = logging.getLogger("fxmem")


@dataclass
class Trial:
    """A graph compiled with the eager inner compiler and planned as asked, to compare planned
    peaks; its warnings are held back and given when it is the compile used."""
    compiled: Callable
    planned: list[PlannedGraph]
    caught: list = field(repr=False)
    peak: int | None  # the largest simulated step peak of its plans; None: nothing planned

    def warn(self) -> None:
        for w in self.caught:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


@dataclass
class Decision:
    """The lowering stage's result: the graph to compile, what was lowered or left alone, and,
    where the comparison already compiled that graph as asked (eager inner compiler), that compile."""
    gm: fx.GraphModule
    lowering: Lowering
    trial: Trial | None = None


def decide(gm: fx.GraphModule, example_inputs: list[Any], options: Options, settings: PlanSettings) -> Decision:
    """The graph to compile and what was lowered; ``settings``: the planner's, for the compile."""
    lowered_gm, lowered = lower(gm, example_inputs, options.lowering, decline_futile=True)
    unproven = sorted({x.pattern for x in lowered.unproven()})
    if not unproven:
        return Decision(lowered_gm, lowered)
    base_gm, _ = lower(gm, example_inputs, options.lowering, proven_only=True, decline_futile=True)
    settings = replace(settings, target=EAGER)  # compiled with the eager inner compiler (it may be the compile)
    with_trial, without_trial = (trial(g, example_inputs, settings) for g in (lowered_gm, base_gm))
    with_lowering, without = (t.peak if t is not None else None for t in (with_trial, without_trial))
    log.debug("fxmem lowering: planned peak %s bytes with %s, %s without", with_lowering, unproven, without)
    keep = options.inner == "eager"  # the trial is the compile
    if with_lowering is None and without is not None:
        return Decision(base_gm, lowered.declined_unproven(
            "not applied: the graph with it could not be planned (e.g. a fused kernel's backward "
            "differentiated again); the graph without it could"), without_trial if keep else None)
    if with_lowering is not None and without is not None and with_lowering >= without:
        return Decision(base_gm, lowered.declined_unproven(f"not applied: the plan with it peaks at {with_lowering:,} "
                                                           f"bytes, not below {without:,} without it"),
                        without_trial if keep else None)
    return Decision(lowered_gm, lowered, with_trial if keep else None)


def trial(gm: fx.GraphModule, example_inputs: list[Any], settings: PlanSettings) -> Trial | None:
    """``gm`` compiled (eager inner compiler) and planned, in one AOT trace; None when there is no
    plan to compare: a stage failed (it raises here, so that the real compile alone applies the
    failure policy and warns, once), or a budget is unmet under ``strict`` (the real compile
    raises). Without ``strict`` an unmet budget is compared at the plan the compile falls back to
    (the least peak)."""
    partitioner = Partitioner(settings, compare=True)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            compiled = inner.compile_joint(gm, example_inputs, "eager", partitioner)
    except BudgetError:
        return None
    except Exception as e:  # noqa: BLE001 - no comparison; the real compile applies the failure policy
        if not is_failure(e):  # Dynamo's control flow (e.g. a restart to specialize a float) or the user's error
            raise
        log.debug("fxmem lowering: could not plan a graph to compare peaks (%s: %s)", type(e).__name__, e)
        return None
    peaks = [g.peak() for g in partitioner.planned]
    return Trial(compiled, partitioner.planned, caught, max(peaks) if peaks else None)
