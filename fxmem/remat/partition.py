"""fxmem's partition function: plan the saved set of a joint graph, then split it."""

from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass
import logging
from pathlib import Path
from typing import Any

import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomPartitionerFn

from ..graph.joint import JointGraph
from ..graph.liveness import storage_roots
from ..graph.sizes import SymbolicSizes
from ..inner import reuse_dead_buffers
from ..fallback import stage_failed
from ..options import Options
from .compromise import pack_masks
from .plan import Plan, plan
from .split import Split, split

log = logging.getLogger("fxmem")
_GRAPH_INDEX = itertools.count()


@dataclass(frozen=True)
class Record:
    plan: Plan
    split: Split
    sizes: SymbolicSizes
    report: Any  # fxmem.report.GraphReport
    input_ids: frozenset[int]


class Partitioner(CustomPartitionerFn):
    """AOTAutograd ``partition_fn`` and Inductor ``custom_partitioner_fn`` in one object.

    Keeps every plan and split it made (latest last) for reports and tests.
    """

    def __init__(self, options: Options, input_ids: frozenset[int] = frozenset()):
        self.options = options
        self.input_ids = input_ids  # ids of the Dynamo graph's example inputs: links reports to models
        self.records: list[Record] = []

    def __call__(self, gm: fx.GraphModule, joint_inputs: Any, *, num_fwd_outputs: int, **_: Any):
        joint = JointGraph.of(gm, num_fwd_outputs)
        try:
            if self.options.level == 2 and pack_masks(joint):
                joint = JointGraph.of(gm, num_fwd_outputs)  # regions changed
            sizes = SymbolicSizes.of(gm, self.options.plan_shape)
            chosen = plan(joint, sizes, self.options)
        except Exception as e:  # noqa: BLE001 - the failure policy decides
            stage_failed("plan", e, self.options)
            return self._safe(joint)
        try:
            result = split(joint, chosen.saved)
        except Exception as e:  # noqa: BLE001
            stage_failed("split", e, self.options)
            return self._safe(joint)
        if self.options.inner == "eager":  # what the eager inner compiler will run: report exactly that
            reuse_dead_buffers(result.fw)
            reuse_dead_buffers(result.bw)
        root = storage_roots(gm)  # inputs, and kept views of inputs, exist before the step
        primals = set(joint.primals)
        self._record(chosen, result, sizes, {n.name for n in root if root[n] in primals})
        return result.fw, result.bw

    @staticmethod
    def _safe(joint: JointGraph):
        """The safe plan: keep every forward value the backward reads (a plain partition)."""
        result = split(joint, joint.default_saved())
        return result.fw, result.bw

    def _record(self, chosen: Plan, result: Split, sizes: SymbolicSizes, primal_names: set[str]) -> None:
        from ..report.model import build
        from ..report.render import table

        index = next(_GRAPH_INDEX)
        rep = build(index, self.options.key(), chosen, result, sizes, primal_names)
        self.records.append(Record(chosen, result, sizes, rep, self.input_ids))
        level = logging.INFO if self.options.report else logging.DEBUG
        if log.isEnabledFor(level):  # the table evaluates the peak: only when someone reads it
            log.log(level, "%s", table(rep))
        if self.options.report_path:
            from ..report.model import MemoryReport

            path = self.options.report_path
            path = f"{path[:-5]}.{index}.json" if path.endswith(".json") else f"{path}.{index}.json"
            MemoryReport([rep]).to_json(path)
            log.info("fxmem: wrote the report of graph %d to %s", index, path)

    @property
    def plans(self) -> list[Plan]:
        return [r.plan for r in self.records]

    @property
    def splits(self) -> list[Split]:
        return [r.split for r in self.records]

    @property
    def sizes(self) -> list[SymbolicSizes]:
        return [r.sizes for r in self.records]

    def __deepcopy__(self, memo: dict) -> "Partitioner":
        # Inductor deep-copies its config (us included) to hash it; the splits hold fake tensors.
        return self

    def uuid(self) -> str:
        """Inductor's cache key: fxmem's source code and the options."""
        h = hashlib.sha256()
        for path in sorted(Path(__file__).resolve().parents[1].rglob("*.py")):
            h.update(path.read_bytes())
        h.update(self.options.key().encode())
        return h.hexdigest()
