"""Equivalence checks for users' own models: fxmem's training step against a reference."""
from __future__ import annotations

import copy
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch


@dataclass
class StepCheck:
    """What :func:`assert_same_training_step` compared (for further assertions)."""
    loss: float
    max_grad_rel_err: float
    planned_saved_bytes: list[int] = field(default_factory=list)
    held_bytes: int | None = None
    graphs: int = 0


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = b.detach().abs().max().clamp_min(1e-12)
    return ((a.detach() - b.detach()).abs().max() / scale).item()


def _loss(out: Any) -> torch.Tensor:
    loss = getattr(out, "loss", out)
    if not (isinstance(loss, torch.Tensor) and loss.numel() == 1):
        raise ValueError("assert_same_training_step: the model must return a scalar loss "
                         f"(or an object with .loss), got {type(out).__name__}")
    return loss


def _step(model, inputs, seed, between: Callable[[], None] = lambda: None):
    """The loss and every parameter's gradient (the model's output dropped once the loss is read,
    as a training loop does); ``between`` runs after the forward, before the backward."""
    torch.manual_seed(seed)
    loss = _loss(model(**inputs))
    params = [p for p in model.parameters() if p.requires_grad]
    between()
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    return loss, grads


def assert_same_training_step(model: torch.nn.Module, inputs: Mapping[str, Any],
                              options: Mapping[str, Any] | None = None, *, rtol: float = 1e-5,
                              atol: float = 1e-7, reference: str = "eager", dynamic: bool = False,
                              seed: int = 0, check_saved_bytes: bool = True,
                              reset: bool = True) -> StepCheck:
    """Compile a copy of ``model`` with fxmem, run one forward + backward on ``inputs`` and assert
    that loss and every parameter gradient equal ``reference``'s: ``"eager"``, or
    ``"unoptimized"``, the same graph (with the same pattern lowering, so that random ops draw
    the same numbers) split without any recompute: use it with dropout, since a compiled graph
    draws its random numbers differently from eager. ``reset`` clears Dynamo's caches first (repeated checks of one
    model class would otherwise hit Dynamo's recompile limit and silently run eagerly). Also checks the
    report's claim: the saved bytes each plan
    predicts (its formula evaluated at this run's shape) equal the bytes autograd actually held
    between forward and backward. ``options`` default to the eager inner compiler (fast)."""
    from ..compilation import compilations

    options = {"inner": "eager", **dict(options or {})}
    ref_model, test_model = copy.deepcopy(model), copy.deepcopy(model)
    if reference not in ("eager", "unoptimized"):
        raise ValueError(f"reference must be 'eager' or 'unoptimized', got {reference!r}")
    if reset:
        torch._dynamo.reset()
    ref_fn = ref_model if reference == "eager" else torch.compile(ref_model, backend=_unoptimized(options))
    ref_loss, ref_grads = _step(ref_fn, inputs, seed)

    if reset:
        torch._dynamo.reset()
    compiled = torch.compile(test_model, backend="fxmem", options=options, dynamic=dynamic)
    keep = {t.untyped_storage().data_ptr() for t in [*test_model.parameters(), *test_model.buffers()]}
    keep |= {t.untyped_storage().data_ptr() for t in inputs.values() if isinstance(t, torch.Tensor)}
    saved: dict[int, tuple[int, weakref.ref]] = {}
    held: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        # A 0-d float64 is a Python float Dynamo passed as a graph input (dynamic shapes
        # "tensorify" floats, e.g. a norm's eps): an input, like the model's own, not an activation.
        lifted_float = t.dim() == 0 and t.dtype == torch.float64
        if ptr not in keep and not lifted_float:
            saved[ptr] = t.untyped_storage().nbytes(), weakref.ref(t)
        return t

    def at_backward():  # held between forward and backward: still saved once the output is dropped
        # (returned logits' operands, fxmem.lowering.returned, are freed with the logits)
        held.update({ptr: n for ptr, (n, ref) in saved.items() if ref() is not None})

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss, grads = _step(compiled, inputs, seed, at_backward)
    torch.testing.assert_close(loss, ref_loss, rtol=rtol, atol=atol,
                               msg=lambda m: f"fxmem changed the loss: {m}")
    worst = 0.0
    names = [n for n, p in test_model.named_parameters() if p.requires_grad]
    for name, g, r in zip(names, grads, ref_grads):
        if (g is None) != (r is None):
            raise AssertionError(f"{name}: gradient is {'missing' if g is None else 'present'} "
                                 "under fxmem but not in the reference")
        if g is not None:
            torch.testing.assert_close(g, r, rtol=rtol, atol=atol,
                                       msg=lambda m, name=name: f"fxmem changed the gradient of {name}: {m}")
            worst = max(worst, _rel(g, r))
    comps = compilations(compiled)
    ids = {id(p) for p in test_model.parameters()}
    comps = [c for c in comps if c.inputs & ids] or comps[-1:]  # else a cached graph served this call
    records = [g for c in comps for g in c.graphs]  # none for a graph that fell back
    if not comps:
        raise AssertionError("fxmem compiled no training graph for this model (Dynamo fell back to "
                             "eager: recompile limit, or a graph break before any tensor op?)")
    check = StepCheck(loss.item(), worst, graphs=len(records))
    shapes = {k: tuple(v.shape) for k, v in inputs.items() if isinstance(v, torch.Tensor)}
    for r in records:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            named = r.report.inputs()
            check.planned_saved_bytes.append(
                r.report.evaluate(r.report.saved_expr, **{k: v for k, v in shapes.items() if k in named})
                if dynamic else r.plan.saved_bytes)
    check.held_bytes = sum(held.values())
    if check_saved_bytes and len(records) == 1:
        assert check.held_bytes == check.planned_saved_bytes[0], (
            f"the plan says {check.planned_saved_bytes[0]} bytes are kept for backward; "
            f"autograd held {check.held_bytes}")
    return check


