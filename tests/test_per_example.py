"""The backend's per-example pass: vmap(grad) regions run in microbatches, results unchanged."""
import re

import pytest
import torch
import torch.nn as nn
from torch.func import functional_call, grad, vmap

import fxmem
from fxmem import per_example
from fxmem.options import OptionError
from fxmem.profiling import step_perf

C = 1.0


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(50, 16), nn.Flatten(), nn.Linear(16 * 5, 64), nn.GELU(),
                         nn.Linear(64, 50))


def _step(model, mean_over_batch=False):
    def loss_fn(p, x, y):
        return nn.functional.cross_entropy(functional_call(model, p, (x[None],)), y[None])

    def step(p, x, y):
        g = vmap(grad(loss_fn), in_dims=(None, 0, 0))(p, x, y)
        norms = torch.linalg.vector_norm(torch.cat([v.reshape(v.shape[0], -1) for v in g.values()], 1), dim=1)
        factor = (C / (norms + 1e-6)).clamp(max=1.0)
        red = (lambda t: t.mean(0)) if mean_over_batch else (lambda t: t.sum(0))
        return {k: red(v * factor.view(-1, *[1] * (v.dim() - 1))) for k, v in g.items()}, norms

    return step


def _loop(model, params, x, y):
    """The explicit per-example loop: the reference."""
    sums = {k: torch.zeros_like(v) for k, v in params.items()}
    norms = []
    for i in range(x.shape[0]):
        out = functional_call(model, params, (x[i:i + 1],))
        gs = torch.autograd.grad(nn.functional.cross_entropy(out, y[i:i + 1]), list(params.values()))
        norm = torch.linalg.vector_norm(torch.cat([g.flatten() for g in gs]))
        f = min(1.0, C / (norm.item() + 1e-6))
        for k, g in zip(params, gs):
            sums[k] += f * g
        norms.append(norm)
    return sums, torch.stack(norms)


def _data(batch):
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 50, (batch, 5), generator=g), torch.randint(0, 50, (batch,), generator=g)


def _params(model):
    return {k: v.detach().clone().requires_grad_(True) for k, v in model.named_parameters()}


def _compile(step, **options):
    return torch.compile(step, backend="fxmem", options={"inner": "eager", **options})


def _run(step, params, x, y, **options):
    return _run_compiled(step, params, x, y, **options)[0]


def _run_compiled(step, params, x, y, **options):
    """The step's result and the compiled step (whose records ``fxmem.compilations`` finds)."""
    fn = _compile(step, **options)
    with torch.no_grad():
        return fn(params, x, y), fn


def _chunk_plan(fn):
    """The per-example pass's decision in the newest compile of ``fn``."""
    plan = fxmem.compilations(fn)[-1].chunk_plan
    assert plan is not None, "the per-example pass found no region"
    return plan


@pytest.mark.slow
@pytest.mark.parametrize("m", [1, 3, 8, 11])
def test_chunked_sums_equal_the_per_example_loop(m):
    model = _model()
    params, (x, y) = _params(model), _data(11)
    (sums, norms), fn = _run_compiled(_step(model), params, x, y, microbatch_size=m)
    plan = _chunk_plan(fn)
    assert plan.chunked and plan.microbatch_size == min(m, 11)
    assert plan.fused_sums == len(params) and plan.fused_norms == 1
    ref_sums, ref_norms = _loop(model, params, x, y)
    torch.testing.assert_close(norms, ref_norms, rtol=1e-5, atol=1e-6)
    for k in params:
        torch.testing.assert_close(sums[k], ref_sums[k], rtol=1e-5, atol=1e-6)
    assert max(n for n in norms.tolist()) > C  # some examples were clipped, so clipping is tested


def test_per_example_gradients_never_exist_for_the_whole_batch():
    model = nn.Sequential(nn.Linear(256, 512), nn.Tanh(), nn.Linear(512, 256))
    x, y = torch.randn(16, 256), torch.randn(16, 256)

    def loss_fn(p, x, y):
        return (functional_call(model, p, (x,)) - y).pow(2).mean()

    def step(p, x, y):
        g = vmap(grad(loss_fn), in_dims=(None, 0, 0))(p, x, y)
        norms = torch.linalg.vector_norm(torch.cat([v.reshape(16, -1) for v in g.values()], 1), dim=1)
        factor = (C / (norms + 1e-6)).clamp(max=1.0)
        return {k: (v * factor.view(-1, *[1] * (v.dim() - 1))).sum(0) for k, v in g.items()}

    params = {k: v.detach() for k, v in model.named_parameters()}
    peaks = {}
    for m in (None, 2):
        torch._dynamo.reset()
        fn = torch.compile(step, backend="fxmem",
                           options={"inner": "eager", "microbatch_size": m, "ghost_clipping": False})
        fn(params, x, y)
        with step_perf("cpu") as perf:
            out = fn(params, x, y)
        peaks[m] = perf.result.peak_bytes
        del out
    per_example_grads = 16 * sum(v.numel() * 4 for v in params.values())
    assert peaks[None] > per_example_grads > 3 * peaks[2]


