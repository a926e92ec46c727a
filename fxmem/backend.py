"""The ``fxmem`` torch.compile backend: options -> AOTAutograd joint graph -> plan -> split -> inner compiler."""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any, Mapping

import torch.fx as fx
from torch._dynamo.backends.common import aot_autograd

from . import inner, lowering, per_example
from .fallback import stage_failed
from .inputs import Inputs
from .options import OptionError, Options, resolve
from .per_example.remat import compile_chunk
from .remat.partition import Partitioner

log = logging.getLogger("fxmem")

# Every partitioner fxmem made, oldest first: the source for reports and tests.
COMPILES: list[Partitioner] = []


def fxmem_backend(gm: fx.GraphModule, example_inputs: list[Any], options: Mapping[str, Any] | Options | None = None, **kwargs: Any):
    """``torch.compile(model, backend="fxmem", options={...})``."""
    if kwargs:
        raise ValueError(f"fxmem backend: unexpected arguments {sorted(kwargs)}; pass settings as options={{...}}")
    try:
        opts = resolve(options)
    except ValueError as e:
        raise OptionError(str(e)) from None
    log.debug("fxmem: compiling a graph of %d nodes (level %d, inner %s)", len(gm.graph.nodes), opts.level, opts.inner)
    try:
        chunked = per_example.compile_chunked(gm, example_inputs, opts, lambda g, ins: compile_chunk(g, ins, opts),
                                              lambda g, ins: compile_chunk(g, ins, replace(opts, inner="eager")))
    except Exception as e:  # noqa: BLE001 - the failure policy decides
        stage_failed("per_example", e, opts)
        chunked = None
    if chunked is not None:
        log.debug("fxmem per-example: the graph runs in chunks")
        return chunked
    log.debug("fxmem per-example: nothing to chunk")
    try:
        return _compile(gm, example_inputs, opts)
    except Exception as e:  # noqa: BLE001
        stage_failed("compile", e, opts)
        return _safe_compile(gm, example_inputs)


def _safe_compile(gm: fx.GraphModule, example_inputs: list[Any]):
    """The safe path: AOTAutograd's plain partition (save everything) and the eager inner compiler."""
    from torch._functorch.partitioners import default_partition

    return aot_autograd(fw_compiler=inner.eager, bw_compiler=inner.eager, partition_fn=default_partition)(gm, example_inputs)


def _compile(gm: fx.GraphModule, example_inputs: list[Any], opts: Options):
    """Pattern lowering, then AOTAutograd with fxmem's partitioner, then the inner compiler."""
    gm, lowered = lowering.lower(gm, example_inputs, opts)
    log.debug("fxmem lowering: %d patterns lowered, %d skipped", len(lowered.lowered), len(lowered.skipped))
    partitioner = Partitioner(opts, Inputs(example_inputs))
    if opts.inner == "eager":
        compiled = aot_autograd(fw_compiler=inner.eager, bw_compiler=inner.eager, partition_fn=partitioner)(gm, example_inputs)
    else:
        from torch._functorch import config as functorch_config
        from torch._inductor.compile_fx import compile_fx

        # A hit in AOTAutograd's cache skips the partitioner, so the graph would have no plan or
        # report; Inductor's FX graph cache still serves the compiled forward and backward.
        with functorch_config.patch(enable_autograd_cache=False):
            compiled = compile_fx(gm, example_inputs, config_patches={"custom_partitioner_fn": partitioner})
    log.debug("fxmem compile: %s inner compiler done, %d plan(s)", opts.inner, len(partitioner.records))
    COMPILES.append(partitioner)
    lowered.attach(partitioner)
    return compiled


def register() -> None:
    """Register ``fxmem`` with Dynamo (the entry point does this without an import)."""
    from torch._dynamo.backends.registry import _BACKENDS, register_backend

    if "fxmem" not in _BACKENDS:
        register_backend(name="fxmem")(fxmem_backend)
