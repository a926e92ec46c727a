"""fxmem's partition function: the pipeline's middle stages (joint graph -> sizes -> plan -> split ->
the target's graphs), which AOTAutograd (or Inductor) calls back with the joint graph it traced.

:class:`Partitioner` is a thin adapter: it runs those stage functions in order and keeps each
graph's result (:class:`PlannedGraph`); the backend files them on the compile's record."""

from __future__ import annotations

import functools
import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomPartitionerFn

from ..fallback import stage_failed
from ..graph.joint import JointGraph
from ..graph.liveness import step_peak
from ..graph.sizes import SymbolicSizes
from ..options import Options
from .compromise import pack_masks
from .context import PlanContext
from .plan import Plan, plan
from .replay import make_replayable
from .settings import PlanSettings
from .split import Split, split

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

    def peak(self) -> int:
        """The simulated step peak at the compiled shape (the report's ``predict_peak()``)."""
        return step_peak(self.split.fw, self.split.bw, self.sizes, self.primal_names)


def joint_graph(gm: fx.GraphModule, num_fwd_outputs: int, settings: PlanSettings) -> JointGraph:
    """Stage: the joint graph, its random ops made replayable (and, at level 2, dropout masks packed)."""
    joint = JointGraph.of(gm, num_fwd_outputs)
    if make_replayable(joint):
        joint = JointGraph.of(gm, num_fwd_outputs)
    if settings.level == 2 and pack_masks(joint):
        joint = JointGraph.of(gm, num_fwd_outputs)  # regions changed
    return joint


class Partitioner(CustomPartitionerFn):
    """AOTAutograd ``partition_fn`` and Inductor ``custom_partitioner_fn`` in one object: joint
    graph -> sizes -> the plan's context -> plan -> split -> the target's graphs, each a stage
    under the failure policy.

    One per compile: ``planned`` holds each graph it planned and split, in order; the backend
    builds their reports and files them on the compile's record.
    """

    def __init__(self, settings: PlanSettings | Options, compare: bool = False):
        self.settings = settings if isinstance(settings, PlanSettings) else PlanSettings.of(settings)
        self.compare = compare  # planning only to compare peaks: a stage failure raises (no safe plan)
        self.planned: list[PlannedGraph] = []

    def __call__(self, gm: fx.GraphModule, joint_inputs: Any, *, num_fwd_outputs: int, **_: Any):
        settings = self.settings
        try:
            joint = joint_graph(gm, num_fwd_outputs, settings)
            sizes = SymbolicSizes.of(gm, settings.plan_shape)
            chosen = plan(PlanContext.of(joint, sizes, settings.target), settings)
        except Exception as e:  # noqa: BLE001 - the failure policy decides
            if self.compare:
                raise
            stage_failed("plan", e, settings)
            return self._safe(gm, num_fwd_outputs)
        log.debug("fxmem plan: level %d keeps %d values, %d bytes at the plan shape",
                  chosen.level, len(chosen.saved), chosen.saved_bytes)
        try:
            result = split(joint, chosen.saved)
        except Exception as e:  # noqa: BLE001
            if self.compare:
                raise
            stage_failed("split", e, settings)
            return self._safe(gm, num_fwd_outputs)
        log.debug("fxmem split: %d values saved, %d recomputed in the backward",
                  len(result.saved), len(result.recomputed))
        fw, bw = settings.target.finish(result)
        self.planned.append(PlannedGraph(chosen, result, sizes, frozenset(joint.input_names())))
        return fw, bw

    @staticmethod
    def _safe(gm: fx.GraphModule, num_fwd_outputs: int):
        """The safe plan: keep every forward value the backward reads (a plain partition)."""
        joint = JointGraph.of(gm, num_fwd_outputs)
        result = split(joint, joint.default_saved())
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
