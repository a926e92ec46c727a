"""The recompute planner: levels, rules, budget, annotations, dropout, and its byte accounting."""

import copy
import dataclasses
import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from helpers import compare_step
from torch import nn
from torch.utils.checkpoint import checkpoint

import fxmem
from fxmem.models import build
from fxmem.remat.budget import BudgetError

GPT = dict(batch=2, seq=32, layers=2, vocab=256)
# Narrow (d=32): activations, not parameter gradients, make the peak, so recompute can lower it.
NARROW = dict(batch=4, seq=64, layers=2, vocab=256, d=32, heads=2)


def _run(workload, **options):
    """Compile with fxmem (eager inner), check loss and grads against eager; return the plan."""
    # The planner on unlowered graphs: these tests name the plans of aten graphs (lowering is on
    # by default and would replace the norms, activations and loss by fused ops).
    opts = {"inner": "eager", "lowering": False, **options}
    compiled = compare_step(workload, lambda m: torch.compile(m, backend="fxmem", options=opts))
    graphs = [g for c in fxmem.compilations(compiled) for g in c.graphs]
    assert len(graphs) == 1, "expected one graph"
    return graphs[0].plan, graphs[0].split, graphs[0].sizes


def _saved_bytes_at_runtime(workload, **options):
    """Bytes of the tensors autograd actually keeps from the compiled forward (inputs excluded)."""
    model = copy.deepcopy(workload.model)
    # Unlowered, like _run's plans that these bytes are compared with
    compiled = torch.compile(model, backend="fxmem", options={"inner": "eager", "lowering": False, **options})
    # graph inputs and views of them cost nothing: their storage exists anyway
    keep = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers(), *workload.batch.values()]}
    seen = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in keep and t.data_ptr() not in seen:
            seen[t.data_ptr()] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = workload.loss(compiled(**workload.batch))
    loss.backward()
    return sum(seen.values())


@pytest.mark.slow
@pytest.mark.parametrize("name", ["hf_gpt2", "hf_llama", "mlp_chain"])
def test_planned_bytes_equal_held_bytes(name):
    w = build(name, **(GPT if name != "mlp_chain" else dict(batch=16, width=64, depth=4)))
    plan, _, _ = _run(w)
    torch._dynamo.reset()
    assert _saved_bytes_at_runtime(w) == plan.saved_bytes


def test_level0_recomputes_activation_instead_of_keeping_both():
    """torch's min-cut keeps addmm and gelu(addmm) in an MLP; fxmem keeps one and recomputes gelu."""
    w = build("mlp_chain", batch=16, width=64, depth=4)
    plan, split, _ = _run(w)
    targets = [str(n.target) for n in split.saved if n.op != "placeholder"]
    assert not any("gelu" in t for t in targets), targets
    assert any("gelu" in str(n.target) for n in split.recomputed)


@pytest.mark.slow
def test_levels_reduce_saved_bytes_and_keep_gradients():
    # NARROW: level 1 lowers the peak (a level 1 plan that would not is replaced by level 0's: see
    # the test below)
    w = build("hf_gpt2", **NARROW)
    p0, s0, _ = _run(w)
    torch._dynamo.reset()
    p1, s1, _ = _run(w, level=1)
    assert any("2 layers found" in n for n in p1.notes)
    assert p1.saved_bytes < 0.6 * p0.saved_bytes
    assert any("mm" in str(n.target) for n in s1.recomputed)  # matmuls inside layers recomputed


