"""The ``fxmem`` torch.compile backend: the pipeline, one stage after another.

    options ─► per-example regions ─► lowering (decided) ─► AOT trace ─► sizes ─► plan ─► split
        ─► inner compile ─► record

:func:`fxmem_backend` is that list. AOTAutograd (or Inductor) traces the joint graph and calls
fxmem's partition function back with it, so the middle stages (joint graph, sizes, plan, split)
run inside :class:`~fxmem.remat.partition.Partitioner`, a thin adapter that calls those stage
functions in order (where the lowering left matches to compare, it plans the joint graph with and
without them, from the one trace, and splits the one of lower peak). The options are resolved
once and flow down unchanged; each stage gets the settings derived from them
(:class:`~fxmem.remat.settings.PlanSettings` for the planner). The per-example stage
(:class:`~fxmem.per_example.stage.PerExampleStage`) compiles a region's chunk graphs itself, on
the same path from lowering on, when the chunked step first runs at a size. Each stage logs one
INFO line (``TORCH_LOGS=fxmem``) with its time.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
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
                               plan_shape=plan_shape, continued=continued(gm))
    with _stage("per-example"):
        chunked = per_example.PerExampleStage(comp)(gm, example_inputs)          # per-example regions
    if chunked is not None:
        return Compiled(chunked, comp)
    try:
        with _stage("lowering"):
            decision = decide(gm, example_inputs, opts)                           # lowering (decided)
        with _stage(f"compile (AOT trace, plan, split, {opts.inner} inner compiler)"):
            compiled, planned, lowered = _compile(gm, decision, example_inputs, opts.inner, settings,
                                                   opts.inductor_config(), _in_backward(comp, gm, example_inputs))
    except Exception as e:  # noqa: BLE001 - the failure policy decides
        stage_failed("compile", e, opts)
        return Compiled(inner.compile_safe(gm, example_inputs), comp)  # the graph as Dynamo gave it: no lowering
    with _stage("record"):
        publish(comp, planned, lowered)                                           # record
    return Compiled(compiled, comp)


def continued(gm: fx.GraphModule) -> bool:
    """Whether the step goes on after ``gm``'s forward: Dynamo compiled it at a graph break (its
    frame goes on; ``GraphCompileReason``, which Dynamo sets on the graph it hands a backend), or
    its frame was called by code still running under the compiled callable (a submodule whose
    caller Dynamo left to eager, a resume function), not by the compiled callable itself."""
    reason = getattr(gm, "compile_subgraph_reason", None)
    if getattr(reason, "graph_break", False):
        return True
    stack = getattr(reason, "user_stack", None) or [None]
    name = getattr(stack[-1], "name", "")
    # a resume function (the code after a break) is called by its frame's code as ``return resume(...)``
    return _called_from_running_code(skip=int("resume_in_" in name or name.startswith("__resume_at")))


_TORCH_DIR = os.path.dirname(torch.__file__)
_OWN_DIR = os.path.dirname(__file__)
_STDLIB_DIR = os.path.dirname(os.__file__)
_ENTRY_FILE = os.path.join("_dynamo", "eval_frame.py")  # the compiled callable's wrapper


def _stdlib(filename: str) -> bool:
    return filename.startswith(_STDLIB_DIR) and not any(d in filename for d in ("site-packages", "dist-packages"))


def _called_from_running_code(skip: int = 0) -> bool:
    """Whether, between Dynamo's frame conversion (this call's callers) and the compiled callable's
    entry (``eval_frame``'s wrapper), a frame of code other than torch's, fxmem's or the standard
    library's is running, past the first ``skip`` of them: the caller of the frame Dynamo
    compiles, which goes on after it."""
    f, dynamo = sys._getframe(1), False  # the backend's own callers first: up to Dynamo's call of it
    while f is not None:
        name = f.f_code.co_filename
        if name.startswith(_TORCH_DIR):
            dynamo = True
            if name.endswith(_ENTRY_FILE) and f.f_code.co_name in ("compile_wrapper", "_fn"):
                return False
        elif dynamo and not (name.startswith(_OWN_DIR) or name.startswith("<") or _stdlib(name)):
            if not skip:
                return True
            skip -= 1
        f = f.f_back
    return False


def _compile(gm: fx.GraphModule, decision: Decision, example_inputs: list[Any], inner_name: str,
             settings: PlanSettings, config: Mapping[str, Any],
             in_backward: Mapping[int, int]) -> tuple[Callable, list[PlannedGraph], lowering.Lowering]:
    """AOTAutograd with fxmem's partitioner (sizes, plan, split; the compared matches decided
    there; the optimizer steps ``in_backward`` put in the backward), then the inner compiler, on
    the decided graph; where that fails (e.g. a fused kernel's backward differentiated again), on
    the unlowered graph, with the report saying why."""
    partitioner = Partitioner(settings, decision.compared, in_backward)
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
    partitioner = Partitioner(settings, in_backward=in_backward)
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


def _in_backward(comp: Compilation, gm: fx.GraphModule, example_inputs: list[Any]) -> Mapping[int, int]:
    """Graph input index -> ``fxmem::step_in_backward`` key for the inputs whose optimizer step
    the backward runs (``step_in_backward``), claimed for this graph's Dynamo frame."""
    runtime = comp.options.step_in_backward
    if runtime is None:
        return MappingProxyType({})
    sources = [getattr(getattr(n.meta.get("grapharg"), "source", None), "name", "")
               for n in gm.graph.find_nodes(op="placeholder")]
    return runtime.keys(example_inputs, getattr(comp.compile_id, "frame_id", None), sources)


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
