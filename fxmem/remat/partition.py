"""fxmem's partition function: plan the saved set of a joint graph, then split it."""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Any

import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomPartitionerFn

from ..graph.joint import JointGraph
from ..graph.sizes import SymbolicSizes
from ..options import Options
from .compromise import pack_masks
from .plan import Plan, plan
from .split import Split, split

log = logging.getLogger("fxmem")


class Partitioner(CustomPartitionerFn):
    """AOTAutograd ``partition_fn`` and Inductor ``custom_partitioner_fn`` in one object.

    Keeps every plan and split it made (latest last) for reports and tests.
    """

    def __init__(self, options: Options):
        self.options = options
        self.plans: list[Plan] = []
        self.splits: list[Split] = []
        self.sizes: list[SymbolicSizes] = []

    def __call__(self, gm: fx.GraphModule, joint_inputs: Any, *, num_fwd_outputs: int, **_: Any):
        joint = JointGraph.of(gm, num_fwd_outputs)
        if self.options.level == 2 and pack_masks(joint):
            joint = JointGraph.of(gm, num_fwd_outputs)  # regions changed
        sizes = SymbolicSizes.of(gm, self.options.plan_shape)
        chosen = plan(joint, sizes, self.options)
        result = split(joint, chosen.saved)
        log.log(logging.INFO if self.options.report else logging.DEBUG,
                "fxmem plan: level %d, %d saved tensors = %s bytes (%d at the plan shape), %d recomputed "
                "nodes, rules applied %s%s", chosen.level, len(result.saved), sizes.pretty(chosen.saved_bytes_expr),
                chosen.saved_bytes, len(result.recomputed), list(chosen.applied_rules) or "none",
                "".join(f"; {n}" for n in chosen.notes))
        self.plans.append(chosen)
        self.splits.append(result)
        self.sizes.append(sizes)
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
