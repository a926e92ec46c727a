"""The ghost pass as the chunk compile calls it (:class:`Pass`), and the compiled chunk with its
non-finite fallback (:class:`Guarded`)."""
from __future__ import annotations

import logging
from typing import Callable

import torch
import torch.fx as fx

from ...fallback import stage_failed
from ...graph.module import graph_module
from .rewrite import Decision, rewrite

log = logging.getLogger("fxmem")


def _all_finite(outs) -> bool:
    """Whether every floating output is finite, checked through its sum (in float32 or wider): a
    non-finite element always makes the sum non-finite (inf + x = inf, inf - inf = nan, nan
    propagates), so no non-finite output passes; a finite output whose sum overflows would only
    cost a needless fallback. One reduction per output, ~15x cheaper than ``isfinite(o).all()``
    (which allocates a bool tensor the size of every clipped sum, on every chunk)."""
    sums = [o.sum(dtype=torch.promote_types(o.dtype, torch.float32)) for o in outs
            if isinstance(o, torch.Tensor) and o.is_floating_point()]
    return not sums or bool(torch.stack(sums).isfinite().all())


class Guarded:
    """A ghost-rewritten chunk: runs it, and if any floating output is not finite, reruns the
    chunk with the materialized per-example gradients (compiled on first need)."""

    def __init__(self, fn: Callable, decisions: list[Decision], recompile: Callable[[list], Callable]):
        self.fn, self.decisions, self._recompile = fn, decisions, recompile
        self._fallback: Callable | None = None
        self.fallbacks = 0

    def __call__(self, *args):
        outs = self.fn(*args)
        if _all_finite(outs):
            return outs
        if self._fallback is None:
            log.warning("fxmem ghost clipping: non-finite values in a chunk; rerunning it with "
                        "materialized per-example gradients (nan_to_num semantics)")
            self._fallback = self._recompile(list(args))
        self.fallbacks += 1
        del outs
        return self._fallback(*args)


class Pass:
    """The hook the chunk compile calls: ``Pass(options, chunk_gm)(flat_gm)`` rewrites the flat
    graph (a no-op when ``options.ghost_clipping`` is off) and keeps the decisions;
    ``guard(fn, recompile)`` wraps the compiled chunk when anything was rewritten. A rewrite that
    fails goes through the failure policy (stage ``"ghost"``): ``strict`` raises, otherwise one
    warning and the graph as it was (every per-example gradient materialized)."""

    def __init__(self, options, gm: fx.GraphModule | None = None):
        self.options = options
        self.enabled = bool(getattr(options, "ghost_clipping", False))
        self.decisions: list[Decision] = []
        self.names = [n.name for n in gm.graph.nodes if n.op == "placeholder"] if gm is not None else None

    def __call__(self, flat: fx.GraphModule) -> fx.GraphModule:
        if not self.enabled:
            return flat
        # rewrite a copy: a failure leaves the graph as it was (correct, unchanged)
        graph = fx.Graph()
        out = graph.graph_copy(flat.graph, {})
        graph.output(out)
        copy = graph_module(flat, graph)
        try:
            self.decisions = rewrite(copy, self.names)
        except Exception as e:  # noqa: BLE001 - the failure policy decides
            self.decisions = []
            stage_failed("ghost", e, self.options)
            return flat
        return copy if any(d.choice == "ghost" for d in self.decisions) else flat

    def guard(self, fn: Callable, recompile: Callable[[list], Callable]) -> Callable:
        if not any(d.choice == "ghost" for d in self.decisions):
            return fn
        return Guarded(fn, self.decisions, recompile)
