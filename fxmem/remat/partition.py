"""fxmem's partition function: the pipeline's middle stages (joint graph -> sizes -> plan -> split ->
the target's graphs), which AOTAutograd (or Inductor) calls back with the joint graph it traced.

:class:`Partitioner` is a thin adapter: it runs those stage functions in order and keeps each
graph's result (:class:`PlannedGraph`); the backend files them on the compile's record. Where
the lowering marked matches to compare (:mod:`fxmem.lowering.splice`), :func:`compare` plans the
joint graph with them fused and with the ops they replaced, and the lower simulated peak is split."""

from __future__ import annotations

import contextlib
import functools
import gc
import hashlib
import logging
import operator
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Mapping

import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomPartitionerFn

from ..fallback import stage_failed
from ..graph.joint import JointGraph, hoist_size_reads
from ..graph.layouts import mark_copies
from ..graph.liveness import is_alias, step_peak
from ..graph.sizes import SymbolicSizes
from ..lowering.splice import Compared, has_marks, unmark
from ..options import Options
from ..step_in_backward.graph import Rewritten, released_outputs, rewrite
from .budget import BudgetError
from .compromise import pack_masks
from .context import PlanContext
from .fences import scatter_into_sums
from .plan import Plan, plan
from .replay import make_replayable
from .scan_grads import accumulate_slice_gradients
from .settings import PlanSettings
from .split import Split, split
from .tied import accumulate_tied_embeddings

if TYPE_CHECKING:
    from ..report.model import GraphReport

log = logging.getLogger("fxmem")


@dataclass(eq=False)
class PlannedGraph:
    """One joint (or per-example chunk) graph that fxmem's partitioner planned and split."""
    plan: Plan
    split: Split
    sizes: SymbolicSizes
    primal_names: frozenset[str]  # the joint graph's inputs (their views keep no storage)
    report: "GraphReport | None" = None  # the record stage's: built once the graph is compiled
    # The inner compiler's code for the forward and the backward ("forward"/"backward" -> source),
    # where it states its buffers (Inductor's wrapper): the report reads its schedule from it.
    inner_code: dict[str, str] = field(default_factory=dict)
    # The parameters whose optimizer step its backward runs (``step_in_backward``), in order.
    in_backward: Rewritten = Rewritten(())
    # The input positions whose gradient the backward returns as a view of another tensor
    # (:func:`grad_views`): autograd adds another gradient to such a one out of place.
    grad_views: frozenset[int] = frozenset()

    def peak(self) -> int:
        """The simulated step peak at the compiled shape (the report's ``predict_peak()``)."""
        return step_peak(self.split.fw, self.split.bw, self.sizes, self.primal_names)


def grad_views(joint: JointGraph) -> frozenset[int]:
    """The input positions whose gradient the backward returns as a view of another tensor (a
    weight's ``mm(...).t()``), where the graph runs op by op (the eager inner compiler; Inductor
    returns buffers of its own): the step's eager code adds another gradient of that parameter
    (an eager embedding tied to the head) out of place, not in place
    (``report.memory.eager_grad_rows``)."""
    return frozenset(i for i, o in enumerate(joint.bwd_outputs)
                     if isinstance(o, fx.Node) and o.target is not operator.getitem and is_alias(o))


def joint_graph(gm: fx.GraphModule, num_fwd_outputs: int, settings: PlanSettings) -> JointGraph:
    """Stage: the joint graph, its size reads made early (``hoist_size_reads``), a tied
    embedding's gradient summed into its other use's (``tied``
    for eager's kernel; for Inductor's decomposition, scattered into it: ``fences.scatter_into_sums``,
    which the simulator then counts in place), a loop's slice gradients written into one buffer
    (``scan_grads``), its random ops made replayable (and, at level 2, dropout masks packed); for
    the eager inner compiler, the views that copy on CPU marked (``graph.layouts``)."""
    accumulate_tied_embeddings(gm)
    accumulate_slice_gradients(gm)
    hoist_size_reads(gm)
    if settings.target.reuses_buffers:  # the eager inner compiler runs the CPU kernels' layouts
        mark_copies(gm)
    if settings.target.inplace_scatters:
        scatter_into_sums(gm)
    joint = JointGraph.of(gm, num_fwd_outputs)
    if make_replayable(joint):
        joint = JointGraph.of(gm, num_fwd_outputs)
    if settings.level == 2 and pack_masks(joint):
        joint = JointGraph.of(gm, num_fwd_outputs)  # regions changed
    return joint