def test_one_compile_serves_every_step_including_the_remainder_chunk():
    model = _model()
    params, (x, y) = _params(model), _data(7)
    fn = torch.compile(_step(model), backend="fxmem", options={"inner": "eager", "microbatch_size": 3})
    with torch.no_grad():
        first = fn(params, x, y)
        runner_compiles = fxmem.compilations(fn)
        second = fn(params, x, y)
    assert runner_compiles and fxmem.compilations(fn) == runner_compiles  # no new Dynamo compile
    for k in params:
        assert torch.equal(first[0][k], second[0][k])


@pytest.mark.slow
def test_auto_takes_the_largest_microbatch_that_fits():
    model = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 64))
    x, y = torch.randn(16, 64), torch.randn(16, 64)

    def loss_fn(p, x, y):
        return (functional_call(model, p, (x,)) - y).pow(2).mean()

    def step(p, x, y):
        g = vmap(grad(loss_fn), in_dims=(None, 0, 0))(p, x, y)
        norms = torch.linalg.vector_norm(torch.cat([v.reshape(16, -1) for v in g.values()], 1), dim=1)
        return {k: (v * (C / (norms + 1e-6)).clamp(max=1.0).view(-1, *[1] * (v.dim() - 1))).sum(0)
                for k, v in g.items()}

    params = {k: v.detach() for k, v in model.named_parameters()}
    per_example_bytes = sum(v.numel() * 4 for v in params.values())
    budget = 6 * per_example_bytes
    fn = torch.compile(step, backend="fxmem",
                       options={"inner": "eager", "microbatch_size": "auto", "memory_budget": budget,
                                "ghost_clipping": False})  # per-example gradients materialized
    fn(params, x, y)
    plan = _chunk_plan(fn)
    m = plan.microbatch_size
    assert 1 < m < 16
    assert plan.measured[m] <= budget
    assert plan.predicted_peak(m + 1) > budget or plan.measured.get(m + 1, budget + 1) > budget
    with step_perf("cpu") as perf:
        fn(params, x, y)
    assert perf.result.peak_bytes <= budget


def test_auto_needs_a_byte_budget():
    model = _model()
    params, (x, y) = _params(model), _data(4)
    with pytest.raises(OptionError, match="'auto' needs memory_budget in bytes"):
        _run(_step(model), params, x, y, microbatch_size="auto")


def test_unprovable_epilogue_falls_back_unchunked_with_the_reason():
    model = _model()
    params, (x, y) = _params(model), _data(6)
    with pytest.warns(UserWarning, match="not chunking this graph: .*mean over the batch"):
        (sums, _), fn = _run_compiled(_step(model, mean_over_batch=True), params, x, y, microbatch_size=2)
    assert not _chunk_plan(fn).chunked
    ref_sums, _ = _loop(model, params, x, y)
    for k in params:
        torch.testing.assert_close(sums[k], ref_sums[k] / 6, rtol=1e-5, atol=1e-6)
    torch._dynamo.reset()
    with pytest.raises(per_example.Unsupported, match="mean over the batch"):
        _run(_step(model, mean_over_batch=True), params, x, y, microbatch_size=2, strict=True)


def test_grad_mode_inputs_fall_back_with_a_warning():
    model = _model()
    params, (x, y) = _params(model), _data(4)
    fn = torch.compile(_step(model), backend="fxmem", options={"inner": "eager", "microbatch_size": 2})
    with pytest.warns(UserWarning, match="inputs require grad"):
        sums, _ = fn(params, x, y)
    ref_sums, _ = _loop(model, params, x, y)
    torch.testing.assert_close(sums["0.weight"].detach(), ref_sums["0.weight"], rtol=1e-5, atol=1e-6)
    # The default lowering's fused loss would be differentiated twice here: it is declined, and
    # the graph is planned (no failed stage), unlowered.
    (g,) = [g for c in fxmem.compilations(fn) for g in c.graphs]
    assert not g.report.lowerings and g.plan is not None
    # (declined by the plan comparison, or, where nothing is compared, by the compile itself)
    assert g.report.lowering_notes and all(
        re.search(r"not applied: the graph with (it|lowering) could not be (planned|compiled)", n)
        for n in g.report.lowering_notes), g.report.lowering_notes


