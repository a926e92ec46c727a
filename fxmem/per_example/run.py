"""Run a split per-example graph (the stage's step, ``stage.py``): the outer graph once, the
chunk graph over the batch in microbatches (``microbatch.run_chunks``: sums accumulated in fp32),
the rest once.
``microbatch_size="auto"`` measures whole steps' peaks (exact) at the sizes ``microbatch.search``
asks for and takes the largest m that fits the budget.

The plan (``plan.ChunkPlan``) is frozen: the step reads what the stage decided from it and
records what it decides itself (``"auto"``'s size and measurements, the chunk graph's fused
norms) through ``plan.update_plan``. Its own run-time state is the size in use and the compiled
chunk functions."""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable

import torch
import torch.fx as fx

from . import microbatch
from .chunk import RegionSplit
from .plan import ChunkPlan, update_plan

if TYPE_CHECKING:
    from ..compilation import Compilation

log = logging.getLogger("fxmem")


class _Ref(str):
    """A node name inside the output structure (plain strings there are constants)."""


def _signature(inputs: list) -> tuple:
    return tuple(tuple(t.shape) if isinstance(t, torch.Tensor) else t for t in inputs)


class ChunkedStep:
    """The chunked step: the split graph, the stage's frozen ``plan``, and the run-time state
    (the chunk size in use, the compiled chunk graphs). ``compile_chunk(gm, inputs,
    measure=False)`` compiles a chunk graph (``measure=True``: for measuring its peak while
    choosing the size, with the eager inner compiler); ``record`` is the compile's record, where
    later decisions go."""

    def __init__(self, split: RegionSplit, plan: ChunkPlan, compile_chunk: Callable, record: Compilation):
        self.split, self.plan, self.record = split, plan, record
        self._compile = compile_chunk
        self._size: int | None = None if plan.whole_batch else plan.microbatch_size  # None: "auto", not chosen yet
        self._compiled: dict[tuple, Callable] = {}
        self._spec = fx.node.map_aggregate(split.output_spec,
                                           lambda x: _Ref(x) if isinstance(x, str) else x)

    def _chunk_fn(self, m: int, inputs: list, measure: bool = False) -> Callable:
        key = (m, *_signature(inputs))  # a chunk graph is compiled for static shapes
        if not measure and key in self._compiled:
            return self._compiled[key]
        log.debug("fxmem per-example: compiling the chunk graph for %d examples", m)
        chunk = self.split.make_chunk(m)
        update_plan(self.record, fused_norms=chunk.fused_norms)
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
        return microbatch.measured_peak(
            self._device(env),
            lambda: self._loop(env, m, lambda size, ins: fn(*ins) if size == m else
                               self._chunk_fn(size, ins, measure=True)(*ins)),
            warm_up=lambda: fn(*self._inputs(env, 0, m)))  # first-call allocations are not the step's

    def _device(self, env: dict) -> torch.device:
        for v in env.values():
            if isinstance(v, torch.Tensor):
                return v.device
        return torch.device("cpu")

    def _choose(self, env: dict) -> int:
        """The largest m whose measured step peak fits the budget, with m + 1 measured over it
        (or m = the batch): ``microbatch.search`` from m = 1 and 4, every size measured exactly;
        the record gets the measurements (also when the search fails) and the size."""
        choice = microbatch.AutoChoice(self.plan.memory_budget, self._batch(env))
        try:
            m = microbatch.search(choice, lambda m: self._step_peak(env, m), (1, min(choice.max_size, 4)))
        finally:
            update_plan(self.record, measured=choice.measured)
        update_plan(self.record, microbatch_size=m)
        log.info("fxmem per-example: microbatch_size=auto chose %d of %d (budget %d bytes, "
                 "measured peak %d)", m, choice.max_size, choice.budget, choice.measured[m])
        return m

    def _batch(self, env: dict) -> int:
        """This call's batch size, read off a batched input (dynamic graphs vary it)."""
        name, dim = next((n, d) for n, d in self.split.chunk_inputs if d is not None)
        return env[name].shape[dim]

    def _loop(self, env: dict, m: int, run: Callable) -> dict:
        """The chunk graph over the batch in chunks of m (``microbatch.run_chunks``): the batch
        sums and per-example outputs by name. ``run(size, inputs)`` runs one chunk."""
        split, n = self.split, len(self.split.partials)

        def chunk(start: int, size: int) -> tuple:
            ins = self._inputs(env, start, size)
            outs = run(size, ins)
            return outs[:n], outs[n:], ins

        sums, parts = microbatch.run_chunks(self._batch(env), m, chunk, split.partial_dtypes,
                                            [dim for _, dim in split.chunk_batched_outputs])
        return {**dict(zip(split.partials, sums)),
                **{name: t for (name, _), t in zip(split.chunk_batched_outputs, parts)}}

    def __call__(self, *args):
        split = self.split
        env = dict(zip(split.outer_outputs, split.outer(*args)))
        if self.plan.whole_batch:
            m = self._batch(env)
        else:
            if self._size is None:
                self._size = self._choose(env)
            m = self._size
        env.update(self._loop(env, m, lambda size, ins: self._chunk_fn(size, ins)(*ins)))
        env.update(zip(split.rest_outputs, split.rest(*[env[n] for n in split.rest_inputs])))
        return fx.node.map_aggregate(self._spec, lambda x: env[x] if isinstance(x, _Ref) else x)