@contextlib.contextmanager
def _collector_paused():
    """Python's cyclic garbage collector off while planning: the planner allocates many small
    objects (networks, node sets) while the traced graphs and their fake tensors are alive, so
    each full collection walks all of them (a large share of a deep model's planning time,
    bench/results/realistic-compile-time.md). The caller's setting is restored."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _planned(gm: fx.GraphModule, num_fwd_outputs: int, settings: PlanSettings):
    """Stages joint graph, sizes, plan: (joint, sizes, plan, its simulated step peak or None)."""
    joint = joint_graph(gm, num_fwd_outputs, settings)
    sizes = SymbolicSizes.of(gm, settings.plan_shape)
    ctx = PlanContext.of(joint, sizes, settings.target, released_outputs(joint, settings.in_backward))
    chosen = plan(ctx, settings)
    return joint, sizes, chosen, ctx


def _attempt(gm: fx.GraphModule | None, num_fwd_outputs: int, settings: PlanSettings) -> tuple[Any, list]:
    """:func:`_planned` (or the exception it raised: a candidate that cannot be planned; None
    without a graph) and the warnings it gave, held back: only the chosen candidate's are given."""
    if gm is None:
        return None, []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            return _planned(gm, num_fwd_outputs, settings), caught
        except Exception as e:  # noqa: BLE001 - the comparison decides
            if isinstance(e, BudgetError) and settings.strict:
                raise
            return e, caught


def candidate_peak(planned: tuple) -> int:
    """The simulated step peak of a planned candidate (:func:`_planned`'s result)."""
    _, _, chosen, ctx = planned
    return ctx.peak(chosen.saved, frozenset(chosen.offloaded))


def compare(gm: fx.GraphModule, num_fwd_outputs: int, settings: PlanSettings, compared: Compared):
    """The lowering's decision on a marked joint graph: planned with its compared regions fused
    and unfused (:mod:`fxmem.lowering.splice`), the lower simulated peak kept (a tie goes to the
    unfused ops: the fused kernels' own buffers are the estimate's least certain part).
    ``(the chosen joint graph, its planned stages, why the fused regions were declined or None)``."""
    try:
        unfused = compared.unlowered(gm, settings.target)
    except Exception as e:  # noqa: BLE001 - no comparison: the lowered graph alone
        log.debug("fxmem lowering: no unlowered graph to compare (%s: %s)", type(e).__name__, e)
        unfused = None
    gm = compared.lowered(gm, settings.target)
    (fused, fused_warned), (without, without_warned) = (_attempt(g, num_fwd_outputs, settings) for g in (gm, unfused))
    chosen, why = choose(fused, without, settings.peak_budget)
    for w in (without_warned if chosen is without else fused_warned):
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    if isinstance(chosen, Exception):
        raise chosen
    return (unfused if chosen is without else gm), chosen, why


def choose(fused: Any, without: Any, cap: int | None = None) -> tuple[Any, str | None]:
    """The candidate kept and why the fused one was not (None: it was); each is planned stages,
    the exception planning raised, or None (no such candidate). With a peak budget ``cap``, the
    candidate without the fused kernels wherever it meets the cap (:mod:`fxmem.lowering.decide`);
    else the lower simulated peak."""
    if isinstance(fused, Exception):
        if without is None or isinstance(without, Exception):
            return fused, None
        return without, ("not applied: the graph with it could not be planned (e.g. a fused kernel's backward "
                         "differentiated again); the graph without it could")
    if without is None or isinstance(without, Exception):
        return fused, None
    peaks = candidate_peak(fused), candidate_peak(without)
    log.debug("fxmem lowering: planned peak %s bytes with the compared patterns, %s without", *peaks)
    if cap is not None and peaks[1] <= cap:
        return without, f"not applied: the plan without it meets the peak budget ({peaks[1]:,} <= {cap:,} bytes)"
    if peaks[0] >= peaks[1]:
        return without, f"not applied: the plan with it peaks at {peaks[0]:,} bytes, not below {peaks[1]:,} without it"
    return fused, None