def _unoptimized(options: Mapping[str, Any]):
    """A backend that lowers patterns as fxmem decides to with ``options`` and then splits the joint
    graph as a plain partition would (keep everything the backward reads), through fxmem's own
    split and the eager inner compiler: fxmem without its recompute planner."""
    from torch._dynamo.backends.common import aot_autograd

    from ..graph.joint import JointGraph
    from ..inner import eager, eager_kernels
    from ..lowering import reattached
    from ..lowering.decide import decide
    from ..options import resolve
    from ..remat.partition import compare
    from ..remat.settings import PlanSettings
    from ..remat.split import split

    opts = resolve(dict(options))
    settings = PlanSettings.of(opts, inner="eager")

    def backend(gm, example_inputs):
        # fxmem's own decision: the kept lowerings draw alike
        decision = decide(gm, example_inputs, opts)

        def partition(gm, _inputs, *, num_fwd_outputs, **_):
            if decision.compared is not None:
                gm = compare(gm, num_fwd_outputs, settings, decision.compared)[0]
            joint = JointGraph.of(gm, num_fwd_outputs)
            result = split(joint, joint.default_saved())
            return result.fw, result.bw

        with eager_kernels():  # traced as fxmem's eager inner compiler traces
            compiled = aot_autograd(fw_compiler=eager, bw_compiler=eager,
                                    partition_fn=partition)(decision.gm, example_inputs)
        return reattached(compiled, decision.lowering.returned)  # the graph's own outputs (lowering.returned)

    return backend


def per_example_reference(loss_fn, params: dict, batch: tuple, clipping_norm: float):
    """The explicit per-example Python loop: ``(sum_i min(1, C/||g_i||) g_i, norms)``."""
    from torch.func import grad

    total, norms = {k: torch.zeros_like(v, dtype=torch.float64) for k, v in params.items()}, []
    for i in range(batch[0].shape[0]):
        g = grad(loss_fn)(params, *[b[i] for b in batch])
        norm = torch.sqrt(sum((v.double() ** 2).sum() for v in g.values()))
        factor = min(1.0, clipping_norm / norm.item()) if norm > 0 else 1.0
        for k, v in g.items():
            total[k] += factor * v.double()
        norms.append(norm)
    return total, torch.stack(norms)


def assert_same_clipped_sum(loss_fn, params: dict, batch: tuple, clipping_norm: float = 1.0, *,
                            microbatch_size: Any = None, options: Mapping[str, Any] | None = None,
                            rtol: float = 1e-5, atol: float = 1e-7):
    """``fxmem.dpsgd.clipped_grad`` (compiled with fxmem, chunked by ``microbatch_size``) equals
    the explicit per-example loop; returns ``(sums, norms)``. ``loss_fn(params, *example)`` sees
    one example (no batch dim); every tensor of ``batch`` is batched along dim 0."""
    from ..dpsgd import clipped_grad

    fn = clipped_grad(loss_fn, clipping_norm, batch_argnums=tuple(range(1, 1 + len(batch))),
                      microbatch_size=microbatch_size, return_norms=True,
                      options={"inner": "eager", **dict(options or {})})
    sums, norms = fn(params, *batch)
    want, want_norms = per_example_reference(loss_fn, params, batch, clipping_norm)
    torch.testing.assert_close(norms.double(), want_norms, rtol=rtol, atol=atol)
    for k in want:
        torch.testing.assert_close(sums[k].double(), want[k], rtol=rtol, atol=atol,
                                   msg=lambda m, k=k: f"clipped sum of {k} differs from the loop: {m}")
    return sums, norms