@pytest.mark.slow
def test_rules_select_clusters_exactly():
    w = build("hf_gpt2", **GPT)
    p0, s0, _ = _run(w)
    counts = {}
    for c in p0.clusters:
        counts[c.id] = counts.get(c.id, 0) + 1
    cid = next(i for i, n in sorted(counts.items(), key=lambda kv: -kv[1]) if n >= 2 and "mm" in i)
    stashes = [c.stash for c in p0.clusters if c.id == cid]
    torch._dynamo.reset()
    p1, s1, _ = _run(w, config=[f"{cid}:1:1"])
    assert p1.applied_rules == ((f"{cid}:1:1", cid, 1),)
    saved1 = {n.name for n in s1.saved}
    assert stashes[0].name not in saved1  # the first occurrence is recomputed
    torch._dynamo.reset()
    p2, s2, _ = _run(w, config=[f"{cid}:1:-1"])
    assert p2.applied_rules == ((f"{cid}:1:-1", cid, len(stashes)),)
    assert not {s.name for s in stashes} & {n.name for n in s2.saved}
    assert p2.saved_bytes <= p1.saved_bytes <= p0.saved_bytes


def test_unknown_cluster_warns_with_known_ids():
    w = build("mlp_chain", batch=16, width=64, depth=3)
    with pytest.warns(UserWarning, match=r"fxmem: rule nosuch\+:1:-1 matches no cluster of this graph"):
        p, _, _ = _run(w, config=["nosuch+:1:-1"])
    assert any(re.match(r"rule nosuch\+:1:-1: cluster 'nosuch\+' matches nothing; clusters in this graph: \w", n)
               for n in p.notes), p.notes  # the details: in the report


def _peak(workload, options):
    from fxmem.profiling import step_perf

    torch._dynamo.reset()
    model = copy.deepcopy(workload.model)
    fn = torch.compile(model, backend="fxmem", options={"inner": "eager", **options})
    for _ in range(2):  # the second step is measured: no compile, same allocations
        model.zero_grad(set_to_none=True)
        with step_perf("cpu") as perf:
            workload.loss(fn(**workload.batch)).backward()
    return perf.result.peak_bytes


@pytest.mark.slow
def test_budget_monotone_and_within_cap():
    w = build("hf_gpt2", **NARROW)
    p0, _, _ = _run(w)
    last_bytes, last_peak = p0.saved_bytes, _peak(w, {})
    for frac in (0.95, 0.8, 0.4, 0.0):
        torch._dynamo.reset()
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            p, _, _ = _run(w, memory_budget=frac)
        unmet = [str(r.message) for r in record if "is infeasible" in str(r.message)]
        # a fraction only plans with a higher peak meet is unmet: it warns, and takes the least peak
        assert frac == 0.0 or p.saved_bytes <= frac * p0.saved_bytes or unmet
        assert not (frac == 0.0 and unmet)
        assert frac == 0.0 or p.saved_bytes <= last_bytes  # fraction 0 is the least peak, not the least bytes
        peak = _peak(w, {"memory_budget": frac})
        # +0.5%: plans of equal simulated peak can measure a few KB apart (0.4 measured 2.4 KB above 0.8)
        assert peak <= last_peak * 1.005, f"budget {frac}: measured peak rose from {last_peak} to {peak}"
        last_bytes, last_peak = p.saved_bytes, peak


@pytest.mark.slow
def test_budget_mixes_the_cuts_unit_by_unit(monkeypatch):
    """Frontier cuts of identical layers differ by one kind of projection in every layer; the
    cheapest plan under a cap can mix them (two layers' gate projections and one query
    projection). The greedy walk's plans find such mixes: less recompute than the cuts and the
    steps between two neighbouring cuts alone, within the same cap (here at 0.9; elsewhere the
    other candidates can be as cheap)."""
    from fxmem.remat import budget

    frac = 0.9
    w = build("hf_llama", **NARROW)
    p0, _, _ = _run(w)
    torch._dynamo.reset()
    p, split, _ = _run(w, memory_budget=frac)
    torch._dynamo.reset()
    monkeypatch.setattr(budget, "_greedy", lambda *args: [])
    q, q_split, _ = _run(w, memory_budget=frac)
    assert q.saved_bytes <= frac * p0.saved_bytes and p.saved_bytes <= frac * p0.saved_bytes
    # Since layer boundaries are no longer kept by force, the frontier's own cuts are as cheap here
    # (0.95, 0.9, 0.8, 0.7 alike): the greedy plans must not cost more. A model on which they are
    # strictly cheaper again is left to find (issue #20).
    assert sum(p.problem.cost[n] for n in split.recomputed) <= sum(q.problem.cost[n] for n in q_split.recomputed)


