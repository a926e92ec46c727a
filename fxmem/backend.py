"""The ``fxmem`` torch.compile backend: the pipeline, one stage after another.

    options ─► per-example regions ─► lowering (decided) ─► AOT trace ─► sizes ─► plan ─► split
        ─► inner compile ─► record

:func:`fxmem_backend` is that list. AOTAutograd (or Inductor) traces the joint graph and calls
fxmem's partition function back with it, so the middle stages (joint graph, sizes, plan, split)
run inside :class:`~fxmem.remat.partition.Partitioner`, a thin adapter that calls those stage
functions in order (where the lowering left matches to compare, it plans the joint graph with and
without them, from the one trace, and splits the one of lower peak). The options are resolved
once and flow down unchanged; each stage gets the settings derived from them
(:class:`~fxmem.remat.settings.PlanSettings` for the planner). A per-example region's chunk
graphs take the same path from lowering on (:func:`_compile_chunk`), when the chunked step first
runs at a size. Each stage logs one INFO line (``TORCH_LOGS=fxmem``) with its time.
"""

from __future__ import annotations

import contextlib
import logging
import time
from types import MappingProxyType
from typing import Any, Callable, Iterator, Mapping

import torch
import torch.fx as fx

from . import fit, inner, lowering, per_example
from .compilation import Compilation, Compiled, as_requested
from .fallback import is_failure, stage_failed
from .graph.sizes import check_plan_shape, model_state_bytes, static_dims
from .graph_breaks import ignore_once_warnings
from .inputs import Inputs
from .lowering.decide import Decision, decide
from .options import OptionError, Options, resolve
from .remat.partition import Partitioner, PlannedGraph
from .remat.settings import PlanSettings
from .report import publish
from .report.publish import file_code

log = logging.getLogger("fxmem")


def fxmem_backend(gm: fx.GraphModule, example_inputs: list[Any],
                  options: Mapping[str, Any] | Options | None = None, **kwargs: Any):
    """``torch.compile(model, backend="fxmem", options={...})``."""
    opts = _options(options, kwargs)                                              # options
    plan_shape = check_plan_shape(gm, opts.plan_shape)  # in the graph's input names
    ignore_once_warnings()  # for the next graphs Dynamo traces (register() did it at import)
    state = model_state_bytes(gm)
    comp = Compilation(opts, Inputs(example_inputs), _compile_id(), static_dims(gm), state,
                       requested=as_requested(options), plan_shape=plan_shape)
    log.debug("fxmem: compiling a graph of %d nodes (level %d, inner %s)", len(gm.graph.nodes), opts.level, opts.inner)
    settings = PlanSettings.of(opts, fit_budget=fit.peak_budget(opts, state),  # the planner's, "fit" derived
                               plan_shape=plan_shape)
    with _stage("per-example"):
        chunked = _per_example(gm, example_inputs, comp)                          # per-example regions
    if chunked is not None:
        return Compiled(chunked, comp)
    try:
        with _stage("lowering"):
            decision = decide(gm, example_inputs, opts)                           # lowering (decided)
        with _stage(f"compile (AOT trace, plan, split, {opts.inner} inner compiler)"):
            compiled, planned, lowered = _compile(gm, decision, example_inputs, opts.inner, settings,
                                                   opts.inductor_config())  # AOT..
    except Exception as e:  # noqa: BLE001 - the failure policy decides
        stage_failed("compile", e, opts)
        return Compiled(inner.compile_safe(gm, example_inputs), comp)  # the graph as Dynamo gave it: no lowering
    with _stage("record"):
        publish(comp, planned, lowered)                                           # record
    return Compiled(compiled, comp)


