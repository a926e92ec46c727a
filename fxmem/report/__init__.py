"""Memory reports: what fxmem kept and recomputed, savings as formulas, predicted peaks.

    rep = fxmem.report(compiled)     # every graph fxmem compiled for it, latest last
    print(rep); rep.to_json("mem.json"); rep.predict_peak(input_ids=(64, 2048))
    rep.max_batch("24GB", seq=2048); rep.plot("pareto.png")
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from ..compilation import compilations, last_step_runs
from .deep import LayerScaledReport
from .memory import MemoryReport, eager_grad_rows
from .model import ClusterRow, GraphReport, LoweringRow
from .publish import lowering_rows, publish

__all__ = ["ClusterRow", "GraphReport", "LayerScaledReport", "LoweringRow", "MemoryReport", "explain",
           "explain_layers", "publish", "report"]


def report(compiled: Any = None) -> MemoryReport:
    """The report of every graph fxmem compiled for ``compiled`` (a ``torch.compile``d module or
    function, or the module itself), oldest first; with no argument, of every graph of every live
    compile in this process. See :func:`fxmem.compilations` for how graphs are found."""
    return _report(compilations(compiled), compiled)


def _report(comps: list, compiled: Any) -> MemoryReport:
    from dataclasses import asdict

    runs = last_step_runs(comps, others=True)
    ran = [c for c, _ in runs]
    known = {id(c) for c in comps}
    comps = sorted(comps + [c for c in dict.fromkeys(ran) if id(c) not in known],  # the step's other graphs
                   key=lambda c: c.created_ns)
    graphs = [g for c in comps for g in c.graphs if g.report is not None]
    index = {id(g): i for i, g in enumerate(graphs)}
    latest = {id(c): index[id(g)] for c in comps for g in c.graphs if id(g) in index}  # its last planned graph
    step = [latest[id(c)] for c in ran if id(c) in latest]
    kept_runs = [o for c, o in runs if id(c) in latest]
    position = {o.run: k for k, o in enumerate(kept_runs)}
    lives = [[[*row[:-1], position.get(row[-1], -1)] for row in o.shares()] for o in kept_runs]
    params = {k: v for o in kept_runs for k, v in o.params.items()}
    resident = [sum(b for b, _ in params.values()), sum(b for b, t in params.values() if t)] if params else []
    names = _positional_names(compiled)
    return MemoryReport([g.report.with_names(names) for g in graphs], [g.plan for g in graphs],
                        [c.chunk_plan.summary() for c in comps if c.chunk_plan is not None],
                        [{"rows": [asdict(r) for r in lowering_rows(u)], "notes": u.notes()}
                         for c in comps for u in c.unplanned_lowerings],
                        _dynamo_unsupported(bool(comps)), step, lives, resident,
                        eager_grad_rows([o.params for o in kept_runs], [o.eager_grads for o in kept_runs],
                                        [o.viewed for o in kept_runs]))


def _dynamo_unsupported(graphs: bool) -> list[str]:
    """What Dynamo ran outside fxmem's graphs, in this process (first line, reason and hint):
    the frames it skipped when no graph reached fxmem, else its graph breaks. One place for a
    behaviour that differs between torch versions: an ``nn.LSTM`` (without
    ``torch._dynamo.config.allow_rnn``) makes torch 2.13/2.14 skip the whole frame and torch 2.15
    break the graph around it (a delayed graph break); either way the report names it."""
    from torch._dynamo.utils import counters

    out = []
    for text in counters["graph_break" if graphs else "unimplemented"]:
        lines = [ln.strip() for ln in str(text).splitlines() if ln.strip()]
        reasons = [ln.split("Reason: ", 1)[1] for ln in lines[1:] if "Reason: " in ln]
        hints = [ln for ln in lines if ln.startswith("Hint:")]
        out.append("; ".join(lines[:1] + reasons[:1] + hints[:1]))
    return out


def _positional_names(compiled: Any) -> list[str]:
    """The names of a module's ``forward`` parameters, for inputs Dynamo saw as ``args[i]``."""
    from ..graph.sizes import forward_parameters

    return forward_parameters(getattr(compiled, "_orig_mod", compiled))


def explain(model: Any, options: Mapping[str, Any] | None = None, **batch: Any) -> MemoryReport:
    """Compile ``model`` with fxmem (``dynamic=True``), run one training step, return its report.
    Warns when graph breaks split the step (each piece is planned on its own)."""
    import time

    import torch

    from ..graph_breaks import break_count, breaks_since, ignore_once_warnings
    from ..warn import warn

    ignore_once_warnings()
    breaks = break_count()
    started = time.monotonic_ns()
    compiled = torch.compile(model, backend="fxmem", dynamic=True, options=dict(options or {}))
    out = compiled(**batch)
    loss = getattr(out, "loss", out)
    if not (isinstance(loss, torch.Tensor) and loss.numel() == 1):
        raise ValueError("explain: the model's output (or its .loss) must be a scalar loss tensor")
    loss.backward()
    reasons = breaks_since(breaks)
    if reasons:
        warn(f"fxmem.explain: {len(reasons)} graph break(s) split the step into graphs planned one by one: "
             f"{reasons[0]}", RuntimeWarning, detail=f"fxmem.explain: graph breaks: {'; '.join(reasons)}")
    comps = compilations(compiled)  # a second model of a compiled class may find every cached graph:
    ran = [c for c in comps if c.called_ns >= started]  # keep those this step ran
    return _report(ran or comps, compiled)


def explain_layers(build: Callable[[int], Any], layers: int, options: Mapping[str, Any] | None = None,
                   probes: tuple[int, int] = (2, 3), progress: Callable[[int, float], None] | None = None,
                   **batch: Any) -> LayerScaledReport:
    """``fxmem.explain`` of ``build(layers)`` without tracing ``layers`` layers: ``build(k)``
    must return the model with ``k`` identical layers (on the meta device to plan what cannot
    be allocated here); each probe depth is compiled (``dynamic=True``) and stepped once.
    ``progress(depth, seconds)`` is called as each probe is planned."""
    import time

    a, b = probes
    if not (isinstance(a, int) and isinstance(b, int) and 1 <= a < b):
        raise ValueError(f"explain_layers: probes must be two depths 1 <= a < b, got {probes!r}")
    if not isinstance(layers, int) or layers < 1:
        raise ValueError(f"explain_layers: layers must be a positive int, got {layers!r}")
    reports = []
    for k in (a, b):
        started = time.monotonic()
        rep = explain(build(k), options, **batch)
        if progress is not None:
            progress(k, time.monotonic() - started)
        if len(rep.graphs) != 1:
            raise ValueError(f"explain_layers: the model of {k} layers compiled into {len(rep.graphs)} graphs; "
                             "extrapolation needs the whole step in one graph (see the graph-break warning)")
        reports.append((k, rep))
    return LayerScaledReport(layers, (reports[0], reports[1]))