@pytest.mark.slow
def test_budget_between_frontier_cuts_recomputes_less_than_the_cut_under_the_cap():
    """Frontier cuts jump by whole sets of layers; a cap between two takes the cheaper cut plus as
    much of the other's kept values as fits: more bytes and less recompute than that cut."""
    w = build("hf_gpt2", **NARROW)
    p0, _, _ = _run(w)
    torch._dynamo.reset()
    p, split, _ = _run(w, memory_budget=0.9)
    cap = 0.9 * p0.saved_bytes
    cut_bytes, cut_cost = max((b, c) for b, c, _ in p.frontier() if b <= cap)
    assert cut_bytes < p.saved_bytes <= cap
    assert 0 < sum(p.problem.cost[n] for n in split.recomputed) < cut_cost


def test_infeasible_budget_names_smallest_feasible_under_strict():
    """Without strict the plan of least peak is used, with a warning (test_budget.py)."""
    w = build("tiny_gpt", batch=2, seq=16, layers=2, d=32, heads=2, vocab=64)
    model = copy.deepcopy(w.model)
    options = {"inner": "eager", "memory_budget": 1, "strict": True}
    with pytest.raises(BudgetError, match=r"option 'memory_budget': 1 \(1 bytes of saved activations\) is "
                                          r"infeasible; the smallest feasible budget is \d+ bytes \(0\.\d+ of "
                                          r"level 0's \d+\)"):
        w.loss(torch.compile(model, backend="fxmem", options=options)(**w.batch))


