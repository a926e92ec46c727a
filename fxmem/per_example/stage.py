"""The per-example stage of the backend: a graph with a ``vmap(grad(...))`` region becomes a
chunked step (``options={"microbatch_size": m | "auto"}``, or one chunk for ghost clipping).

    stage = PerExampleStage(comp)              # once per compile: the chunk compiler, from the options
    chunked = stage(gm, example_inputs)        # a ChunkedStep, or None: nothing to chunk

The stage finds the region (``regions.py``), proves what follows it per example or a batch sum
and splits the graph (``chunk.py``), and hands the chunk graphs to its :class:`ChunkCompiler`,
which compiles them when the chunked step (``run.py``) first runs at a size: the same path from
lowering on as a whole graph (lowering, AOTAutograd's flat graph with ghost norms, the recompute
plan of its inner backward, the inner compiler, the report). A failure goes through the failure
policy (``fxmem/fallback.py``: the graph runs unchunked with one warning, ``strict`` raises).
The stage decides the compile's per-example plan (``plan.py``: a frozen ``ChunkPlan``, written
to ``Compilation.chunk_plan`` by ``plan.record_plan``/``update_plan`` only, with the ghost
decisions of its chunk graphs) and publishes each chunk graph's report.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import TYPE_CHECKING, Callable, Mapping

import torch
import torch.fx as fx

from .. import inner, lowering
from ..fallback import stage_failed
from ..remat.partition import Partitioner
from ..remat.settings import PlanSettings
from ..report.publish import publish
from ..warn import warn
from .chunk import split_region
from .flat import plan_flat
from .ghost import Pass as GhostPass
from .microbatch import auto_budget
from .plan import ChunkPlan, record_plan, update_plan
from .regions import Unsupported, find_regions
from .run import ChunkedStep

if TYPE_CHECKING:
    from ..compilation import Compilation
    from ..options import Options

__all__ = ["ChunkCompiler", "PerExampleStage", "chunk_lowering", "compile_chunk"]

log = logging.getLogger("fxmem")


def chunk_lowering(opts: Options) -> bool | Mapping[str, bool]:
    """The lowering of a per-example chunk graph: with ghost clipping, the fused cross-entropy
    computes the output projection's per-example weight gradient itself, so it would be
    materialized instead of getting a ghost norm; the pattern is lowered there only when asked
    for (``lowering=True``, or the dict names it), not by a dict that leaves it out (the default)."""
    name = "fused_linear_cross_entropy"
    if not opts.ghost_clipping or isinstance(opts.lowering, bool) or name in opts.lowering:
        return opts.lowering
    return MappingProxyType({**opts.lowering, name: False})


@dataclass(frozen=True)
class ChunkCompiler:
    """How this compile's chunk graphs are compiled, derived once from its options: the lowering
    (:func:`chunk_lowering`), the inner compiler, ghost clipping, and the record their reports go
    to. ``compiler(gm, inputs, measure=False)``: ``measure=True`` compiles with the eager inner
    compiler, for measuring a chunk's peak while ``"auto"`` chooses the size."""
    record: Compilation
    lowering: bool | Mapping[str, bool]
    inner: str
    ghost: bool

    @classmethod
    def of(cls, record: Compilation) -> ChunkCompiler:
        opts = record.options
        return cls(record, chunk_lowering(opts), opts.inner, opts.ghost_clipping)

    def __call__(self, gm: fx.GraphModule, example_inputs: list, measure: bool = False) -> Callable:
        return compile_chunk(gm, example_inputs, self, "eager" if measure else self.inner, self.ghost)


