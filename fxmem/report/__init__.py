"""Memory reports: what fxmem kept and recomputed, savings as formulas, predicted peaks.

    rep = fxmem.report(compiled)     # every graph fxmem compiled for it, latest last
    print(rep); rep.to_json("mem.json"); rep.predict_peak(input_ids=(64, 2048))
    rep.max_batch("24GB", seq=2048); rep.plot("pareto.png")
"""

from __future__ import annotations

from typing import Any, Mapping

from .model import ClusterRow, GraphReport, LoweringRow, MemoryReport

__all__ = ["ClusterRow", "GraphReport", "LoweringRow", "MemoryReport", "report", "explain"]


def report(compiled: Any = None) -> MemoryReport:
    """The report of every graph fxmem compiled for ``compiled`` (a ``torch.compile``d module,
    or the module itself); with no argument, of every graph compiled in this process."""
    from dataclasses import asdict

    from ..backend import COMPILES
    from ..lowering import UNPLANNED
    from ..per_example import PLANS

    records = [r for p in COMPILES for r in p.records]
    chunk_plans = list(PLANS)
    unplanned = list(UNPLANNED)
    if compiled is not None:
        module = getattr(compiled, "_orig_mod", compiled)
        params = getattr(module, "parameters", None)
        ids = {id(t) for t in params()} if callable(params) else set()
        records = [r for r in records if r.input_ids & ids] if ids else records
        chunk_plans = [p for p in chunk_plans if p.input_ids & ids] if ids else chunk_plans
        unplanned = [u for u in unplanned if u.input_ids & ids] if ids else unplanned
    return MemoryReport([r.report for r in records], [r.plan for r in records],
                        [p.summary() for p in chunk_plans],
                        [{"rows": [asdict(r) for r in u.rows()], "notes": u.notes()} for u in unplanned])


def explain(model: Any, options: Mapping[str, Any] | None = None, **batch: Any) -> MemoryReport:
    """Compile ``model`` with fxmem (``dynamic=True``), run one training step, return its report."""
    import torch

    compiled = torch.compile(model, backend="fxmem", dynamic=True, options=dict(options or {}))
    out = compiled(**batch)
    loss = getattr(out, "loss", out)
    if not (isinstance(loss, torch.Tensor) and loss.numel() == 1):
        raise ValueError("explain: the model's output (or its .loss) must be a scalar loss tensor")
    loss.backward()
    return report(compiled)