class _Ckpt(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(d, 4 * d), nn.Linear(4 * d, d), nn.Linear(d, d)

    def block(self, x):
        return self.b(F.gelu(self.a(x)))

    def forward(self, x):
        return self.c(checkpoint(self.block, x, use_reentrant=False)).pow(2).mean()


def test_checkpoint_annotations_are_recomputed():
    from fxmem.models import Workload

    torch.manual_seed(0)
    w = Workload("ckpt", _Ckpt(), {"x": torch.randn(8, 32)}, lambda out: out)
    plan, split, _ = _run(w)
    assert any("must-save" in n for n in plan.notes)
    recomputed = {str(n.target) for n in split.recomputed}
    assert any("addmm" in t for t in recomputed), recomputed  # the checkpointed matmul


@pytest.mark.slow
def test_dropout_gradients_bit_identical():
    """Random ops are kept, never re-drawn: same seed, same gradients, bit for bit."""
    w = build("tiny_gpt", batch=2, seq=16, layers=2, d=32, heads=2, vocab=64, dropout=0.3)
    grads = []
    for options in ({"level": 0}, {"level": 1}, {"level": 2}, None):
        model = copy.deepcopy(w.model)
        # Bit for bit against eager: the planner alone (the fused kernels of the default lowering
        # sum in another order).
        fn = model if options is None else torch.compile(model, backend="fxmem",
                                                         options={"inner": "eager", "lowering": False, **options})
        torch.manual_seed(123)
        w.loss(fn(**w.batch)).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        torch._dynamo.reset()
    for other in grads[1:]:
        for a, b in zip(grads[0], other):
            assert torch.equal(a, b)


@pytest.mark.slow
def test_plan_shape_changes_evaluation_point():
    w = build("hf_llama", **GPT)
    model = copy.deepcopy(w.model)
    opts = {"inner": "eager", "plan_shape": {"input_ids": [64, 128]}}
    compiled = torch.compile(model, backend="fxmem", options=opts, dynamic=True)
    w.loss(compiled(**w.batch)).backward()
    first = fxmem.compilations(compiled)[0].graphs[-1]
    plan, sizes = first.plan, first.sizes
    names = set(sizes.names.values())
    assert {"input_ids.size(0)", "input_ids.size(1)"} <= names
    assert sizes.at(plan.saved_bytes_expr) == plan.saved_bytes
    assert "input_ids.size(0)" in sizes.pretty(plan.saved_bytes_expr)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch._dynamo.reset()
        with pytest.raises(ValueError, match=r"option 'plan_shape': 'nosuch' names no input or dimension of this "
                                             r"graph; the graph's dims: input_ids.size\(0\) = s\d+"):
            w.loss(torch.compile(copy.deepcopy(w.model), backend="fxmem", dynamic=True,
                                 options={"inner": "eager", "plan_shape": {"nosuch": [2]}})(**w.batch))


@pytest.mark.slow
def test_dynamic_plan_formula_holds_at_every_shape():
    """One dynamic compile; its saved-bytes formula equals what autograd keeps at other shapes."""
    w = build("hf_llama", **GPT)
    model = copy.deepcopy(w.model)
    compiled = torch.compile(model, backend="fxmem", options={"inner": "eager"}, dynamic=True)
    keep = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    for batch, seq in [(2, 32), (3, 20), (5, 48)]:
        inputs = build("hf_llama", batch=batch, seq=seq, layers=2, vocab=256).batch
        held = []

        def pack(t):
            # graph inputs cost nothing extra; dynamic=True also lifts float attributes (eps) to
            # 0-d float64 graph inputs
            lifted = t.dim() == 0 and t.dtype == torch.float64
            if not (t.untyped_storage().data_ptr() in keep or lifted or any(t is v for v in inputs.values())):
                held.append((t.untyped_storage().data_ptr(), t.numel() * t.element_size()))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = compiled(**inputs)
            loss = w.loss(out)
        # the returned logits' own node (outside the graph: fxmem.lowering.returned) holds their
        # linear's input for their gradient while the caller holds them; not the plan's
        outside = {t.untyped_storage().data_ptr() for t in getattr(out.logits.grad_fn, "saved_tensors", ())
                   if t is not None}
        held = [b for ptr, b in held if ptr not in outside]
        del out
        loss.backward()
        comps = fxmem.compilations(compiled)
        assert len(comps) == 1 and len(comps[-1].graphs) == 1  # compiled once
        plan, sizes = comps[-1].graphs[-1].plan, comps[-1].graphs[-1].sizes
        values = {s: {"input_ids.size(0)": batch, "input_ids.size(1)": seq}[n] for s, n in sizes.names.items()}
        assert int(plan.saved_bytes_expr.xreplace(values)) == sum(held), (batch, seq)


@pytest.mark.slow  # 10-15 s here
def test_level2_packs_masks_that_are_not_replayed():
    """A boolean mask the backward reads is kept as a bitmask at level 2; a dropout mask is not
    packed (its generator is replayed instead), and level 2 never keeps more than level 1."""

    class Gate(torch.nn.Module):  # a mask from a comparison, read by the backward
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)

        def forward(self, x):  # the mask's source (a matmul) is not recomputed: the mask is kept
            return (self.b(x) * (self.a(x).sin() > 0)).sum()  # a loss: the whole step in one graph

    x = torch.randn(256, 64)
    plans = {}
    for level in (1, 2):
        torch._dynamo.reset()
        compiled = torch.compile(Gate(), backend="fxmem", options={"inner": "eager", "level": level})
        compiled(x).backward()
        last = fxmem.compilations(compiled)[-1].graphs[-1]
        plans[level] = (last.plan, last.split)
    (p1, s1), (p2, s2) = plans[1], plans[2]
    masks1 = sum(n.meta["val"].numel() for n in s1.saved if n.meta["val"].dtype == torch.bool)
    masks2 = sum(n.meta["val"].numel() for n in s2.saved if n.meta["val"].dtype == torch.bool)
    packed = sum(n.meta["val"].numel() for n in s2.saved if n.meta["val"].dtype == torch.uint8)
    assert masks1 == 256 * 64 and masks2 == 0
    assert packed * 8 >= masks1 and packed <= masks1 // 8 + 8 * 4  # a bit per element (+ padding)
    assert p2.saved_bytes == p1.saved_bytes - masks1 + packed

    w = build("hf_gpt2", **{**GPT, "dropout": 0.1})
    kept = {}
    for level in (1, 2):
        torch._dynamo.reset()
        compiled = torch.compile(copy.deepcopy(w.model), backend="fxmem", options={"inner": "eager", "level": level})
        w.loss(compiled(**w.batch)).backward()
        kept[level] = fxmem.compilations(compiled)[-1].graphs[-1].plan.saved_bytes
    assert kept[2] <= kept[1]


