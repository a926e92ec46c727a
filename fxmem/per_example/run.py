"""Run a split per-example graph (the stage's step, ``stage.py``): the outer graph once, the
chunk graph over the batch in microbatches (``microbatch.py``: sums accumulated in fp32), the
rest once.
``microbatch_size="auto"`` measures whole steps' peaks (exact) at the sizes ``microbatch.choose``
asks for and takes the largest m that fits the budget."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx as fx

from ..profiling import step_perf
from . import microbatch
from .chunk import RegionSplit

log = logging.getLogger("fxmem")


class _Ref(str):
    """A node name inside the output structure (plain strings there are constants)."""


@dataclass
class ChunkPlan:
    """What the per-example pass decided for one graph (``Compilation.chunk_plan``)."""
    batch_size: int
    microbatch_size: int | None = None
    requested: Any = None                      # the microbatch_size option
    memory_budget: int | None = None
    predicted_peak: Callable[[int], int] | None = field(default=None, repr=False)
    measured: dict[int, int] = field(default_factory=dict)  # m -> measured step peak (bytes)
    fused_sums: int = 0                        # clip-weighted batch sums done as matvecs
    fused_norms: int = 0                       # global norms taken without concatenating
    reason: str | None = None                  # why the graph was not chunked
    whole_batch: bool = False                  # microbatch_size unset: one chunk (for ghost clipping)
    ghost: list = field(default_factory=list)  # ghost.Decision per per-example weight gradient

    @property
    def chunked(self) -> bool:
        return self.reason is None

    def summary(self) -> dict:
        """Plain data for reports and JSON."""
        return dict(batch_size=self.batch_size, microbatch_size=self.microbatch_size,
                    requested=self.requested, memory_budget=self.memory_budget,
                    measured={int(k): int(v) for k, v in self.measured.items()},
                    fused_sums=self.fused_sums, fused_norms=self.fused_norms,
                    chunked=self.chunked, reason=self.reason, whole_batch=self.whole_batch,
                    ghost=[d.summary() for d in self.ghost])


def _signature(inputs: list) -> tuple:
    return tuple(tuple(t.shape) if isinstance(t, torch.Tensor) else t for t in inputs)


class ChunkedStep:
    """The chunked step. ``compile_chunk(gm, inputs, measure=False)`` compiles a chunk graph
    (``measure=True``: for measuring its peak while choosing the size, with the eager inner
    compiler)."""

    def __init__(self, split: RegionSplit, plan: ChunkPlan, compile_chunk: Callable):
        self.split, self.plan = split, plan
        self._compile = compile_chunk
        self._compiled: dict[int, Callable] = {}
        self._spec = fx.node.map_aggregate(split.output_spec,
                                           lambda x: _Ref(x) if isinstance(x, str) else x)

    def _chunk_fn(self, m: int, inputs: list, measure: bool = False) -> Callable:
        key = (m, *_signature(inputs))  # a chunk graph is compiled for static shapes
        if not measure and key in self._compiled:
            return self._compiled[key]
        log.debug("fxmem per-example: compiling the chunk graph for %d examples", m)
        chunk = self.split.make_chunk(m)
        self.plan.fused_norms = chunk.fused_norms
        fn = self._compile(chunk.gm, inputs, measure=measure)
        if not measure:
            self._compiled[key] = fn
        return fn

    def _inputs(self, env: dict, start: int, size: int) -> list:
        return [env[name].narrow(dim, start, size) if dim is not None else env[name]
                for name, dim in self.split.chunk_inputs]

    def _step_peak(self, env: dict, m: int) -> int:
        """Exact peak of a whole step with chunk size m (above what is live at entry)."""
        fn = self._chunk_fn(m, self._inputs(env, 0, m), measure=True)
        fn(*self._inputs(env, 0, m))  # warm-up: first-call allocations are not the step's
        with step_perf(self._device(env)) as perf:
            out = self._loop(env, m, lambda size, ins: fn(*ins) if size == m else
                             self._chunk_fn(size, ins, measure=True)(*ins))
        del out
        return perf.result.peak_bytes

    def _device(self, env: dict) -> torch.device:
        for v in env.values():
            if isinstance(v, torch.Tensor):
                return v.device
        return torch.device("cpu")

    def _choose(self, env: dict) -> int:
        """The largest m whose measured step peak fits the budget, with m + 1 measured over it
        (or m = the batch): ``microbatch.choose`` from m = 1 and 4, every size measured exactly."""
        plan = self.plan
        choice = microbatch.AutoChoice(plan.memory_budget, self._batch(env), measured=plan.measured)
        plan.predicted_peak = choice.peak
        m = microbatch.choose(choice, lambda m: self._step_peak(env, m), (1, min(choice.max_size, 4)))
        log.info("fxmem per-example: microbatch_size=auto chose %d of %d (budget %d bytes, "
                 "measured peak %d)", m, choice.max_size, choice.budget, plan.measured[m])
        return m

    def _batch(self, env: dict) -> int:
        """This call's batch size, read off a batched input (dynamic graphs vary it)."""
        name, dim = next((n, d) for n, d in self.split.chunk_inputs if d is not None)
        return env[name].shape[dim]

    def _loop(self, env: dict, m: int, run: Callable) -> dict:
        split, n = self.split, len(self.split.partials)
        acc = microbatch.Accumulator([dim for _, dim in split.chunk_batched_outputs])
        for start, size in microbatch.spans(self._batch(env), m):
            ins = self._inputs(env, start, size)
            outs = run(size, ins)
            acc.add(outs[:n], outs[n:], size, inputs=ins)
            del outs
        sums, parts = acc.result(split.partial_dtypes)
        return {**dict(zip(split.partials, sums)),
                **{name: t for (name, _), t in zip(split.chunk_batched_outputs, parts)}}

    def __call__(self, *args):
        split = self.split
        env = dict(zip(split.outer_outputs, split.outer(*args)))
        if self.plan.whole_batch:
            m = self._batch(env)
        else:
            if self.plan.microbatch_size is None:
                self.plan.microbatch_size = self._choose(env)
            m = self.plan.microbatch_size
        env.update(self._loop(env, m, lambda size, ins: self._chunk_fn(size, ins)(*ins)))
        env.update(zip(split.rest_outputs, split.rest(*[env[n] for n in split.rest_inputs])))
        return fx.node.map_aggregate(self._spec, lambda x: env[x] if isinstance(x, _Ref) else x)