def test_report_lists_the_microbatching_decision():
    model = _model()
    params, (x, y) = _params(model), _data(5)
    _, fn = _run_compiled(_step(model), params, x, y, microbatch_size=2)
    rep = fxmem.report(fn)
    text = str(rep)
    assert "per-example region: batch 5, microbatch_size=2: runs in chunks of 2" in text
    assert f"{len(params)} clip-weighted batch sums as matvecs, 1 global norms" in text
    again = type(rep).from_json(rep.to_json())
    assert again.per_example[-1]["microbatch_size"] == 2


@pytest.mark.slow
@pytest.mark.parametrize("options", [{"level": 0}, {"level": 1}, {"level": 2},
                                     {"microbatch_size": "auto", "memory_budget": 10**6}])
def test_recompute_planner_runs_inside_the_chunk_graph(options):
    model = _model()
    params, (x, y) = _params(model), _data(6)
    (sums, norms), fn = _run_compiled(_step(model), params, x, y, **{"microbatch_size": 4, **options})
    graphs = [g for c in fxmem.compilations(fn) for g in c.graphs]
    assert graphs and all(g.plan.level == options.get("level", 0) for g in graphs)
    assert sum(len(g.split.recomputed) for g in graphs) > 0
    ref_sums, ref_norms = _loop(model, params, x, y)
    torch.testing.assert_close(norms, ref_norms, rtol=1e-5, atol=1e-6)
    for k in params:
        torch.testing.assert_close(sums[k], ref_sums[k], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_varying_batch_sizes_keep_chunking():
    """Poisson-sampled DP-SGD: every step has another batch size. Dynamo's dynamic recompile
    makes the batch symbolic; the chunked path must survive it and stay exact."""
    model = _model()
    params = _params(model)
    fn = torch.compile(_step(model), backend="fxmem", options={"inner": "eager", "microbatch_size": 2})
    for batch in (6, 7, 9, 4):
        x, y = _data(batch)
        with torch.no_grad():
            sums, norms = fn(params, x, y)
        plan = _chunk_plan(fn)
        assert plan.chunked, plan.reason
        ref_sums, ref_norms = _loop(model, params, x, y)
        torch.testing.assert_close(norms, ref_norms, rtol=1e-5, atol=1e-6)
        for k in params:
            torch.testing.assert_close(sums[k], ref_sums[k], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_chunk_graphs_never_match_a_model_after_their_inputs_are_freed():
    """Regression (a CI flake): chunk graphs linked to their inputs by raw ids, which Python
    reuses once the tensors are freed, so a later model's report listed a freed chunk graph."""
    import gc

    model = _model()
    params, (x, y) = _params(model), _data(4)
    ids = {id(t) for t in [*params.values(), x, y]}
    _, fn = _run_compiled(_step(model), params, x, y, microbatch_size=2)
    comps = fxmem.compilations(fn, match=[*params.values(), x, y])
    assert comps and all(c.graphs for c in comps)  # the chunk graphs were planned
    assert all(c.inputs & ids for c in comps)
    del params, x, y
    gc.collect()
    assert not any(c.inputs & ids for c in comps)
    # a later model's tensors (which may reuse the freed ids) never find the freed graphs
    later = _params(_model())
    later_ids = {id(t) for t in later.values()}
    assert not any(c.inputs & later_ids for c in fxmem.compilations(fn))


class _VmapModel(torch.nn.Module):
    """vmap inside a model: one region, two regions, or vmap(grad) (a gradient penalty)."""

    def __init__(self, kind):
        super().__init__()
        self.kind, self.lin, self.lin2 = kind, torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)

    def forward(self, x):
        a = torch.vmap(lambda row: self.lin(row).relu())(x)
        if self.kind == "one":
            return a.square().mean()
        if self.kind == "two":
            return torch.vmap(lambda row: self.lin2(row).tanh())(a).square().mean()
        g = vmap(grad(lambda row: self.lin2(row).tanh().sum()))(a)
        return self.lin2(a).mean() + g.square().mean()


@pytest.mark.parametrize("kind", ["one", "two", "grad penalty"])
def test_strict_compiles_a_model_that_calls_vmap_without_microbatching(kind):
    """No microbatching asked for: vmap inside a model (e.g. HF masks built with use_vmap) is
    left alone under strict=True, however many regions and with grad inside, and the step equals
    eager (strict used to reject these: "N vmap regions in one graph", "inputs require grad")."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, ref = _VmapModel(kind), _VmapModel(kind)
    ref.load_state_dict(model.state_dict())
    x = torch.randn(4, 8)
    compiled = torch.compile(model, backend="fxmem", options={"inner": "eager", "strict": True})
    torch.testing.assert_close(compiled(x), ref(x))
    compiled(x).backward()
    ref(x).backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    plans = [c.chunk_plan for c in fxmem.compilations(compiled) if c.chunk_plan is not None]
    assert plans and not plans[-1].chunked, "the region was seen and left unchunked"