def test_report_option_logs_the_plan_at_info(caplog):
    import logging

    w = build("hf_gpt2", **GPT)
    with caplog.at_level(logging.INFO, logger="fxmem"):
        _run(w, report=True, level=1)
    text = caplog.text
    assert "fxmem memory plan: graph" in text and "level 1" in text and "layers found" in text
    assert re.search(r"saved activations: [\d,]+ bytes", text)


class _HalfSaved(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.out = torch.nn.Linear(8, 16), torch.nn.Linear(8, 1)

    def forward(self, x):
        a, b = self.lin(x).chunk(2, dim=-1)
        return self.out(a).sum() + b.sum()


def test_a_kept_slice_counts_its_whole_storage():
    """Regression (GPT-2's query and key are slices of one qkv buffer): keeping a view keeps its
    whole storage; the plan said 128 bytes where autograd held 256."""
    from fxmem.testing import assert_same_training_step

    torch.manual_seed(0)
    check = assert_same_training_step(_HalfSaved(), {"x": torch.randn(4, 8)})
    assert check.held_bytes == check.planned_saved_bytes[0] == 4 * 16 * 4


@pytest.mark.slow
def test_level1_that_would_not_lower_the_peak_keeps_level0s_plan():
    """GPT at a shape where the backward's peak is the parameter gradients: recomputing the
    layers would cost time and lower nothing, so level 1 keeps level 0's plan, and says so."""
    w = build("hf_gpt2", **GPT)
    p0, _, _ = _run(w)
    torch._dynamo.reset()
    p1, s1, _ = _run(w, level=1)
    assert any("not below level 0's; using level 0's plan" in n for n in p1.notes)
    assert p1.saved_bytes == p0.saved_bytes and not any("mm" in str(n.target) for n in s1.recomputed)


def test_recompute_cost_counts_matmul_and_attention_flops():
    """Matmuls and attention cost their FLOPs, not their output elements (the budget ranks recompute
    by this). CPU flash attention has no formula in torch: priced as the CUDA one (4*b*h*s*s*d)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from fxmem.graph.cost import recompute_cost
    from fxmem.graph.sizes import SymbolicSizes

    b, h, s, d = 2, 3, 16, 8
    q, w, bias = torch.randn(b, h, s, d), torch.randn(d, 5), torch.randn(5)
    gm = make_fx(lambda q, w, bias: (F.scaled_dot_product_attention(q, q, q, is_causal=True),
                                     torch.addmm(bias, q.view(-1, d), w)))(q, w, bias)
    cost = {n.target: recompute_cost(n, SymbolicSizes()) for n in gm.graph.nodes if n.op == "call_function"}
    assert cost[torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default] == 4 * b * h * s * s * d
    assert cost[torch.ops.aten.addmm.default] == 2 * (b * h * s) * d * 5


@pytest.mark.slow
@pytest.mark.parametrize("name", ["hf_llama", "hf_gpt2"])
def test_level1_recomputes_the_token_embedding_and_keeps_the_other_boundaries(name):
    """The first layer's input is a gather from the embedding table: recomputing it reruns no
    layer, so it is no fence; the inputs of the other layers are kept."""
    w = build(name, batch=4, seq=64, layers=3, vocab=256, d=32, heads=2)
    plan, split, _ = _run(w, level=1)
    assert any(n.target is torch.ops.aten.embedding.default for n in split.recomputed)
    assert not any(n.target is torch.ops.aten.embedding.default for n in split.saved)
    residual = 4 * 64 * 32 * 4  # batch * seq * d fp32: one boundary
    assert sum(1 for n in split.saved if n.op != "placeholder" and plan.problem.nbytes.get(n) == residual) >= 2


def test_positions_under_inductors_decompositions_are_cheap_to_recompute():
    """Inductor decomposes arange into prims.iota: position ids stay recomputable (else the
    GPT-2 token + position embedding would be a fence under budgets with Inductor)."""
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx

    from fxmem.remat.allowlist import CHEAP, kind

    def positions(x):
        return torch.arange(x.shape[1], device=x.device).unsqueeze(0) + x

    gm = make_fx(positions, decomposition_table=select_decomp_table())(torch.zeros(2, 5, dtype=torch.long))
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert any(n.target is torch.ops.prims.iota.default for n in calls)
    assert {n.name: kind(n) for n in calls} == {n.name: CHEAP for n in calls}


@pytest.mark.parametrize("options", [{"level": 1}, {"level": 2}, {"level": 1, "memory_budget": 1.0}],
                         ids=["level1", "level2", "budget"])
def test_conv_batchnorm_keeps_gradients_and_running_stats_at_every_level(options):
    """BatchNorm's running statistics are updated in place after the forward: a backward that
    recomputed the batch norm would read them mutated (autograd's version-counter error)."""
    transformers = pytest.importorskip("transformers")

    def make():
        torch.manual_seed(0)
        cfg = transformers.ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], num_labels=10)
        return transformers.ResNetForImageClassification(cfg)

    torch._dynamo.reset()
    model, ref = make(), make()
    x, y = torch.randn(2, 3, 32, 32), torch.randint(0, 10, (2,))
    compiled = torch.compile(model, backend="fxmem", options={"inner": "eager", **options})
    loss = compiled(pixel_values=x, labels=y).loss
    loss.backward()
    ref_loss = ref(pixel_values=x, labels=y).loss
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
    for (name, b), c in zip(model.named_buffers(), ref.buffers()):
        torch.testing.assert_close(b, c, msg=lambda m, name=name: f"buffer {name}: {m}")
    assert [g.report.level for c in fxmem.compilations(compiled) for g in c.graphs] == [options["level"]]