def _compile(gm: fx.GraphModule, decision: Decision, example_inputs: list[Any], inner_name: str,
             settings: PlanSettings,
             config: Mapping[str, Any]) -> tuple[Callable, list[PlannedGraph], lowering.Lowering]:
    """AOTAutograd with fxmem's partitioner (sizes, plan, split; the compared matches decided
    there), then the inner compiler, on the decided graph; where that fails (e.g. a fused kernel's
    backward differentiated again), on the unlowered graph, with the report saying why."""
    partitioner = Partitioner(settings, decision.compared)
    try:
        code = file_code(partitioner.planned)  # the inner compiler's code, for the report
        compiled = inner.compile_joint(decision.gm, example_inputs, inner_name, partitioner, code, config,
                                       settings.strict)
        compiled = lowering.reattached(compiled, decision.lowering.returned)  # returned logits' gradient
        return compiled, partitioner.planned, decision.outcome(partitioner.declined)
    except Exception as e:  # noqa: BLE001 - the unlowered graph may compile; if not, the failure policy decides
        if decision.gm is gm or not is_failure(e):
            raise
        log.debug("fxmem lowering: the lowered graph failed to compile (%s: %s); compiling it unlowered",
                  type(e).__name__, e)
        why = (f"not applied: the graph with lowering could not be compiled ({type(e).__name__}); "
               "the unlowered one could")
    partitioner = Partitioner(settings)
    return inner.compile_joint(gm, example_inputs, inner_name, partitioner, file_code(partitioner.planned), config,
                               settings.strict), \
        partitioner.planned, decision.lowering.declined(why)



LONG_STAGE_S = 1.0  # a stage this long is logged at INFO (TORCH_LOGS=fxmem shows it), shorter ones at DEBUG


@contextlib.contextmanager
def _stage(name: str) -> Iterator[None]:
    """One line per stage with its time, at INFO where it took long: a long compile shows where it is."""
    t = time.perf_counter()
    yield
    took = time.perf_counter() - t
    log.log(logging.INFO if took >= LONG_STAGE_S else logging.DEBUG, "fxmem %s: done in %.1f s", name, took)


def _options(options: Mapping[str, Any] | Options | None, kwargs: Mapping[str, Any]) -> Options:
    if kwargs:
        raise ValueError(f"fxmem backend: unexpected arguments {sorted(kwargs)}; pass settings as options={{...}}")
    try:
        return resolve(options)
    except ValueError as e:
        raise OptionError(str(e)) from None


def _per_example(gm: fx.GraphModule, example_inputs: list[Any], comp: Compilation) -> Callable | None:
    """The chunked step when the graph has a per-example region to chunk, else None."""
    opts = comp.options
    chunk_lowering = _chunk_lowering(opts)

    def compile_chunk(g: fx.GraphModule, ins: list, measure: bool = False) -> Callable:
        return _compile_chunk(g, ins, comp, chunk_lowering, "eager" if measure else opts.inner, opts.ghost_clipping)

    def decided(plan: per_example.ChunkPlan) -> None:
        comp.chunk_plan = plan

    try:
        chunked = per_example.compile_chunked(gm, example_inputs, opts, compile_chunk, decided)
    except Exception as e:  # noqa: BLE001 - the failure policy decides
        stage_failed("per_example", e, opts)
        return None
    log.debug("fxmem per-example: %s", "the graph runs in chunks" if chunked else "nothing to chunk")
    return chunked


def _compile_chunk(gm: fx.GraphModule, example_inputs: list, comp: Compilation,
                   chunk_lowering: bool | Mapping[str, bool], inner_name: str, ghost: bool) -> Callable:
    """A per-example chunk graph: lowering, then AOTAutograd's flat graph with ghost norms
    (``ghost``) and the recompute plan of its inner backward, the inner compiler, the record.
    In a chunked graph ``memory_budget`` caps the whole step (it chooses the microbatch size), so
    the inner planner gets the level and rules only. Where a ghost norm cannot serve a call, the
    chunk is compiled again without ghost norms."""
    gm, lowered = lowering.lower(gm, example_inputs, chunk_lowering)
    partitioner = Partitioner(PlanSettings.of(comp.options, inner=inner_name, budgets=False,
                                              plan_shape=comp.plan_shape))
    ghost_pass = per_example.Ghost(comp.options if ghost else None, gm)  # None: ghost clipping off
    compiled = inner.compile_flat(gm, example_inputs, inner_name, lambda g: per_example.plan_flat(g, partitioner),
                                  rewrite=ghost_pass if ghost_pass.enabled else None,
                                  config=comp.options.inductor_config())
    if ghost_pass.decisions and comp.chunk_plan is not None:
        comp.chunk_plan.ghost = ghost_pass.decisions
    publish(comp, partitioner.planned, lowered)
    materialized = lambda ins: _compile_chunk(gm, ins, comp, chunk_lowering, inner_name, False)  # noqa: E731
    return ghost_pass.guard(compiled, materialized)


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
