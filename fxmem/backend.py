"""The ``fxmem`` torch.compile backend, stage by stage.

    Dynamo graph ─► options ─► per-example regions (vmap(grad) → chunked step) ─► pattern lowering
        ─► AOTAutograd joint graph ─► symbolic sizes ─► recompute plan (min-cut) ─► fw/bw split
        ─► inner compiler (eager | Inductor) ─► reports, on the compile's Compilation record

A per-example region's chunk graphs take the same path from pattern lowering on
(:func:`_compile_chunk`), when the chunked step first runs at a size.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any, Callable, Mapping

import torch
import torch.fx as fx

from . import fit, inner, lowering, per_example
from .compilation import Compilation, Compiled, as_requested
from .fallback import is_failure, stage_failed
from .graph.sizes import check_plan_shape, model_state_bytes, static_dims
from .graph_breaks import ignore_once_warnings
from .inputs import Inputs
from .options import OptionError, Options, resolve
from .remat.budget import BudgetError
from .remat.partition import Partitioner
from .report import graph_peak, publish

log = logging.getLogger("fxmem")


def fxmem_backend(gm: fx.GraphModule, example_inputs: list[Any],
                  options: Mapping[str, Any] | Options | None = None, **kwargs: Any):
    """``torch.compile(model, backend="fxmem", options={...})``."""
    opts = _options(options, kwargs)
    check_plan_shape(gm, opts.plan_shape)
    ignore_once_warnings()  # for the next graphs Dynamo traces (register() did it at import)
    log.debug("fxmem: compiling a graph of %d nodes (level %d, inner %s)", len(gm.graph.nodes), opts.level, opts.inner)
    state = model_state_bytes(gm)
    opts = fit.derive(opts, state)  # options={"fit": ...}: the step's peak_budget on this device (fxmem/fit.py)
    comp = Compilation(opts, Inputs(example_inputs), _compile_id(), static_dims(gm), state,
                       requested=as_requested(options))
    compiled = _per_example(gm, example_inputs, comp) or _whole(gm, example_inputs, comp)
    return Compiled(compiled, comp)


def _options(options: Mapping[str, Any] | Options | None, kwargs: Mapping[str, Any]) -> Options:
    if kwargs:
        raise ValueError(f"fxmem backend: unexpected arguments {sorted(kwargs)}; pass settings as options={{...}}")
    try:
        return resolve(options)
    except ValueError as e:
        raise OptionError(str(e)) from None


def _per_example(gm: fx.GraphModule, example_inputs: list[Any], comp: Compilation) -> Callable | None:
    """The chunked step when the graph has a per-example region to chunk, else None."""
    def compile_chunk(g: fx.GraphModule, ins: list, measure: bool = False) -> Callable:
        opts = replace(comp.options, inner="eager") if measure else comp.options
        return _compile_chunk(g, ins, comp, opts)

    def decided(plan: per_example.ChunkPlan) -> None:
        comp.chunk_plan = plan

    try:
        chunked = per_example.compile_chunked(gm, example_inputs, comp.options, compile_chunk, decided)
    except Exception as e:  # noqa: BLE001 - the failure policy decides
        stage_failed("per_example", e, comp.options)
        return None
    log.debug("fxmem per-example: %s", "the graph runs in chunks" if chunked else "nothing to chunk")
    return chunked


def _whole(gm: fx.GraphModule, example_inputs: list[Any], comp: Compilation) -> Callable:
    """Lowering, AOTAutograd with fxmem's partitioner, the inner compiler, the reports."""
    opts = comp.options
    try:
        lowered_gm, lowered, trial = _lower(gm, example_inputs, opts)
        log.debug("fxmem lowering: %d patterns lowered, %d skipped", len(lowered.lowered), len(lowered.skipped))
        if trial is not None and opts.inner == "eager":  # the comparison compiled this very graph
            compiled, partitioner = trial.compiled, trial.partitioner
            trial.warn()
        else:
            partitioner, compiled, lowered = _compile_lowered(gm, lowered_gm, lowered, example_inputs, opts)
    except Exception as e:  # noqa: BLE001
        stage_failed("compile", e, opts)
        return inner.compile_safe(gm, example_inputs)  # the graph as Dynamo gave it: no lowering
    log.debug("fxmem compile: %s inner compiler done, %d plan(s)", opts.inner, len(partitioner.planned))
    publish(comp, partitioner.planned, lowered)
    return compiled