@pytest.mark.parametrize("name, blocks", [
    ("convnet", ["features.0", "features.2"]),  # the conv-BN-ReLU blocks; the pools are ops between them
    ("resnet", ["resnet.encoder.stages.0", "resnet.encoder.stages.1"]),  # not the classifier's Flatten/Linear
    ("unet", ["down", "mid", "up"]),  # no numbered blocks: the top-level stages
])
def test_layers_are_the_blocks_with_submodules(name, blocks, monkeypatch):
    import fxmem.remat.context as context
    from fxmem.testing.zoo import zoo_build

    found = []
    real = context.layers
    monkeypatch.setattr(context, "layers", lambda joint: found.append(real(joint)) or found[-1])
    w = zoo_build(name)
    torch._dynamo.reset()
    w.loss(torch.compile(w.model, backend="fxmem", options={"inner": "eager", "level": 1})(**w.batch)).backward()
    assert sorted(set(found[-1].values())) == blocks


@pytest.mark.slow
def test_level1_recomputes_a_unets_stages():
    """A UNet whose activations make the peak: level 1 recomputes inside its stages (it used to
    find every conv, norm and ReLU a layer of its own, and fell back to level 0's plan)."""
    from fxmem.profiling import step_perf
    from fxmem.testing.zoo import zoo_build

    w = zoo_build("unet", size=64, width=32)
    peaks = {}
    for level in (0, 1):
        torch._dynamo.reset()
        fn = torch.compile(copy.deepcopy(w.model), backend="fxmem", options={"inner": "eager", "level": level})
        for _ in range(2):
            with step_perf("cpu") as perf:
                w.loss(fn(**w.batch)).backward()
        peaks[level] = perf.result.peak_bytes
        notes = [n for g in fxmem.report(fn).graphs for n in g.notes]
        assert not any("using level 0's plan" in n for n in notes), notes
    assert peaks[1] < 0.95 * peaks[0], peaks


