"""What a memory budget must recompute: a lower bound for every plan, fxmem's and torch's plans.

    python bench/studies/budget_bound.py --name budget-bound --models hf_gpt2,hf_llama --fractions 0.96,0.9,0.7,0.5

fxmem's ``memory_budget`` fraction is of its level 0 plan's saved bytes, and level 0 already keeps
the least a plan can keep when only cheap ops (no matmul, no attention) are recomputed: it is a
minimum cut. A lower cap must recompute matmuls or attention. How much, at least, follows from
the parametric min-cut: for a recompute weight ``lam`` let ``V(lam)`` be the least
``bytes + lam * flops`` over all cuts. Any plan with ``bytes <= cap`` then recomputes at least
``(V(lam) - cap) / lam`` FLOPs, for every ``lam``; the best such bound is the lower convex hull of
the min-cut frontier at ``cap``. It is computed here with every forward op recomputable (the
vocabulary projection and layer boundaries included; random ops excepted), FLOPs of matmuls and
attention only (cheap ops free), and bytes as the planner counts them (a kept view counts its
storage). So no plan fxmem could make under the cap recomputes less.

For each fraction the table sets that bound against fxmem's plan (Inductor inner compiler, as the
timed configurations) and torch's ``activation_memory_budget`` plan at the same fraction (Inductor's
min-cut partition, captured when it runs): the matmul and attention FLOPs each recomputes, as a
share of the eager step's FLOPs (``torch.utils.flop_counter``). The same three figures are also
given in milliseconds: each matmul and attention node priced by the median time of its own op
alone, on random inputs of its shapes and strides (one thread, as the benchmarks). The time bound
is the same hull with those prices, so it is the least recompute time of any plan under the cap,
to set against the time torch's plan recomputes (attention runs slower per FLOP than a matmul on
this CPU). Step times are in ``bench/studies/interleaved.py``'s results.

Writes ``bench/results/<name>.{json,md}``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: configs, worker, common

import configs  # noqa: E402
import study  # noqa: E402  (bench/studies/, this script's directory)
from worker import workload  # noqa: E402

LAM_LO, LAM_HI = 1e-12, 1e6


def step_flops(model_name: str, quick: bool) -> float:
    """FLOPs of one eager training step (forward and backward)."""
    from torch.utils.flop_counter import FlopCounterMode

    wl, batch = workload(model_name, configs.model_kwargs(model_name, quick), 0, "cpu")
    with FlopCounterMode(display=False) as counter:
        wl.loss(wl.model(**batch)).backward()
    return float(counter.get_total_flops())


def heavy_flops(nodes) -> float:
    from fxmem.graph.cost import flops

    return sum(f for f in (flops(n) for n in nodes) if f)


_TIMES: dict[tuple, float] = {}


def op_ns(node) -> float:
    """Median nanoseconds of a matmul or attention node's op alone, on random inputs of its
    shapes and strides (this process's threads); 0 for ops without a FLOP formula (cheap ops)."""
    import statistics
    import time

    import torch
    import torch.fx as fx

    from fxmem.graph.cost import flops

    if not flops(node):
        return 0.0
    vals = lambda a: a.meta["val"] if isinstance(a, fx.Node) else a  # noqa: E731
    args, kwargs = fx.node.map_aggregate((node.args, node.kwargs), vals)
    key = (node.target, repr(fx.node.map_aggregate((args, kwargs), lambda v: (
        tuple(v.shape), v.stride(), v.dtype) if isinstance(v, torch.Tensor) else v)))
    if key not in _TIMES:
        def real(v):
            if not isinstance(v, torch.Tensor):
                return v
            t = torch.empty_strided(tuple(int(d) for d in v.shape), tuple(int(d) for d in v.stride()), dtype=v.dtype)
            return t.normal_() if t.is_floating_point() else t.zero_()

        a, k = fx.node.map_aggregate((args, kwargs), real)
        times = []
        for i in range(18):
            start = time.perf_counter_ns()
            node.target(*a, **k)
            if i >= 3:  # warm-up
                times.append(time.perf_counter_ns() - start)
        _TIMES[key] = float(statistics.median(times))
    return _TIMES[key]


def heavy_ns(nodes) -> float:
    return sum(op_ns(n) for n in nodes)


def lower_bound(problem, caps: list[int], cost) -> tuple[list[float], list[tuple[int, float]]]:
    """(least recompute ``cost`` (a function of a forward node) of any plan within each cap;
    the frontier's (bytes, cost) points)."""
    from fxmem.remat.allowlist import NEVER, kind
    from fxmem.remat.mincut import CutProblem, cut, frontier, saved_bytes

    joint = problem.joint
    fwd = [n for n in joint.gm.graph.nodes if n not in joint.backward and n.op == "call_function"]
    broad = CutProblem(joint, problem.nbytes, {n: cost(n) for n in fwd},
                       frozenset(n for n in fwd if kind(n) != NEVER))
    points = sorted({(saved_bytes(broad, s), cut(broad, lam)[1]) for s, lam in frontier(broad, LAM_LO, LAM_HI)},
                    key=lambda p: (-p[0], p[1]))

    def at(cap: int) -> float:
        if cap >= points[0][0]:
            return points[0][1]
        for (b0, c0), (b1, c1) in zip(points, points[1:]):
            if b1 <= cap <= b0:  # the hull's segment between two neighbouring cuts
                return c0 + (c1 - c0) * (b0 - cap) / (b0 - b1)
        return float("inf")  # below every cut: no plan keeps this little

    return [at(c) for c in caps], points


def fxmem_plan(model_name: str, quick: bool, fraction: float | None):
    """(plan, FLOPs and nanoseconds of the matmuls and attention its backward recomputes)."""
    import torch

    import fxmem
    from fxmem.remat.split import split

    torch._dynamo.reset()
    wl, batch = workload(model_name, configs.model_kwargs(model_name, quick), 0, "cpu")
    opts = {"inner": "inductor", **({"memory_budget": fraction} if fraction else {})}
    fn = torch.compile(wl.model, backend="fxmem", options=opts)
    wl.loss(fn(**batch)).backward()
    plan = _last_plan(fxmem, fn)
    rec = split(plan.problem.joint, list(plan.saved)).recomputed
    return plan, heavy_flops(rec), heavy_ns(rec)


def _last_plan(fxmem, fn):
    """The plan of the latest graph fxmem compiled for ``fn``: ``fxmem.compilations`` where fxmem
    has it (each Compilation's ``.graphs`` carry ``.plan``), else the report's live plans."""
    if hasattr(fxmem, "compilations"):
        return [g for c in fxmem.compilations(fn) for g in c.graphs][-1].plan
    return fxmem.report(fn).plans[-1]


def torch_plan(model_name: str, quick: bool, fraction: float) -> dict:
    """Matmul/attention FLOPs that Inductor's backward recomputes under ``activation_memory_budget``."""
    import torch
    import torch._inductor.compile_fx as cfx

    from fxmem.graph.joint import JointGraph

    seen = []
    original = cfx.min_cut_rematerialization_partition

    def capture(joint_module, joint_inputs, *, num_fwd_outputs, **kw):
        joint = JointGraph.of(joint_module, num_fwd_outputs)
        fwd_names = {n.name for n in joint.gm.graph.nodes if n not in joint.backward and n.op == "call_function"}
        fw, bw = original(joint_module, joint_inputs, num_fwd_outputs=num_fwd_outputs, **kw)
        rec = [n for n in bw.graph.nodes if n.name in fwd_names]
        seen.append({"recomputed_nodes": len(rec), "recomputed_heavy": sorted(n.name for n in rec if heavy_flops([n])),
                     "recompute_flops": heavy_flops(rec), "recompute_ns": heavy_ns(rec)})
        return fw, bw

    torch._dynamo.reset()
    cfx.min_cut_rematerialization_partition = capture
    try:  # no compile caches: a cache hit would skip the partitioner
        with torch._functorch.config.patch(activation_memory_budget=fraction, enable_autograd_cache=False), \
                torch._inductor.config.patch(fx_graph_cache=False):
            wl, batch = workload(model_name, configs.model_kwargs(model_name, quick), 0, "cpu")
            fn = torch.compile(wl.model, backend="inductor")
            wl.loss(fn(**batch)).backward()
    finally:
        cfx.min_cut_rematerialization_partition = original
    if len(seen) != 1:
        raise RuntimeError(f"expected one partitioned graph for {model_name}, got {len(seen)}")
    return seen[0]


def run(model_name: str, fractions: list[float], quick: bool) -> dict:
    total = step_flops(model_name, quick)
    level0, _, _ = fxmem_plan(model_name, quick, None)
    from fxmem.remat.mincut import saved_bytes

    level0_bytes = saved_bytes(level0.problem, level0.saved)
    caps = [int(f * level0_bytes) for f in fractions]
    from fxmem.graph.cost import flops

    bounds, points = lower_bound(level0.problem, caps, lambda n: flops(n) or 0.0)
    time_bounds, _ = lower_bound(level0.problem, caps, op_ns)
    rows = []
    for f, cap, bound, time_bound in zip(fractions, caps, bounds, time_bounds):
        print(f"{model_name} {f}: bound {bound / 1e9:.2f} GFLOP, {time_bound / 1e6:.1f} ms", flush=True)
        row = {"fraction": f, "cap_bytes": cap, "bound_flops": bound, "bound_ns": time_bound}
        try:
            plan, rec, ns = fxmem_plan(model_name, quick, f)
            row.update(fxmem_bytes=saved_bytes(plan.problem, plan.saved), fxmem_flops=rec, fxmem_ns=ns)
        except Exception as e:  # an infeasible budget: BudgetError, wrapped by Dynamo
            row.update(fxmem_error=str(e).splitlines()[0][:200])
        row["torch"] = torch_plan(model_name, quick, f)
        rows.append(row)
    return {"model": model_name, "model_kwargs": configs.model_kwargs(model_name, quick), "step_flops": total,
            "level0_bytes": level0_bytes, "frontier": points, "rows": rows}


if __name__ == "__main__":
    study.main(__doc__, __file__, "budget-bound", "0.96,0.9,0.7,0.5", run)
