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
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable

import torch

from ..compilation import Compilation
from ..fallback import stage_failed
from ..host_memory import OFFLOAD_TAG
from ..logs import trace_plan
from ..lowering import PATTERNS
from .memory import MemoryReport
from .model import GraphReport, LoweringRow, as_events, build, report_json_path, taken
from .render import lowering_lines, table

if TYPE_CHECKING:
    from ..lowering import Lowering
    from ..remat.partition import PlannedGraph

log = logging.getLogger("fxmem")


def publish(comp: Compilation, planned: "list[PlannedGraph]", lowered: "Lowering") -> None:
    """Add ``planned`` (the graphs one compile's partitioner planned) to ``comp`` with their
    reports; ``lowered`` is what pattern lowering did to that compile's graph. A graph compiled
    without a backward has nothing planned: its lowerings are kept on their own."""
    if not planned and (lowered.lowered or lowered.skipped):
        comp.unplanned_lowerings.append(lowered)
        lines = lambda: lowering_lines(lowering_rows(lowered), lowered.notes())  # noqa: E731
        _guarded(comp, lambda: _show(comp, lambda: "\n".join(["graph without a backward to plan:", *lines()])))
    for graph in planned:
        comp.graphs.append(graph)
        _guarded(comp, lambda graph=graph: _report(comp, graph, len(comp.graphs) - 1, lowered))


def file_code(planned: "list[PlannedGraph]") -> Callable[[str, str], None]:
    """Where the inner compiler's code of the graph a partitioner planned goes (``planned`` is
    its list): onto that graph, and into its report when the report exists already (a backward
    Inductor compiles at its first run, after the record stage). Never fails the compile."""
    def on_code(kind: str, code: str) -> None:
        if not planned:
            return
        graph = planned[-1]
        graph.inner_code[kind] = code
        if graph.report is not None:
            graph.report = inner_schedules(graph.report, graph)
    return on_code


def _report(comp: Compilation, graph: "PlannedGraph", index: int, lowered: "Lowering") -> None:
    """Build graph ``index``'s report, file it on ``graph``, show it and write it."""
    rep = build(index, comp.options.key(), graph.plan, graph.split, graph.sizes, graph.primal_names,
                lowerings=lowering_rows(lowered), lowering_notes=lowered.notes(),
                compile_id=str(comp.compile_id or ""), static_dims=comp.static_dims,
                model_bytes=comp.model_bytes, in_backward=graph.in_backward.names())
    rep = graph.report = inner_schedules(rep, graph)
    _show(comp, lambda: table(rep))
    trace_plan(lambda: MemoryReport([rep]).to_json(), comp.compile_id)
    if comp.options.report_path:
        path = report_json_path(comp.options.report_path, rep)
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        MemoryReport([rep]).to_json(path)
        log.info("fxmem: wrote the report of graph %d to %s", index, path)


def lowering_rows(lowered: "Lowering") -> list[LoweringRow]:
    """The report's rows for what lowering did to one graph: one per pattern lowered, in table order."""
    rows = []
    for p in PATTERNS:
        occ = [x for x in lowered.lowered if x.pattern == p.name]
        if not occ:
            continue
        known = [x.bytes_saved for x in occ if x.bytes_saved is not None]
        notes = sorted({x.note for x in occ if x.note})
        if any(x.per_example for x in occ):
            notes.append(f"{sum(x.per_example for x in occ)} inside vmap(grad) regions")
        rows.append(LoweringRow(p.name, len(occ), sum(known) if len(known) == len(occ) else None,
                                p.replacement, notes))
    return rows


def _guarded(comp: Compilation, step: Callable[[], None]) -> None:
    """Run ``step`` under the failure policy, as the ``report`` stage."""
    try:
        step()
    except Exception as e:  # noqa: BLE001 - the failure policy decides
        stage_failed("report", e, comp.options)


def _show(comp: Compilation, text: Callable[[], str]) -> None:
    """Log at INFO (``TORCH_LOGS=fxmem``); with ``report=True`` print it when nothing logs INFO.
    ``text`` is called only then: a table evaluates the predicted peak."""
    if log.isEnabledFor(logging.INFO):
        log.info("%s", text())
    elif comp.options.report:
        print(text(), file=sys.stderr)


def inner_schedules(rep: GraphReport, graph: "PlannedGraph") -> GraphReport:
    """``rep`` with the forward's and backward's schedules the inner compiler's code states
    (``graph.inner_code``: Inductor's wrapper, read by ``graph.inductor_code``), where it is there and
    reads; else ``rep`` as it is (fxmem's simulation of the split's graphs). The crossing kept
    values and tangents follow the backward's schedule."""
    from ..graph.inductor_code import schedule
    from ..graph.scratch import scratch_bytes

    changes: dict[str, Any] = {}
    values = {x.name: v for x, v in graph.sizes.values.items()}
    fresh: list[bool] = []  # per forward output: a storage the forward allocated
    try:
        for kind, gm in (("forward", graph.split.fw), ("backward", graph.split.bw)):
            code = graph.inner_code.get(kind)
            if code is None:
                continue
            inputs = list(gm.graph.find_nodes(op="placeholder"))
            host = {n.name for n in inputs if n.meta.get(OFFLOAD_TAG)}
            counted = {n.name for n in inputs if kind == "backward" and n.name not in graph.primal_names
                       and not n.meta.get(OFFLOAD_TAG)}  # (an offloaded value: in host memory)
            if kind == "backward" and fresh:  # kept values that are the forward's copies (a weight
                saved = [n.name for n in inputs if not n.name.startswith("tangents")]  # in channels-last)
                counted |= {n for n, f in zip(saved, fresh[len(fresh) - len(saved):]) if f} - host
            dtypes = {n.name: v.dtype for n in inputs if isinstance(v := n.meta.get("val"), torch.Tensor)}
            scratch = {n.name: (str(n.target), b) for n in gm.graph.nodes
                       if n.op == "call_function" and (b := scratch_bytes(n)) != 0}
            made = {n.name: (str(n.target), n.meta.get("val")) for n in gm.graph.nodes if n.op == "call_function"}
            events, returned = schedule(code, {n: graph.sizes.nbytes(p) for p in inputs if (n := p.name) in counted},
                                        dtypes, counted, scratch, values, made)
            if kind == "forward":
                fresh = returned
            changes[kind] = [[k, n, str(e)] for k, n, e in events]
    except Exception as e:  # noqa: BLE001 - a report is about the compile, never its failure
        log.debug("fxmem report: the inner compiler's code could not be read (%s: %s); the report keeps "
                  "fxmem's simulation", type(e).__name__, e)
        return rep
    if "backward" in changes:
        after = taken(graph.split, as_events(changes["backward"]))
        changes["crossing"] = {**rep.crossing, **{k: str(v) for k, v in after.items()}}
    return replace(rep, **changes) if changes else rep