class _SharedStack(nn.Module):
    """One layer applied three times (ALBERT-style shared weights): no numbered blocks to checkpoint."""

    def __init__(self, d=64, hidden=256):
        super().__init__()
        self.inp, self.up, self.down, self.out = nn.Linear(d, d), nn.Linear(d, hidden), nn.Linear(hidden, d), \
            nn.Linear(d, 1)

    def forward(self, x):
        h = self.inp(x)
        for _ in range(3):
            h = h + self.down(F.gelu(self.up(h)))
        return self.out(h).square().mean()


@pytest.mark.slow
def test_level1_without_layers_to_checkpoint_takes_the_least_peak_plan_not_level0s():
    """Where level 1's own plan does not lower the peak, it takes the plan of least simulated peak
    among the budget's candidates: below level 0 wherever ``memory_budget=0.0`` is, and within 2%
    of that budget's measured peak (issue #42)."""
    from fxmem.profiling import step_perf

    torch.manual_seed(0)
    model, x = _SharedStack(), torch.randn(512, 64)
    peaks, notes = {}, {}
    for name, options in {"L0": {}, "L1": {"level": 1}, "budget0": {"level": 1, "memory_budget": 0.0}}.items():
        torch._dynamo.reset()
        fn = torch.compile(copy.deepcopy(model), backend="fxmem", options={"inner": "eager", **options})
        for _ in range(2):
            with step_perf("cpu") as perf:
                fn(x).backward()
        peaks[name] = perf.result.peak_bytes
        notes[name] = [n for g in fxmem.report(fn).graphs for n in g.notes]
    assert peaks["budget0"] < peaks["L0"], peaks  # the model has recompute that lowers the peak
    assert peaks["L1"] < peaks["L0"] and peaks["L1"] <= 1.02 * peaks["budget0"], peaks
    assert any("using the plan of least simulated peak" in n for n in notes["L1"]), notes["L1"]


@pytest.mark.slow
def test_level1_leaves_its_layerwise_plan_for_one_that_keeps_less_and_recomputes_less(monkeypatch):
    """BART's layerwise plan comes within the slack of the least simulated peak, but another
    candidate peaks no higher, keeps fewer bytes and recomputes less: level 1 takes that one,
    and no candidate is better than its plan on all three (issue #42: under Inductor the
    layerwise plan measured 1.041x ``memory_budget=0.0``'s peak)."""
    import fxmem.remat.plan as planner
    from fxmem.remat.budget import candidate_of
    from fxmem.testing.zoo import eager_step, zoo_build

    scored, real = {}, planner.least_peak

    def spy(ctx, *args, **kwargs):
        out = real(ctx, *args, **kwargs)
        scored[ctx.joint] = ctx, out[1]
        return out

    monkeypatch.setattr(planner, "least_peak", spy)
    # BART's graph with its tied embedding's gradient summed out of place, as when issue #42 was
    # measured: with the sum in place (fxmem.remat.tied) the layerwise plan is the least peak itself
    import fxmem.remat.partition as partition
    monkeypatch.setattr(partition, "accumulate_tied_embeddings", lambda gm: 0)
    w = zoo_build("bart")
    fn = torch.compile(w.model, backend="fxmem", options={"inner": "eager", "level": 1})
    eager_step(fn, w)
    (graph,) = [g for c in fxmem.compilations(fn) for g in c.graphs]
    assert any("a plan peaking no higher keeps" in n for n in graph.plan.notes), graph.plan.notes
    ctx, candidates = scored[graph.plan.problem.joint]
    chosen = dataclasses.replace(candidate_of(ctx.walk, graph.plan.problem, graph.plan.saved, graph.plan.lam),
                                 peak=ctx.peak(graph.plan.saved))
    assert not [c for c in candidates if planner._dominates(c, chosen)]