def compile_chunk(gm: fx.GraphModule, example_inputs: list, compiler: ChunkCompiler, inner_name: str,
                  ghost: bool) -> Callable:
    """A per-example chunk graph: lowering, then AOTAutograd's flat graph with ghost norms
    (``ghost``) and the recompute plan of its inner backward, the inner compiler, the record.
    In a chunked graph ``memory_budget`` caps the whole step (it chooses the microbatch size), so
    the inner planner gets the level and rules only. Where a ghost norm cannot serve a call, the
    chunk is compiled again without ghost norms."""
    record = compiler.record
    gm, lowered = lowering.lower(gm, example_inputs, compiler.lowering)
    partitioner = Partitioner(PlanSettings.of(record.options, inner=inner_name, budgets=False,
                                              plan_shape=record.plan_shape))
    ghost_pass = GhostPass(record.options if ghost else None, gm)  # None: ghost clipping off
    compiled = inner.compile_flat(gm, example_inputs, inner_name, lambda g: plan_flat(g, partitioner),
                                  rewrite=ghost_pass if ghost_pass.enabled else None,
                                  config=record.options.inductor_config())
    if ghost_pass.decisions:
        update_plan(record, ghost=ghost_pass.decisions)
    publish(record, partitioner.planned, lowered)
    return ghost_pass.guard(compiled, lambda ins: compile_chunk(gm, ins, compiler, inner_name, False))


class PerExampleStage:
    """The per-example stage of one compile (see the module docstring): built once from the
    compile's record (its options), called once on the graph."""

    def __init__(self, record: Compilation):
        self.record = record
        self.options: Options = record.options
        self.compiler = ChunkCompiler.of(record)

    def __call__(self, gm: fx.GraphModule, example_inputs: list) -> Callable | None:
        """The chunked step when the graph has a per-example region to chunk, else None (also
        when the stage fails, outside ``strict``: the failure policy warns once)."""
        try:
            chunked = self._chunked(gm, example_inputs)
        except Exception as e:  # noqa: BLE001 - the failure policy decides
            stage_failed("per_example", e, self.options)
            return None
        log.debug("fxmem per-example: %s", "the graph runs in chunks" if chunked else "nothing to chunk")
        return chunked

    def _chunked(self, gm: fx.GraphModule, example_inputs: list) -> Callable | None:
        """A chunked runner for ``gm``, or None when there is nothing to chunk. The record gets
        the plan whenever the graph has a vmap region (chunked or not: the plan says why). When
        the graph cannot be proven chunkable it warns with the reason and returns None
        (unchunked, correct), or raises under ``strict``. With ``microbatch_size`` unset the
        whole batch is one chunk when ``ghost_clipping`` is on (so the ghost rewrite applies),
        and an unprovable graph is left alone quietly: nobody asked for chunking."""
        options = self.options
        whole_batch = options.microbatch_size is None
        if whole_batch and not options.ghost_clipping:
            return None
        plan = ChunkPlan(0, requested=options.microbatch_size)
        found = False  # a region was found: the record gets the plan, whatever follows
        try:
            regions = find_regions(gm.graph)
            if not regions:
                return None
            found = True
            batch = regions[0].batch_size
            plan = replace(plan, batch_size=batch if isinstance(batch, int) else _hint(batch))
            if len(regions) > 1:
                raise Unsupported(f"{len(regions)} vmap regions in one graph; only one is chunked")
            if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad
                                               for t in example_inputs):
                raise Unsupported("inputs require grad and grad mode is on: the chunked step has no "
                                  "outer backward; call it under torch.no_grad() or detach the inputs")
            if options.microbatch_size == "auto":
                plan = replace(plan, memory_budget=auto_budget(options.memory_budget))
            elif not whole_batch:
                plan = replace(plan, microbatch_size=options.microbatch_size)
            plan = replace(plan, whole_batch=whole_batch)
            parts = split_region(gm, regions[0])
            plan = replace(plan, fused_sums=parts.fused_sums)
        except Unsupported as e:
            if options.strict and not whole_batch:  # strict: what was asked for must happen; nothing was
                raise
            found, plan = True, replace(plan, reason=str(e))
            if whole_batch:
                log.debug("fxmem per-example: no ghost clipping for this graph: %s", e)
            else:
                warn(f"fxmem per-example: not chunking this graph: {e}", detail=str(e))
            return None
        finally:
            if found:
                record_plan(self.record, plan)
        return ChunkedStep(parts, plan, self.compiler, self.record)


def _hint(node: fx.Node) -> int:
    """The batch size a dynamic graph was traced at (for the report)."""
    val = node.meta.get("example_value")
    return int(val.node.hint) if isinstance(val, torch.SymInt) and val.node.hint is not None else 0
