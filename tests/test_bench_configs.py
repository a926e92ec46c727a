"""bench/configs.py: budget configurations at any fraction, and clear errors."""

import pytest
import torch
from helpers import load_bench_module

configs = load_bench_module("configs")


def test_a_budget_at_any_fraction_derives_from_its_base():
    fx = configs.parse("fxmem-inductor+budget0.96")
    assert (fx.kind, dict(fx.options)) == ("fxmem", {"inner": "inductor", "memory_budget": 0.96})
    torch_cfg = configs.parse("inductor+budget0.25")
    assert (torch_cfg.kind, dict(torch_cfg.options)) == ("inductor", {"activation_memory_budget": 0.25})
    assert configs.parse("fxmem-eager+budget0.9") is configs.REGISTRY["fxmem-eager+budget0.9"]


@pytest.mark.parametrize("spec", ["fxmem-inductor+budgetx", "eager+budget0.5", "nope"])
def test_unknown_configs_are_refused_with_the_known_ones(spec):
    with pytest.raises(ValueError, match=r"unknown config .*; known: eager"):
        configs.parse(spec)


@pytest.mark.parametrize("kind, where", [("mincut_eager", "torch._functorch.partitioners"),
                                         ("inductor", "torch._inductor.compile_fx")])
def test_each_budget_config_partitions_with_its_own_budget_in_one_process(kind, where, monkeypatch):
    # torch.compile(backend="inductor") twice on the same model class reuses the first compile,
    # whatever activation_memory_budget says: each budget config must compile its own graphs.
    import copy
    import importlib

    import torch

    module = importlib.import_module(where)
    original, budgets = module.min_cut_rematerialization_partition, []

    def spy(*args, **kwargs):
        budgets.append(torch._functorch.config.activation_memory_budget)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, "min_cut_rematerialization_partition", spy)
    if kind == "mincut_eager":  # the builder imports it from functorch.compile
        monkeypatch.setattr("functorch.compile.min_cut_rematerialization_partition", spy)
    torch._dynamo.reset()
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 8))
    x = torch.randn(4, 8)
    # No compile caches (a cache hit skips the partitioner). Their own patch(), not monkeypatch:
    # undoing a monkeypatched config entry can delete it.
    with torch._functorch.config.patch(enable_autograd_cache=False), torch._inductor.config.patch(fx_graph_cache=False):
        for spec in [kind, f"{kind}+budget0.5", f"{kind}+budget0.1"]:
            configs.build(copy.deepcopy(model), configs.parse(spec))(x).sum().backward()
    assert budgets == [1.0, 0.5, 0.1]
    assert torch._functorch.config.activation_memory_budget == 1.0


@pytest.mark.parametrize("spec, lowering", [("fxmem-eager+loss_only", False), ("fxmem-inductor-level1", False),
                                            ("fxmem-eager+lowering+loss_only", True),
                                            ("fxmem-eager-defaults+loss_only", {"dropout": False})])
def test_fxmem_configs_pin_lowering_off_unless_they_ask_for_lowering_or_the_defaults(spec, lowering, monkeypatch):
    import torch

    from fxmem.options import resolve

    seen = []
    monkeypatch.setattr(torch, "compile", lambda model, backend, options: seen.append(options) or model)
    model = torch.nn.Linear(2, 2)
    model.loss_function = None  # an HF-like model, for the loss_only configurations
    configs.build(model, configs.parse(spec))
    assert seen[0]["inner"] == configs.parse(spec).options["inner"]
    got = resolve(seen[0], env={}).lowering
    assert (got if isinstance(got, bool) else dict(got)) == lowering
    assert ("lowering" in seen[0]) == isinstance(lowering, bool)  # the defaults config: fxmem's own


def test_inductor_rows_of_a_dropout_model_are_checked_against_plain_inductor():
    run = load_bench_module("run")

    def row(config, loss, grad, dropout=0.1):
        return {"model": "m", "config": config, "status": "ok", "loss": loss, "grad_norm": grad,
                "peak_bytes": 1, "step_time_median_s": 1.0, "model_kwargs": {"dropout": dropout}}

    rows = [row("eager", 1.0, 1.0), row("inductor", 1.1, 2.0), row("fxmem-inductor-level1", 1.1, 2.0),
            row("fxmem-inductor", 1.2, 2.0), row("fxmem-eager-level1", 1.0, 1.0)]
    run.annotate(rows)
    assert [r["check"] for r in rows] == ["ok", "Inductor's dropout masks (no reference)", "ok vs inductor",
                                          "MISMATCH loss 9.1e-02 vs inductor", "ok"]
    no_dropout = [row("eager", 1.0, 1.0, dropout=0.0), row("fxmem-inductor", 1.1, 1.0, dropout=0.0)]
    run.annotate(no_dropout)
    assert no_dropout[1]["check"] == "MISMATCH loss 1.0e-01"