class Partitioner(CustomPartitionerFn):
    """AOTAutograd ``partition_fn`` and Inductor ``custom_partitioner_fn`` in one object: joint
    graph -> sizes -> the plan's context -> plan -> split -> the target's graphs, each a stage
    under the failure policy.

    One per compile: ``planned`` holds each graph it planned and split, in order; the backend
    builds their reports and files them on the compile's record.
    """

    def __init__(self, settings: PlanSettings | Options, compared: Compared | None = None,
                 in_backward: Mapping[int, int] = MappingProxyType({})):
        settings = settings if isinstance(settings, PlanSettings) else PlanSettings.of(settings)
        self.settings = replace(settings, in_backward=frozenset(in_backward))
        self.compared = compared  # the lowering's compared regions: plan with and without them
        # graph input index -> ``fxmem::step_in_backward`` key: the parameters whose optimizer
        # step the backward runs (``step_in_backward``, applied to the split's backward)
        self.in_backward = in_backward
        self.declined: str | None = None  # why the compared regions were not kept (None: kept)
        self.planned: list[PlannedGraph] = []

    def __call__(self, gm: fx.GraphModule, joint_inputs: Any, *, num_fwd_outputs: int, **_: Any):
        with _collector_paused():
            return self._partition(gm, num_fwd_outputs)

    def _partition(self, gm: fx.GraphModule, num_fwd_outputs: int):
        settings = self.settings
        try:
            if self.compared is not None and has_marks(gm):
                gm, (joint, sizes, chosen, ctx), self.declined = compare(gm, num_fwd_outputs, settings, self.compared)
            else:
                joint, sizes, chosen, ctx = _planned(gm, num_fwd_outputs, settings)
        except Exception as e:  # noqa: BLE001 - the failure policy decides
            stage_failed("plan", e, settings)
            return self._safe(gm, num_fwd_outputs)
        log.debug("fxmem plan: level %d keeps %d values, %d bytes at the plan shape",
                  chosen.level, len(chosen.saved), chosen.saved_bytes)
        try:
            # the backward's order the simulator found to peak lower (``StepPeak.defers``)
            # and whether it runs its recomputed copy ops twice (``StepPeak.twice``)
            defer = ctx.peak.defers(chosen.saved, frozenset(chosen.offloaded))
            twice = ctx.peak.twice(chosen.saved, frozenset(chosen.offloaded))
            result = split(joint, chosen.saved, settings.target.input_views, chosen.offloaded, defer=defer,
                           twice=twice)
        except Exception as e:  # noqa: BLE001
            stage_failed("split", e, settings)
            return self._safe(gm, num_fwd_outputs)
        log.debug("fxmem split: %d values saved, %d recomputed in the backward",
                  len(result.saved), len(result.recomputed))
        stepped = rewrite(result.fw, result.bw, self.in_backward, in_order=settings.target.exact_peak)
        fw, bw = settings.target.finish(result, settings.memory_first)
        self.planned.append(PlannedGraph(chosen, result, sizes, frozenset(joint.input_names()), in_backward=stepped,
                                         grad_views=grad_views(joint) if settings.target.exact_peak else frozenset()))
        return fw, bw

    def _safe(self, gm: fx.GraphModule, num_fwd_outputs: int):
        """The safe plan: keep every forward value the backward reads (a plain partition), finished
        for the target as a planned split is (:meth:`~.settings.Target.finish`: under Inductor the
        forward's random ops stay in graph order, so ``fallback_random`` draws eager's numbers).
        Where finishing fails too (the graph that made a stage fail may be what it trips on), the
        split's own graphs are returned: the fallback itself must not raise."""
        unmark(gm)
        joint = JointGraph.of(gm, num_fwd_outputs)
        result = split(joint, joint.default_saved(), self.settings.target.input_views)
        try:
            return self.settings.target.finish(result, self.settings.memory_first)
        except Exception as e:  # noqa: BLE001 - the safe plan as split, unfinished
            log.debug("fxmem safe plan: finishing the split failed (%s: %s); its graphs go as split",
                      type(e).__name__, e)
            return result.fw, result.bw

    def __deepcopy__(self, memo: dict) -> "Partitioner":
        # Inductor deep-copies its config (us included) to hash it; the splits hold fake tensors.
        return self

    def __reduce__(self):
        # Inductor pickles its config (us included) into its cache keys; the plans hold fx
        # graphs, whose cycles make every compile bypass the cache. The uuid is what we are there.
        return str, (self.uuid(),)

    def uuid(self) -> str:
        """Inductor's cache key: fxmem's version and source code (fxmem_kernels' too: lowered
        graphs call its ops) and the options."""
        return hashlib.sha256(f"{_source_key()}:{self.settings.key()}".encode()).hexdigest()


@functools.cache  # the code this process runs: read once
def _source_key() -> str:
    from ..version import __version__

    h = hashlib.sha256(__version__.encode())
    root = Path(__file__).resolve().parents[2]
    for path in sorted([*(root / "fxmem").rglob("*.py"), *(root / "fxmem_kernels").rglob("*.py")]):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()