def _lower(gm: fx.GraphModule, example_inputs: list[Any],
           opts: Options) -> tuple[fx.GraphModule, lowering.Lowering, _Trial | None]:
    """Pattern lowering. Proven matches (they never raise the planned peak:
    :attr:`fxmem.lowering.patterns.Match.proven`) are applied as they are, futile ones (their sizes
    say they cannot lower it: :attr:`~fxmem.lowering.patterns.Match.futile`) are declined; where
    the others match,
    the graph with every match and the graph with the proven ones alone are both planned
    (AOTAutograd with the eager inner compiler, which traces and plans but runs nothing) and the
    others are kept only if they lower the peak, and plan where the proven-only graph plans (the
    report says so otherwise; a tie is declined: the fused kernels' own buffers are the
    estimate's least certain part). Returns (graph, what was lowered, the chosen graph's
    :class:`_Trial`, or None where nothing was compared)."""
    lowered_gm, lowered = lowering.lower(gm, example_inputs, opts, decline_futile=True)
    unproven = sorted({x.pattern for x in lowered.unproven()})
    if not unproven:
        return lowered_gm, lowered, None
    base_gm, _ = lowering.lower(gm, example_inputs, opts, proven_only=True, decline_futile=True)
    with_trial, without_trial = _trial(lowered_gm, example_inputs, opts), _trial(base_gm, example_inputs, opts)
    with_lowering, without = (t.peak if t is not None else None for t in (with_trial, without_trial))
    log.debug("fxmem lowering: planned peak %s bytes with %s, %s without", with_lowering, unproven, without)
    if with_lowering is None and without is not None:
        return base_gm, lowered.declined_unproven(
            "not applied: the graph with it could not be planned (e.g. a fused kernel's backward "
            "differentiated again); the graph without it could"), without_trial
    if with_lowering is not None and without is not None and with_lowering >= without:
        return base_gm, lowered.declined_unproven(f"not applied: the plan with it peaks at {with_lowering:,} bytes, "
                                                  f"not below {without:,} without it"), without_trial
    return lowered_gm, lowered, with_trial


def _compile_lowered(gm: fx.GraphModule, lowered_gm: fx.GraphModule, lowered: lowering.Lowering,
                     example_inputs: list[Any], opts: Options) -> tuple[Partitioner, Callable, lowering.Lowering]:
    """The lowered graph compiled and planned; where that fails (e.g. a fused kernel's backward
    differentiated again), the unlowered graph, with the report saying why."""
    partitioner = Partitioner(opts)
    try:
        return partitioner, inner.compile_joint(lowered_gm, example_inputs, opts.inner, partitioner), lowered
    except Exception as e:  # noqa: BLE001 - the unlowered graph may compile; if not, the failure policy decides
        if lowered_gm is gm or not is_failure(e):
            raise
        log.debug("fxmem lowering: the lowered graph failed to compile (%s: %s); compiling it unlowered",
                  type(e).__name__, e)
        why = (f"not applied: the graph with lowering could not be compiled ({type(e).__name__}); "
               "the unlowered one could")
        partitioner = Partitioner(opts)
        return partitioner, inner.compile_joint(gm, example_inputs, opts.inner, partitioner), lowered.declined(why)


@dataclass
class _Trial:
    """A graph compiled with the eager inner compiler to compare planned peaks; with the eager
    inner compiler it is the compile itself (its warnings, held back, are given when it is used)."""
    compiled: Callable
    partitioner: Partitioner
    caught: list
    peak: int | None  # the largest simulated step peak of its plans; None: nothing planned

    def warn(self) -> None:
        for w in self.caught:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


