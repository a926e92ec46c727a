"""What a lowering pattern does to the planned step peak, for the tests and studies that justify
the backend's lowering decisions (``Match.proven``, ``Match.futile``, :func:`fxmem.lowering.decide.decide`)."""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from .. import lowering
from ..inner import compile_joint
from ..models import Workload
from ..options import LOWERING_PATTERNS, resolve
from ..remat.partition import Partitioner
from ..remat.settings import PlanSettings


def dynamo_graph(workload: Workload) -> tuple[fx.GraphModule, list[Any]]:
    """The one Dynamo graph of ``workload``'s training step, with its example inputs."""
    captured = []

    def grab(gm, example_inputs, **kwargs):
        captured.append((gm, example_inputs))
        return gm.forward

    torch._dynamo.reset()
    workload.loss(torch.compile(workload.model, backend=grab)(**workload.batch))
    if len(captured) != 1:
        raise AssertionError(f"{workload.name}: one Dynamo graph expected, got {len(captured)}")
    return captured[0]


NORMS = ("rms_norm", "layer_norm")  # proven: lowered in both graphs compared


def planned_peaks(gm: fx.GraphModule, example_inputs: list[Any], pattern: str,
                  level: int) -> tuple[int | None, int | None]:
    """Planned step peaks (eager inner compiler) of ``gm`` with ``pattern``'s matches lowered and
    without them, the norms lowered in both; (None, None) where it does not match."""
    def options(on: tuple[str, ...]):
        return resolve({"inner": "eager", "level": level, "lowering": {p: p in on for p in LOWERING_PATTERNS}})

    with_opts, without_opts = options((*NORMS, pattern)), options(NORMS)
    with_gm, lowered = lowering.lower(gm, example_inputs, with_opts.lowering)
    if not any(x.pattern == pattern for x in lowered.lowered):
        return None, None
    without_gm, _ = lowering.lower(gm, example_inputs, without_opts.lowering)
    pairs = ((with_gm, with_opts), (without_gm, without_opts))
    return tuple(planned_peak(g, example_inputs, PlanSettings.of(o)) for g, o in pairs)


def planned_peak(gm: fx.GraphModule, example_inputs: list[Any], settings: PlanSettings) -> int | None:
    """The simulated step peak of ``gm`` compiled with fxmem's partitioner (eager inner compiler);
    None where nothing was planned."""
    partitioner = Partitioner(settings)
    compile_joint(gm, example_inputs, "eager", partitioner)
    peaks = [g.peak() for g in partitioner.planned]
    return max(peaks) if peaks else None
