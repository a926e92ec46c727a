"""fxmem's partition function: plan the saved set of a joint graph, then split it."""

from __future__ import annotations

import functools
import hashlib
import logging
from pathlib import Path
from typing import Any

import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomPartitionerFn

from ..compilation import PlannedGraph
from ..fallback import stage_failed
from ..graph.joint import JointGraph
from ..graph.reuse import reuse_dead_buffers
from ..graph.sizes import SymbolicSizes
from ..options import Options
from .compromise import pack_masks
from .fences import for_inductor
from .plan import plan
from .replay import make_replayable
from .split import split

log = logging.getLogger("fxmem")


class Partitioner(CustomPartitionerFn):
    """AOTAutograd ``partition_fn`` and Inductor ``custom_partitioner_fn`` in one object.

    One per compile: ``planned`` holds each graph it planned and split, in order; the backend
    builds their reports and files them on the compile's record.
    """

    def __init__(self, options: Options):
        self.options = options
        self.planned: list[PlannedGraph] = []

    def __call__(self, gm: fx.GraphModule, joint_inputs: Any, *, num_fwd_outputs: int, **_: Any):
        joint = JointGraph.of(gm, num_fwd_outputs)
        try:
            if make_replayable(joint):
                joint = JointGraph.of(gm, num_fwd_outputs)
            if self.options.level == 2 and pack_masks(joint):
                joint = JointGraph.of(gm, num_fwd_outputs)  # regions changed
            sizes = SymbolicSizes.of(gm, self.options.plan_shape)
            chosen = plan(joint, sizes, self.options)
        except Exception as e:  # noqa: BLE001 - the failure policy decides
            stage_failed("plan", e, self.options)
            return self._safe(joint)
        log.debug("fxmem plan: level %d keeps %d values, %d bytes at the plan shape",
                  chosen.level, len(chosen.saved), chosen.saved_bytes)
        try:
            result = split(joint, chosen.saved)
        except Exception as e:  # noqa: BLE001
            stage_failed("split", e, self.options)
            return self._safe(joint)
        log.debug("fxmem split: %d values saved, %d recomputed in the backward",
                  len(result.saved), len(result.recomputed))
        if self.options.inner == "eager":  # what the eager inner compiler will run: report exactly that
            reuse_dead_buffers(result.fw)
            reuse_dead_buffers(result.bw)
        self.planned.append(PlannedGraph(chosen, result, sizes, frozenset(joint.input_names())))
        if self.options.inner == "inductor":  # a copy: the report reads the split's own
            return result.fw, for_inductor(result.bw, {n.name for n in result.recomputed})
        return result.fw, result.bw

    @staticmethod
    def _safe(joint: JointGraph):
        """The safe plan: keep every forward value the backward reads (a plain partition)."""
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
        return hashlib.sha256(f"{_source_key()}:{self.options.key()}".encode()).hexdigest()


@functools.cache  # the code this process runs: read once
def _source_key() -> str:
    from ..version import __version__

    h = hashlib.sha256(__version__.encode())
    root = Path(__file__).resolve().parents[2]
    for path in sorted([*(root / "fxmem").rglob("*.py"), *(root / "fxmem_kernels").rglob("*.py")]):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()