def _trial(gm: fx.GraphModule, example_inputs: list[Any], opts: Options) -> _Trial | None:
    """``gm`` compiled (eager inner compiler) and planned; None when there is no plan to compare
    (planning failed: strict here, so that the real compile alone reports a failure, once; an
    unmet budget is compared at the plan the compile falls back to)."""
    def planned(strict: bool) -> _Trial:
        partitioner = Partitioner(replace(opts, inner="eager", strict=strict))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            compiled = inner.compile_joint(gm, example_inputs, "eager", partitioner)
        peaks = [graph_peak(g) for g in partitioner.planned]
        partitioner.options = opts  # planned as asked (strict here only turns failures into errors)
        return _Trial(compiled, partitioner, caught, max(peaks) if peaks else None)

    try:
        try:
            return planned(strict=True)
        except BudgetError:  # unmet: compare the plans the real compile falls back to (least peak)
            return planned(strict=False) if not opts.strict else None
    except Exception as e:  # noqa: BLE001 - no comparison; the real compile applies the failure policy
        log.debug("fxmem lowering: could not plan a graph to compare peaks (%s: %s)", type(e).__name__, e)
        return None


def _compile_chunk(gm: fx.GraphModule, example_inputs: list, comp: Compilation, opts: Options) -> Callable:
    """A per-example chunk graph: lowering, then AOTAutograd's flat graph with ghost norms
    (``ghost_clipping``) and the recompute plan of its inner backward, the inner compiler, the
    reports. In a chunked graph ``memory_budget`` caps the whole step (it chooses the microbatch
    size), so the inner planner gets the level and rules only."""
    opts = replace(opts, memory_budget=None, peak_budget=None, lowering=_chunk_lowering(opts))
    gm, lowered = lowering.lower(gm, example_inputs, opts)
    partitioner = Partitioner(opts)
    ghost = per_example.Ghost(opts, gm)
    compiled = inner.compile_flat(gm, example_inputs, opts.inner, lambda g: per_example.plan_flat(g, partitioner),
                                  rewrite=ghost if ghost.enabled else None)
    if ghost.decisions and comp.chunk_plan is not None:
        comp.chunk_plan.ghost = ghost.decisions
    publish(comp, partitioner.planned, lowered)
    materialized = lambda ins: _compile_chunk(gm, ins, comp, replace(opts, ghost_clipping=False))  # noqa: E731
    return ghost.guard(compiled, materialized)


def _chunk_lowering(opts: Options) -> bool | Mapping[str, bool]:
    """The lowering of a per-example chunk graph: with ghost clipping, the fused cross-entropy
    computes the output projection's per-example weight gradient itself, so it would be
    materialized instead of getting a ghost norm; the pattern is lowered there only when asked
    for (``lowering=True``, or the dict names it), not by a dict that leaves it out (the default)."""
    name = "fused_linear_cross_entropy"
    if not opts.ghost_clipping or isinstance(opts.lowering, bool) or name in opts.lowering:
        return opts.lowering
    return MappingProxyType({**opts.lowering, name: False})


def _compile_id():
    """Dynamo's id of the frame being compiled (``"0/1"``, as tlparse names it), or None."""
    return torch._guards.CompileContext.current_compile_id()


def register() -> None:
    """Register ``fxmem`` with Dynamo (the entry point does this without an import) and with
    ``TORCH_LOGS`` (``TORCH_LOGS=fxmem``); keep HF's once-only warnings from breaking graphs;
    warn when Dynamo's recompile limit sends a frame fxmem compiled to eager."""
    from torch._dynamo.backends.registry import _BACKENDS, register_backend

    from .logs import register_logs
    from .recompiles import watch

    if "fxmem" not in _BACKENDS:
        register_backend(name="fxmem")(fxmem_backend)
    register_logs()
    watch(fxmem_backend)
    ignore_once_warnings()