class _Chain(torch.nn.Module):
    """Three bias-free d x d linears and a head: every term of the floor is known in closed form."""

    def __init__(self, d):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(d, d, bias=False) for _ in range(3))
        self.head = torch.nn.Linear(d, 1, bias=False)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def test_the_floor_of_a_linear_chain_is_its_closed_form():
    floor = load_bench_module("floor")
    n, d = 64, 32
    model = _Chain(d)
    terms = floor.physical_floor(model, lambda out: out.sum(), {"x": torch.randn(n, d)})
    f32 = 4
    assert terms["grads"] == (3 * d * d + d) * f32
    assert terms["boundaries"] == 3 * n * d * f32
    # one layer alone: its output, the incoming gradient (ones) and the input's gradient
    assert terms["layer_working_set"] == 3 * n * d * f32
    assert terms["total"] == max(terms["grads"], terms["boundaries"] + max(terms["layer_working_set"],
                                                                          terms["loss_working_set"]))
    assert all(p.grad is None for p in model.parameters())  # the model is left as it was given


def test_the_floor_of_gpt2_finds_its_blocks_and_is_below_eager():
    from fxmem.models import build
    from fxmem.profiling import step_perf

    floor = load_bench_module("floor")
    w = build("hf_gpt2", batch=2, seq=32, vocab=128, d=32, layers=3, heads=2, dropout=0.1)
    (parent, attr, blocks), = floor.layer_stacks(w.model)
    assert attr == "h" and len(blocks) == 3
    terms = floor.physical_floor(w.model, w.loss, w.batch)
    assert terms["boundaries"] == 3 * 2 * 32 * 32 * 4
    assert terms["layer_working_set"] > 0 and terms["loss_working_set"] > 0
    for _ in range(2):
        w.model.zero_grad(set_to_none=True)
        with step_perf("cpu") as perf:
            w.loss(w.model(**w.batch)).backward()
    assert terms["total"] < perf.result.peak_bytes


def test_a_model_without_repeated_layers_has_no_floor():
    floor = load_bench_module("floor")
    with pytest.raises(ValueError, match="no stack of repeated layers"):
        floor.physical_floor(torch.nn.Linear(2, 1), lambda out: out.sum(), {"input": torch.randn(4, 2)})


def test_the_floor_row_shows_its_terms_and_no_loss_check():
    run = load_bench_module("run")
    mib = 2**20
    rows = [{"model": "m", "config": "eager", "status": "ok", "loss": 1.0, "grad_norm": 1.0, "peak_bytes": 10 * mib,
             "step_time_median_s": 1.0},
            {"model": "m", "config": "floor", "status": "ok", "peak_bytes": 4 * mib, "step_time_median_s": None,
             "floor": {"grads": mib, "boundaries": mib, "layer_working_set": 2 * mib, "loss_working_set": mib,
                       "total": 4 * mib}}]
    run.annotate(rows)
    assert rows[1]["check"] == "floor: max(grads 1.0, boundaries 1.0 + max(layer 2.0, loss 1.0)) MiB"
    assert rows[1]["peak_vs_eager"] == 0.4 and "time_vs_eager" not in rows[1]


def test_autocast_rows_compare_with_eager_under_the_same_autocast(tmp_path):
    """``--autocast off,bf16``: each row's ratios and loss check use eager under its own autocast,
    with bf16 rounding as the tolerance there; the table gets an autocast column."""
    run = load_bench_module("run")

    def row(config, autocast, loss, grad, peak):
        return {"model": "m", "config": config, "autocast": autocast, "status": "ok", "loss": loss, "grad_norm": grad,
                "peak_bytes": peak, "step_time_median_s": 1.0, "compile_s": 0.0, "model_kwargs": {}}

    rows = [row("eager", "off", 1.0, 1.0, 8), row("eager", "bf16", 1.01, 1.0, 4),
            row("fxmem-eager-level1", "bf16", 1.01 * (1 + 5e-5), 1.0 + 1e-3, 2),
            row("fxmem-eager-level1", "off", 1.01, 1.0, 2)]
    run.annotate(rows)
    assert [r["check"] for r in rows] == ["ok", "ok", "ok", "MISMATCH loss 1.0e-02"]
    assert rows[2]["peak_vs_eager"] == 0.5 and rows[3]["peak_vs_eager"] == 0.25
    doc = {"meta": {"command": "python bench/run.py --name t"},
           "run": {"name": "t", "device": "cpu", "warmup": 1, "mem_steps": 1, "steps": 1, "cache": "worker",
                   "autocast": ["off", "bf16"], "model_kwargs": {"m": {}}, "configs": ["eager"]}, "results": rows}
    _, md = run.write(doc, tmp_path, "t")
    text = md.read_text()
    assert "| model | autocast | config |" in text and "| m | bf16 | eager |" in text
