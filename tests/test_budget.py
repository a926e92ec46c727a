"""memory_budget: never refused, monotone, and PyTorch's own memory-budget cases (adapted from
test/functorch/test_ac.py: a chain of matmuls, and matmuls of unequal cost)."""

import copy
import re
import warnings

import pytest
import torch

import fxmem
from fxmem.models import build
from fxmem.profiling import step_perf

U = 128  # test_ac.py's unit is 512 (1 MiB fp32 squares); 128 keeps the matmuls fast: 64 KiB squares
UNIT = U * U * 4


def _compile(f, budget, **options):
    torch._dynamo.reset()
    return torch.compile(f, backend="fxmem", options={"inner": "eager", "memory_budget": budget, **options})


def _graph(fn):
    (graph,) = [g for c in fxmem.compilations(fn) for g in c.graphs]
    return graph


def _recomputed_mm(graph) -> list[tuple[int, ...]]:
    """Shapes of the matmuls the backward runs again."""
    return sorted(tuple(n.meta["val"].shape) for n in graph.split.recomputed if n.target == torch.ops.aten.mm.default)


def _check_grads(f, fn, inputs):
    ref = [t.detach().clone().requires_grad_() for t in inputs]
    f(*ref).backward()
    for t in inputs:
        t.grad = None
    fn(*inputs).backward()
    for a, b in zip(inputs, ref):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)


def _chain(x, *ws):
    x = x.cos()
    for w in ws:
        x = torch.mm(x, w).cos()
    return x.sum()


@pytest.mark.slow
def test_matmul_chain_saves_at_most_the_budget_recomputing_one_matmul_per_unit_below():
    """test_ac.py's test_matmul_even_chain: ``x.cos()`` then five ``mm(., w).cos()``. Recomputing
    the cosines is free, so 5 units is the most worth saving; each unit less recomputes one more
    matmul, down to none saved at budget 0 (every matmul again in the backward)."""
    torch.manual_seed(0)
    inputs = [torch.randn(U, U, requires_grad=True) for _ in range(6)]
    for k in range(6):
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            fn = _compile(_chain, k * UNIT)
            _check_grads(_chain, fn, inputs)
        # Every budget is met. Saving nothing recomputes the whole chain at the backward's start,
        # all of it alive at once (11 units against 8): that one cap warns that its peak is higher.
        msgs = [str(r.message) for r in record if "memory_budget" in str(r.message)]
        assert len(msgs) == (k == 0), msgs
        if k == 0:
            assert msgs[0] == "fxmem memory_budget=0 is met only at a higher peak (720,900 bytes, not 524,288); " \
                              "memory_budget=0.0 asks for the least peak"
            assert any("is met only by plans that peak higher than a higher budget's: simulated peak 720900 bytes "
                       "against 524288" in n for n in _graph(fn).plan.notes)
        graph = _graph(fn)
        assert graph.plan.saved_bytes == k * UNIT
        assert _recomputed_mm(graph) == [(U, U)] * (5 - k)


def _pairs(f, shapes):
    """test_ac.py's create_pair: x [a, a] and w [a, b] (units of U) make an [a, b] product that
    costs a * a * b unit matmuls."""
    torch.manual_seed(0)
    return [t for a, b in shapes for t in (torch.randn(a * U, a * U, requires_grad=True),
                                           torch.randn(a * U, b * U, requires_grad=True))]


def _products(*xws):
    return sum(torch.mm(x, w).cos().sum() for x, w in zip(xws[::2], xws[1::2]))


@pytest.mark.slow
@pytest.mark.parametrize("shapes, units, saved, recomputed", [
    # test_prioritize_cheaper_matmul: two 4-unit products, 4 and 8 unit matmuls; half the budget
    # keeps the dearer one and recomputes x1 @ w1.
    ([(1, 4), (2, 2)], 4, 4, [(1, 4)]),
    # test_prioritize_cheaper_matmul2: products of 16, 12, 12 units costing 64, 72, 24. 28 units
    # recompute the cheapest (2 x 6); 16 units keep only the dearest per unit (6 x 2), not the
    # 16-unit one that would fill the budget exactly.
    ([(4, 4), (6, 2), (2, 6)], 28, 28, [(2, 6)]),
    ([(4, 4), (6, 2), (2, 6)], 16, 12, [(2, 6), (4, 4)]),
], ids=["two", "three-28", "three-16"])
def test_the_cheapest_matmul_is_recomputed_first(shapes, units, saved, recomputed):
    inputs = _pairs(_products, shapes)
    fn = _compile(_products, units * UNIT)
    _check_grads(_products, fn, inputs)
    graph = _graph(fn)
    assert graph.plan.saved_bytes == saved * UNIT
    assert _recomputed_mm(graph) == sorted((a * U, b * U) for a, b in recomputed)


@pytest.mark.slow
def test_cap_below_every_plan_warns_once_and_takes_the_least_peak():
    """A fraction of 1e-6 (no plan saves that little without peaking higher): fxmem plans as for
    fraction 0 (the least simulated peak) with one warning that names the cap and what was reached
    (``strict=True`` raises instead: test_plan.py)."""
    w = build("tiny_gpt", batch=2, seq=8, layers=1, d=16, heads=2, vocab=32)
    with pytest.warns(UserWarning) as record:
        fn = _compile(copy.deepcopy(w.model), 1e-6, lowering=False)
        w.loss(fn(**w.batch)).backward()
    msgs = [str(r.message) for r in record if "memory_budget" in str(r.message)]
    assert len(msgs) == 1, msgs
    plan = _graph(fn).plan
    assert msgs[0].startswith("fxmem memory_budget=1e-06 is infeasible (the least is ")
    assert re.search(r"; using the least-peak plan \([\d,]+ bytes; strict=True raises\)$", msgs[0]), msgs[0]
    (note,) = [n for n in plan.notes if "is infeasible" in n]  # the details: in the report
    assert note.startswith("option 'memory_budget': 1e-06 (0 bytes of saved activations) is infeasible; the "
                           "smallest feasible budget is ")
    assert f"; using the plan of least simulated peak instead: {plan.saved_bytes} bytes saved, " in note
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # fraction 0 asks for that plan: no warning
        fn0 = _compile(copy.deepcopy(w.model), 0.0, lowering=False)
        w.loss(fn0(**w.batch)).backward()
    assert [n.name for n in _graph(fn0).plan.saved] == [n.name for n in plan.saved]


