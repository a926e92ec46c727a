"""fxmem's partition function: plan the saved set of a joint graph, then split it."""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Any

import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomPartitionerFn

from ..graph.joint import JointGraph
from ..options import Options
from .split import Split, split

log = logging.getLogger("fxmem")


def plan_saved(joint: JointGraph, options: Options) -> list[fx.Node]:
    """The saved set. For now: what a plain partition keeps (the planner replaces this)."""
    return joint.default_saved()


class Partitioner(CustomPartitionerFn):
    """AOTAutograd ``partition_fn`` and Inductor ``custom_partitioner_fn`` in one object.

    Keeps every split it made in ``self.splits`` (latest last) for reports and tests.
    """

    def __init__(self, options: Options):
        self.options = options
        self.splits: list[Split] = []

    def __call__(self, gm: fx.GraphModule, joint_inputs: Any, *, num_fwd_outputs: int, **_: Any):
        joint = JointGraph.of(gm, num_fwd_outputs)
        result = split(joint, plan_saved(joint, self.options))
        log.debug("split: %d saved tensors, %d saved symints, %d recomputed nodes",
                  len(result.saved), len(result.saved_syms), len(result.recomputed))
        self.splits.append(result)
        return result.fw, result.bw

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
