"""``clipped_grad``: the sum of clipped per-example gradients, compiled with fxmem.

    grad_fn = clipped_grad(loss_fn, clipping_norm=1.0, batch_argnums=(1, 2), microbatch_size=8)
    grads = grad_fn(params, x, y)          # same pytree as params: sum_i clip(grad loss_fn(params, x[i], y[i]))

``loss_fn`` is a *per-example* loss: it is called on one example, without its batch dim (as in
opake's ``clipped_grad`` and ``torch.func``'s per-sample-gradient recipe). The step that fxmem
compiles is::

    g, losses = vmap(grad_and_value(loss_fn, argnums), in_dims=(None, 0, 0, ...))(*args)
    *sums, norms = clip_and_sum(C, weighted, *g_leaves[, weights])   # fxmem/per_example/clip.py

``clip_and_sum`` is plain PyTorch (per leaf ``nan_to_num``, two-stage per-example norms, the clip
factor ``min(1, C' / norm)``, the clip-weighted batch sum as a matrix-vector product) that
Dynamo keeps as one call, so tracing it costs nothing per parameter. fxmem's per-example pass
(``fxmem/per_example``) finds the ``vmap`` region and this call (per-example norms, then sums over
the batch) and runs them chunk by chunk when ``microbatch_size`` is set: the
``[batch, *param]`` per-example gradients never exist at once. The clipping convention (no
additive epsilon, a few ULPs given up so that every clipped norm is <= C, non-finite elements
counted as 0) is in ``clip.py``'s docstring.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import os
import types
import weakref
from typing import Any, Callable, Mapping, Sequence

import torch
from torch.func import grad_and_value, vmap
from torch.utils import _pytree as pytree

from ..graph_breaks import break_count, breaks_since, ignore_once_warnings
from ..per_example import microbatch
from ..per_example.clip import clip_and_sum, clip_factor
from ..warn import warn

__all__ = ["ClippedGradFn", "clip_factor", "clipped_grad"]



# --- argument checks (each error names the argument) ------------------------------------------


def _argnums(value: Any, name: str) -> tuple[int, ...]:
    items = (value,) if isinstance(value, int) and not isinstance(value, bool) else value
    if not isinstance(items, (tuple, list)) or not items or not all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in items):
        raise ValueError(f"clipped_grad: {name} must be a non-negative int or a non-empty tuple of "
                         f"them, got {value!r}")
    if len(set(items)) != len(items):
        raise ValueError(f"clipped_grad: {name} has repeated positions: {value!r}")
    return tuple(items)


def check_clipping_norm(value: Any, where: str = "clipped_grad") -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or math.isnan(value) or value <= 0:
        raise ValueError(f"{where}: clipping_norm must be a positive number (inf = no clipping), "
                         f"got {value!r}")
    return float(value)


def check_clipping_norms(value: Any, where: str = "clipped_grad") -> float | tuple[float, ...]:
    """C as a float (flat clipping), or a non-empty list/tuple of them, one bound per gradient
    leaf (per-layer clipping) as a tuple: what ``clip_and_sum`` takes."""
    if isinstance(value, (list, tuple)):
        if not value:
            raise ValueError(f"{where}: clipping_norm must be a positive number or a non-empty list "
                             f"of them (one per gradient leaf), got {value!r}")
        return tuple(check_clipping_norm(v, where) for v in value)
    return check_clipping_norm(value, where)


def _compile_options(microbatch_size, memory_budget, options) -> dict[str, Any]:
    from ..options import resolve

    if options is None:
        options = {}
    if not isinstance(options, Mapping):
        raise ValueError(f"clipped_grad: options must be a dict of fxmem options, got {options!r}")
    for key in ("microbatch_size", "memory_budget"):
        if key in options:
            raise ValueError(f"clipped_grad: pass {key} as clipped_grad's own argument, not in options")
    merged = {**options, "microbatch_size": microbatch_size}
    if memory_budget is not None:
        merged["memory_budget"] = memory_budget
    try:
        resolved = resolve(merged)  # every option checked now, not at the first call
        if resolved.microbatch_size == "auto":
            microbatch.auto_budget(resolved.memory_budget)
    except ValueError as e:
        raise ValueError(f"clipped_grad: {e}") from None
    return merged


# --- the compiled step --------------------------------------------------------------------------


def _make_step(loss_fn: Callable, clipping_norm: float | tuple[float, ...], argnums: tuple[int, ...] | int,
               batch_argnums: tuple[int, ...], return_norms: bool, return_losses: bool,
               weighted: bool = False):
    """The compiled step. ``weighted``: its last argument is the examples' weights ``[B]`` (see
    ``per_example/microbatch.py``); they pass through the ``vmap`` so that the per-example pass
    sees them as per-example values, and scale the clip factors.

    Only the batch arguments (and the weights) go through ``vmap``; the others, the parameters
    among them, reach the loss from the enclosing call as they are, which is what
    ``in_dims=None`` gives them. Dynamo inlines ``vmap``'s handling of its inputs leaf by leaf
    (flatten, in_dims broadcast, unflatten), so this spares it a walk over every parameter at the
    first call."""
    position = {arg: k for k, arg in enumerate(batch_argnums)}  # batch argument -> its place in vmap's inputs

    def clipped_grad_step(*args):
        given = args[:-1] if weighted else args

        def per_example(*examples):
            one = tuple(examples[position[i]] if i in position else a for i, a in enumerate(given))
            return *grad_and_value(loss_fn, argnums=argnums)(*one), *examples[len(position):]

        g, losses, *weights = vmap(per_example, randomness="different")(
            *(given[i] for i in batch_argnums), *args[len(given):])
        leaves, spec = pytree.tree_flatten(g)
        *sums, norms = clip_and_sum(clipping_norm, weighted, *leaves, *weights)
        if not weighted:  # one batch, no chunk sums to add up: round the sums now
            sums = [s.to(leaf.dtype) for s, leaf in zip(sums, leaves)]
        out = (pytree.tree_unflatten(sums, spec),)
        if return_norms:
            out += (norms,)
        if return_losses:
            out += (losses,)
        return out

    # Dynamo keeps its compile cache and its recompile limit per *code object*: a fresh code
    # object per clipped_grad keeps several of them (different models) from evicting each other
    # and from sending each other to the eager fallback after `recompile_limit` compiles.
    code = clipped_grad_step.__code__.replace()
    return types.FunctionType(code, clipped_grad_step.__globals__, clipped_grad_step.__name__,
                              clipped_grad_step.__defaults__, clipped_grad_step.__closure__)


def _unlogged_side_effects():
    """Dynamo's side-effect replay without its log messages, where nobody would read them.

    ``make_functional``'s function swaps the tensors into each module's ``_parameters`` and
    back, so the step mutates one dict per module. Under Dynamo's default policy ("info") each
    compile formats a message with the user's stack for every mutated object, for
    ``TORCH_LOGS=side_effects`` and tlparse, whether or not either listens: a tenth of a second
    on the README model's first call. "silent" replays the same side effects without the
    messages; it is used only while the policy is the default and neither the side-effects
    log nor a structured trace (``TORCH_TRACE``) is on."""
    from torch._logging._internal import LazyTraceHandler, log_state, trace_log

    # torch installs a LazyTraceHandler that writes nothing unless TORCH_TRACE gave it a folder
    # (or the job runs on Meta's MAST)
    tracing = os.environ.get("MAST_HPC_JOB_NAME") is not None or any(
        not isinstance(h, LazyTraceHandler) or h.root_dir is not None for h in trace_log.handlers)
    config = torch._dynamo.config
    if config.side_effect_replay_policy != "info" or log_state.is_artifact_enabled("side_effects") or tracing:
        return contextlib.nullcontext()
    return config.patch(side_effect_replay_policy="silent")


class ClippedGradFn:
    """What :func:`clipped_grad` returns: ``fn(*args)`` -> grads, or a tuple ``(grads, norms?,
    losses?)`` when ``return_norms``/``return_losses`` is set. ``compiled`` is the
    ``torch.compile``d step (for ``fxmem.report``); ``plans`` what fxmem's per-example pass
    decided at each compile (microbatch size, measured peaks, or why it did not chunk);
    ``chosen_microbatch_size()`` the size in use."""

    def __init__(self, loss_fn, clipping_norm, argnums, batch_argnums, microbatch_size,
                 memory_budget, return_norms, return_losses, options):
        self.loss_fn = loss_fn
        self.clipping_norm = clipping_norm
        self.argnums = argnums
        self.batch_argnums = batch_argnums
        self.microbatch_size = microbatch_size
        self.memory_budget = memory_budget
        self.return_norms = return_norms
        self.return_losses = return_losses
        self.options = options
        grad_argnums = argnums[0] if len(argnums) == 1 else argnums
        self._grad_argnums = grad_argnums
        # An int microbatch (or "auto", once it has chosen one): the compiled step always sees
        # exactly that many examples (the last chunk padded, see per_example/microbatch.py), so every batch
        # size runs on one compile.
        self._fixed = microbatch_size is not None
        self._m = microbatch_size if isinstance(microbatch_size, int) else None
        self.auto: microbatch.AutoChoice | None = None  # what "auto" decided
        self._step = _make_step(loss_fn, clipping_norm, grad_argnums, batch_argnums,
                                return_norms, return_losses, weighted=self._fixed)
        ignore_once_warnings()  # HF's logger.warning_once would split the vmap region
        self._compiled_at: dict[int, Callable] = {}
        self.compiled = self._compile_at(self._m) if self._fixed else \
            torch.compile(self._step, backend="fxmem", options=options)
        # fxmem.per_example.ChunkPlan of every compile of this step, oldest first: each the latest
        # plan of its compile's record (weakly held: it dies with its compiled function)
        self.plans: list = []
        self._records: list[weakref.ref] = []
        self._warned = False

    def __repr__(self) -> str:
        return (f"ClippedGradFn(clipping_norm={self.clipping_norm}, argnums={self.argnums}, "
                f"batch_argnums={self.batch_argnums}, microbatch_size={self.microbatch_size!r}, "
                f"memory_budget={self.memory_budget!r})")

    def _read_plans(self, records: list) -> None:
        """``plans`` from the records of this step's compiles, where the per-example pass records
        its plan (a decision taken at run time replaces a record's plan with a new one)."""
        for c in records:
            if c.chunk_plan is not None and all(r() is not c for r in self._records):
                self._records.append(weakref.ref(c))
                self.plans.append(c.chunk_plan)
        latest = [r() for r in self._records]
        self.plans = [p if c is None else c.chunk_plan for c, p in zip(latest, self.plans)]

    def batch_size(self, args: Sequence[Any]) -> int:
        """The batch size of ``args`` (the size of dim 0 shared by every batch argument)."""
        need = max(self.argnums + self.batch_argnums) + 1
        if len(args) < need:
            raise ValueError(f"clipped_grad: got {len(args)} positional arguments; argnums="
                             f"{self.argnums} and batch_argnums={self.batch_argnums} need at least {need}")
        sizes = {}
        for i in self.batch_argnums:
            leaves = [t for t in pytree.tree_leaves(args[i]) if isinstance(t, torch.Tensor)]
            if not leaves:
                raise ValueError(f"clipped_grad: batch argument {i} (batch_argnums) holds no tensor")
            for t in leaves:
                if t.dim() == 0:
                    raise ValueError(f"clipped_grad: batch argument {i} (batch_argnums) has a 0-dim "
                                     "tensor; every batch tensor needs the batch as dim 0")
                sizes.setdefault(t.shape[0], []).append(i)
        if len(sizes) != 1:
            detail = "; ".join(f"size {b}: argument(s) {sorted(set(ix))}" for b, ix in sizes.items())
            raise ValueError(f"clipped_grad: batch arguments (batch_argnums={self.batch_argnums}) "
                             f"have different batch sizes (dim 0): {detail}")
        return next(iter(sizes))

    def __call__(self, *args):
        from ..compilation import compilations

        batch = self.batch_size(args)
        if isinstance(self.clipping_norm, tuple):
            leaves = [t for i in self.argnums for t in pytree.tree_leaves(args[i]) if isinstance(t, torch.Tensor)]
            if len(leaves) != len(self.clipping_norm):
                raise ValueError(f"clipped_grad: clipping_norm has {len(self.clipping_norm)} bounds (per-layer "
                                 f"clipping) for {len(leaves)} differentiated tensors: give one per tensor, "
                                 "in the order of the arguments' pytree leaves")
        if batch == 0:
            return self._empty(args)
        breaks = break_count()
        # The result is a clipped gradient, not something to differentiate again: running the
        # compiled step without autograd tracking gives AOTAutograd a forward-only graph (and
        # the per-example pass chunks only such graphs).
        with torch.no_grad(), _unlogged_side_effects():
            if self._fixed and self._m is None:
                self._choose(args, batch)
            out = self._in_chunks(args, batch) if self._fixed else self.compiled(*self._static_examples(args))
        params = [t for i in self.argnums for t in pytree.tree_leaves(args[i]) if isinstance(t, torch.Tensor)]
        self._read_plans(compilations(self.compiled, match=params))
        if self.microbatch_size is not None and not self._warned and self.chosen_microbatch_size() is None:
            self._warned = True  # once: the same step would say the same every call
            why = (self.plans[-1].reason if self.plans and self.plans[-1].reason else
                   "no whole vmap(grad) region reached fxmem's backend (graph breaks: "
                   f"{'; '.join(breaks_since(breaks)) or 'none counted; was the step served by a cache?'})")
            warn(f"fxmem clipped_grad: microbatch_size={self.microbatch_size!r} was asked for, but the step runs "
                 f"unchunked: {why}", RuntimeWarning, detail=f"fxmem clipped_grad: the step runs unchunked: {why}")
        if not self.return_norms and not self.return_losses:
            return out[0]
        return out

    def _in_chunks(self, args, batch: int) -> tuple:
        """The compiled step over chunks of exactly ``microbatch_size`` examples
        (``microbatch.run_chunks``), the last one padded with examples of weight 0; sums added
        up in float32, per-example outputs cut to the real examples."""
        m = self._m
        device = self._batch_tensor(args).device
        spec = None

        def chunk(start: int, size: int) -> tuple:
            nonlocal spec
            chunk_args, weights = microbatch.pad(args, self.batch_argnums, start, size, m, device)
            out = self.compiled(*chunk_args, weights)
            leaves, spec = pytree.tree_flatten(out[0])
            return leaves, out[1:], chunk_args

        dtypes = [t.dtype for t in pytree.tree_leaves(self._diff_args(args)) if isinstance(t, torch.Tensor)]
        sums, per_example = microbatch.run_chunks(batch, m, chunk, dtypes)
        return (pytree.tree_unflatten(sums, spec), *per_example)

    def _static_examples(self, args) -> list:
        """``args`` with each batch tensor replaced by a view of it whose dims after the batch
        dim Dynamo keeps static (``mark_static``; the view, not the caller's tensor, carries
        the mark). The batch dim may still become dynamic, but a per-example shape with a
        symbolic size fails inside functorch's batching rule of dropout (``Cannot call numel()
        on tensor with symbolic sizes``) at the second sequence length; so a new example shape
        compiles anew instead."""
        def static(t):
            if not isinstance(t, torch.Tensor) or t.dim() < 2:
                return t
            view = t.view_as(t)
            for d in range(1, t.dim()):
                torch._dynamo.mark_static(view, d)
            return view

        out = list(args)
        for i in self.batch_argnums:
            out[i] = pytree.tree_map(static, args[i])
        return out

    def _compile_at(self, m: int | None) -> Callable:
        """The step compiled for chunks of ``m`` (``"auto"``: one per size it tried)."""
        if m not in self._compiled_at:
            opts = {k: v for k, v in self.options.items() if k != "memory_budget"}
            # static shapes: every chunk has m examples, and a dim that Dynamo made dynamic
            # after a second sequence length would reach functorch's dropout under vmap, which
            # cannot take symbolic sizes (see _static_examples); each new shape compiles anew
            self._compiled_at[m] = torch.compile(self._step, backend="fxmem", dynamic=False,
                                                 options={**opts, "microbatch_size": m})
        return self._compiled_at[m]

    def _choose(self, args, batch: int) -> None:
        """``microbatch_size="auto"``: the largest chunk size (at most this first batch's size)
        whose compiled step fits ``memory_budget``, chosen once and kept. The search
        (``microbatch.search``) starts where the line through the uncompiled step's peaks on 1
        and 2 examples crosses the budget (eager keeps every per-example gradient, so the line
        over-estimates and its size is safe), and measures at most two compiled sizes: each
        measurement is a compile; a first one within 25% of the budget is kept."""
        device = self._batch_tensor(args).device
        sums = sum(t.numel() * 4 for t in pytree.tree_leaves(self._diff_args(args)) if isinstance(t, torch.Tensor))

        def peak(m: int, step: Callable, warm_up: bool) -> int:
            chunk, w = microbatch.pad(args, self.batch_argnums, 0, min(m, batch), m, device)
            return microbatch.measured_peak(device, lambda: step(*chunk, w),
                                            warm_up=(lambda: step(*chunk, w)) if warm_up else None)

        def compile_and_measure(m: int) -> int:
            self._m, self.compiled = m, self._compile_at(m)
            # a chunk after the first runs beside the running float32 sums
            return peak(m, self.compiled, warm_up=True) + sums

        c = self.auto = microbatch.AutoChoice(microbatch.auto_budget(self.memory_budget), batch)
        microbatch.search(c, compile_and_measure, probe=lambda m: peak(m, self._step, warm_up=False),
                          overhead=sums, max_measures=2, tolerance=0.25, what="fxmem clipped_grad")
        self._m, self.compiled = c.chosen, self._compile_at(c.chosen)

    def _diff_args(self, args):
        return args[self._grad_argnums] if isinstance(self._grad_argnums, int) else \
            tuple(args[i] for i in self._grad_argnums)

    def _batch_tensor(self, args) -> torch.Tensor:
        return next(t for i in self.batch_argnums for t in pytree.tree_leaves(args[i])
                    if isinstance(t, torch.Tensor))

    def _empty(self, args):
        grads = pytree.tree_map(lambda t: torch.zeros_like(t) if isinstance(t, torch.Tensor) else t,
                                self._diff_args(args))
        if not self.return_norms and not self.return_losses:
            return grads
        empty = torch.zeros(0, device=self._batch_tensor(args).device)
        return (grads,) + (empty,) * (int(self.return_norms) + int(self.return_losses))

    def chosen_microbatch_size(self) -> int | None:
        """The microbatch size of the latest compile (``"auto"`` resolved to a number), or None
        when it was not chunked (``microbatch_size=None``, or the per-example pass could not
        prove the graph chunkable: ``plans[-1].reason`` says why) or nothing ran yet."""
        plans = [p for p in self.plans if p.requested == self._m] if self._fixed else self.plans
        if not plans or not plans[-1].chunked:
            return None
        return plans[-1].microbatch_size


def clipped_grad(
    loss_fn: Callable[..., torch.Tensor],
    clipping_norm: float | Sequence[float],
    *,
    batch_argnums: int | Sequence[int] = 1,
    argnums: int | Sequence[int] = 0,
    microbatch_size: int | str | None = None,
    memory_budget: int | str | None = None,
    return_norms: bool = False,
    return_losses: bool = False,
    options: Mapping[str, Any] | None = None,
) -> ClippedGradFn:
    """A function of ``loss_fn``'s arguments that returns the sum over the batch of the clipped
    per-example gradients of ``loss_fn`` with respect to ``args[argnums]``.

    Args:
        loss_fn: per-example loss, ``loss_fn(*args) -> scalar``, called on ONE example: the
            arguments at ``batch_argnums`` without their batch dim.
        clipping_norm: C, the L2 bound of every per-example gradient (over all differentiated
            arguments together): the sum's sensitivity to adding or removing one example. A list
            of bounds, one per differentiated tensor (the pytree leaves of ``args[argnums]`` in
            order), clips per layer: each tensor's per-example gradient to its own bound, so the
            sensitivity is the L2 norm of the bounds (Opacus' ``clipping="per_layer"``).
        batch_argnums: positions of the arguments that carry the batch as dim 0 (tensors or
            pytrees of tensors, all with the same batch size).
        argnums: positions of the arguments to differentiate (no batch dim). An int gives grads
            in that argument's pytree; a tuple gives a tuple of them.
        microbatch_size: None (whole batch at once), a positive int m (the per-example region
            and its clipping run in chunks of exactly m examples, the last one padded with
            examples of weight 0: one compile serves every batch size, so Poisson-sampled
            batches never recompile), or "auto" (the largest m, at most the first batch's size,
            whose step fits in ``memory_budget``: predicted from two eager runs, checked by
            measuring the compiled step; see ``per_example/microbatch.py``; ``.auto`` records it).
        memory_budget: bytes (int, or "128MB", "1GiB"); required with "auto".
        return_norms: also return the per-example gradient norms before clipping, shape [B].
        return_losses: also return the per-example losses, shape [B].
        options: more fxmem options (``{"inner": "eager"}``, ``level``, ...).

    Returns:
        A :class:`ClippedGradFn` ``fn(*args)``: grads, or ``(grads, norms)``, ``(grads, losses)``
        or ``(grads, norms, losses)``. It runs without autograd tracking. Dropout inside
        ``loss_fn`` draws independently per example (``vmap(randomness="different")``).
    """
    if not callable(loss_fn):
        raise ValueError(f"clipped_grad: loss_fn must be callable, got {loss_fn!r}")
    C = check_clipping_norms(clipping_norm)
    argnums_t = _argnums(argnums, "argnums")
    batch_t = _argnums(batch_argnums, "batch_argnums")
    overlap = set(argnums_t) & set(batch_t)
    if overlap:
        raise ValueError(f"clipped_grad: argnums={argnums!r} and batch_argnums={batch_argnums!r} "
                         f"overlap at {sorted(overlap)}: differentiated arguments have no batch dim")
    mb = microbatch_size  # checked with every other option in _compile_options
    for name, flag in (("return_norms", return_norms), ("return_losses", return_losses)):
        if not isinstance(flag, bool):
            raise ValueError(f"clipped_grad: {name} must be True or False, got {flag!r}")
    opts = _compile_options(mb, memory_budget, options)
    return ClippedGradFn(loss_fn, C, argnums_t, batch_t, mb, memory_budget, return_norms,
                         return_losses, opts)