NARROW = dict(batch=4, seq=64, layers=3, vocab=256, d=32, heads=2)
FRACTIONS = (0.9, 0.7, 0.5, 0.3, 0.1, 0.0)


def _measured(w, options):
    """(loss, grads, measured peak of the second step) of the compiled model; dropout draws the
    same masks as eager from the same seed."""
    model = copy.deepcopy(w.model)
    fn = torch.compile(model, backend="fxmem", options={"inner": "eager", **options})
    for _ in range(2):  # the second step is measured: no compile, same allocations
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        with step_perf("cpu") as perf:
            loss = w.loss(fn(**w.batch))
            loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, perf.result.peak_bytes


@pytest.mark.slow
@pytest.mark.parametrize("name, kwargs", [
    ("hf_gpt2", dict(NARROW, dropout=0.1)),  # the zoo's 16 models: bench/studies/budget_zoo.py
    ("mlp_chain", dict(batch=16, width=64, depth=4)),
])
def test_measured_peak_falls_with_the_fraction_down_to_level1s(name, kwargs):
    w = build(name, **kwargs)
    torch.manual_seed(1)
    model = copy.deepcopy(w.model)
    ref_loss = w.loss(model(**w.batch))
    ref_loss.backward()
    torch._dynamo.reset()
    *_, level1 = _measured(w, {"level": 1})
    last = None
    for frac in FRACTIONS:
        torch._dynamo.reset()
        loss, grads, peak = _measured(w, {"memory_budget": frac})
        torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=0)
        for n, p in model.named_parameters():
            torch.testing.assert_close(grads[n], p.grad, rtol=1e-4, atol=1e-6, msg=f"{frac}: {n}")
        assert last is None or peak <= last[1], f"fraction {frac} peaked at {peak} bytes, above {last[0]}'s {last[1]}"
        last = (frac, peak)
    assert last[1] <= level1, f"fraction 0 peaked at {last[1]} bytes, above level 1's {level1}"


def _gap(graph, cap):
    """(fxmem's recompute cost, the exact optimum's) at ``cap`` saved bytes, priced alike."""
    from fxmem.remat.budget import _cost
    from fxmem.remat.split import Walk
    from fxmem.testing.ilp import least_recompute

    p = graph.plan.problem
    best = least_recompute(p, cap)
    assert best is not None and best.saved_bytes <= cap
    return _cost(Walk(p.joint), p, list(graph.plan.saved)), best.cost


@pytest.mark.slow
def test_the_exact_solver_agrees_on_the_chain_and_bounds_fxmem_on_a_model():
    """The reference ILP (fxmem.testing.ilp) finds test_ac's chain optimum (fxmem's plan, 5 - k
    matmuls) and is a lower bound on fxmem's recompute cost for a transformer at every fraction."""
    torch.manual_seed(0)
    inputs = [torch.randn(U, U, requires_grad=True) for _ in range(6)]
    for k in (0, 2, 5):
        fn = _compile(_chain, k * UNIT)
        fn(*inputs).backward()
        ours, best = _gap(_graph(fn), k * UNIT)
        assert best <= ours <= best * 1.01  # the same matmuls; fxmem may run a cosine more
    w = build("hf_llama", **NARROW)
    for frac in (0.7, 0.3):
        fn = _compile(copy.deepcopy(w.model), frac)
        w.loss(fn(**w.batch)).backward()
        graph = _graph(fn)
        ours, best = _gap(graph, graph.plan.saved_bytes)
        assert best <= ours * (1 + 1e-9)


@pytest.mark.slow
def test_peak_budget_takes_the_cheapest_plan_that_fits_and_warns_when_none_does():
    """peak_budget at 0.8x level 0's measured peak: measured within the cap (+3%), with more
    recompute than level 0; at 1 byte: one warning naming the least reachable peak, that plan used
    (strict raises). Gradients equal eager's throughout."""
    w = build("hf_gpt2", **dict(NARROW, layers=2, dropout=0.1))
    ref = copy.deepcopy(w.model)
    torch.manual_seed(1)
    w.loss(ref(**w.batch)).backward()
    *_, level0 = _measured(w, {})
    cap = int(0.8 * level0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # met: no warning
        _, grads, peak = _measured(w, {"peak_budget": cap})
    assert peak <= cap * 1.03, (peak, cap)
    for n, p in ref.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-4, atol=1e-6, msg=n)
    with pytest.warns(UserWarning, match=r"fxmem peak_budget=1 bytes is below every plan's step peak; using the "
                                         r"least-peak plan \([\d,]+ bytes; strict=True raises\)"):
        _, grads, _ = _measured(w, {"peak_budget": 1})
    for n, p in ref.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-4, atol=1e-6, msg=n)
    with pytest.raises(Exception, match="option 'peak_budget': 1 bytes is below every plan's simulated step peak"):
        _measured(w, {"peak_budget": 1, "strict": True})
