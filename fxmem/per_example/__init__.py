"""Per-example (``vmap(grad(...))``) regions: find them, prove what follows them is per example
or a batch sum, and run them in microbatches (``options={"microbatch_size": m | "auto"}``, ``microbatch.py``)."""
from __future__ import annotations

import logging
from typing import Callable

import torch
import torch.fx as fx

from ..warn import warn
from .chunk import split_region
from .flat import Ghost, plan_flat
from .microbatch import auto_budget
from .regions import Unsupported, find_regions
from .run import ChunkedStep, ChunkPlan

__all__ = ["ChunkPlan", "Ghost", "Unsupported", "compile_chunked", "plan_flat"]

log = logging.getLogger("fxmem")


def compile_chunked(gm: fx.GraphModule, example_inputs: list, options, compile_chunk: Callable,
                    decided: Callable[[ChunkPlan], None]) -> Callable | None:
    """A chunked runner for ``gm``, or None when there is nothing to chunk. ``decided`` receives
    the plan whenever the graph has a vmap region (chunked or not: the plan says why). When the
    graph cannot be proven chunkable it warns with the reason and returns None (unchunked,
    correct), or raises under ``strict``. With ``microbatch_size`` unset the whole batch is one
    chunk when ``ghost_clipping`` is on (so the ghost rewrite applies), and an unprovable graph
    is left alone quietly: nobody asked for chunking. ``compile_chunk(gm, inputs, measure=False)``
    compiles the chunk graphs (see :class:`ChunkedStep`)."""
    whole_batch = options.microbatch_size is None
    if whole_batch and not options.ghost_clipping:
        return None
    regions = None
    plan = ChunkPlan(0, requested=options.microbatch_size)
    try:
        regions = find_regions(gm.graph)
        if not regions:
            return None
        decided(plan)
        batch = regions[0].batch_size
        plan.batch_size = batch if isinstance(batch, int) else _hint(batch)
        if len(regions) > 1:
            raise Unsupported(f"{len(regions)} vmap regions in one graph; only one is chunked")
        if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad
                                           for t in example_inputs):
            raise Unsupported("inputs require grad and grad mode is on: the chunked step has no "
                              "outer backward; call it under torch.no_grad() or detach the inputs")
        if options.microbatch_size == "auto":
            plan.memory_budget = auto_budget(options.memory_budget)
        elif not whole_batch:
            plan.microbatch_size = options.microbatch_size
        plan.whole_batch = whole_batch
        parts = split_region(gm, regions[0])
        plan.fused_sums = parts.fused_sums
    except Unsupported as e:
        if options.strict and not whole_batch:  # strict: what was asked for must happen; nothing was
            raise
        if not regions:
            decided(plan)
        plan.reason = str(e)
        if whole_batch:
            log.debug("fxmem per-example: no ghost clipping for this graph: %s", e)
        else:
            warn(f"fxmem per-example: not chunking this graph: {e}", detail=str(e))
        return None
    return ChunkedStep(parts, plan, compile_chunk)


def _hint(node: fx.Node) -> int:
    """The batch size a dynamic graph was traced at (for the report)."""
    val = node.meta.get("example_value")
    return int(val.node.hint) if isinstance(val, torch.SymInt) and val.node.hint is not None else 0
