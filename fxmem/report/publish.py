"""The backend's last stage: build each planned graph's report (once), file it on the compile's
record, and show it where the user looks (the ``fxmem`` log, ``report_path`` JSON files, the
``TORCH_TRACE`` structured trace).

A report is about the compile, not part of it: one that cannot be built or written is the
``report`` stage's failure under the failure policy (:func:`fxmem.fallback.stage_failed`: one
warning and the compile goes on; ``strict=True`` raises)."""

from __future__ import annotations

import logging
import os
import sys
from typing import TYPE_CHECKING, Callable

from ..compilation import Compilation, PlannedGraph
from ..fallback import stage_failed
from ..graph.liveness import step_peak
from ..logs import trace_plan
from .model import MemoryReport, build, report_json_path
from .render import lowering_lines, table

if TYPE_CHECKING:
    from ..lowering import Lowering

log = logging.getLogger("fxmem")


def publish(comp: Compilation, planned: list[PlannedGraph], lowered: "Lowering") -> None:
    """Add ``planned`` (the graphs one compile's partitioner planned) to ``comp`` with their
    reports; ``lowered`` is what pattern lowering did to that compile's graph. A graph compiled
    without a backward has nothing planned: its lowerings are kept on their own."""
    if not planned and (lowered.lowered or lowered.skipped):
        comp.unplanned_lowerings.append(lowered)
        _guarded(comp, lambda: _show(comp, lambda: "\n".join(["graph without a backward to plan:",
                                                              *lowering_lines(lowered.rows(), lowered.notes())])))
    for graph in planned:
        comp.graphs.append(graph)
        _guarded(comp, lambda graph=graph: _report(comp, graph, len(comp.graphs) - 1, lowered))


def _report(comp: Compilation, graph: PlannedGraph, index: int, lowered: "Lowering") -> None:
    """Build graph ``index``'s report, file it on ``graph``, show it and write it."""
    rep = build(index, comp.options.key(), graph.plan, graph.split, graph.sizes, graph.primal_names,
                lowerings=lowered.rows(), lowering_notes=lowered.notes(),
                compile_id=str(comp.compile_id or ""), static_dims=comp.static_dims,
                model_bytes=comp.model_bytes)
    graph.report = rep
    _show(comp, lambda: table(rep))
    trace_plan(lambda: MemoryReport([rep]).to_json(), comp.compile_id)
    if comp.options.report_path:
        path = report_json_path(comp.options.report_path, rep)
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        MemoryReport([rep]).to_json(path)
        log.info("fxmem: wrote the report of graph %d to %s", index, path)


def _guarded(comp: Compilation, step: Callable[[], None]) -> None:
    """Run ``step`` under the failure policy, as the ``report`` stage."""
    try:
        step()
    except Exception as e:  # noqa: BLE001 - the failure policy decides
        stage_failed("report", e, comp.options)


def graph_peak(graph: PlannedGraph) -> int:
    """The predicted step peak of one planned graph at its compiled shape (its report's
    ``predict_peak()``, from the live schedules: no report built)."""
    return step_peak(graph.split.fw, graph.split.bw, graph.sizes, graph.primal_names)


def _show(comp: Compilation, text: Callable[[], str]) -> None:
    """Log at INFO (``TORCH_LOGS=fxmem``); with ``report=True`` print it when nothing logs INFO.
    ``text`` is called only then: a table evaluates the predicted peak."""
    if log.isEnabledFor(logging.INFO):
        log.info("%s", text())
    elif comp.options.report:
        print(text(), file=sys.stderr)
