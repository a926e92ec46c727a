"""How fxmem behaves as a torch.compile backend: graph breaks, recompiles, caching, logging."""

import copy
import logging
import pickle
import re

import pytest
import torch
import torch.nn as nn
from helpers import max_rel_err
from torch._dynamo.utils import counters

import fxmem
import fxmem.backend
import fxmem.lowering.decide
import fxmem.version
from fxmem.models import build
from fxmem.remat import partition

EAGER = {"inner": "eager"}


class Block(nn.Module):
    def __init__(self, d=16, h=64):
        super().__init__()
        self.up, self.act, self.down = nn.Linear(d, h), nn.GELU(), nn.Linear(h, d)

    def forward(self, x):
        return self.down(self.act(self.up(x)))


class TwoBlocks(nn.Module):
    """Two pre-norm residual MLP layers (layer boundaries for level 1), optionally with a graph break between them."""

    def __init__(self, graph_break=False):
        super().__init__()
        self.norms = nn.ModuleList([nn.LayerNorm(16), nn.LayerNorm(16)])
        self.a, self.b, self.graph_break = Block(), Block(), graph_break

    def forward(self, x):
        h = x + self.a(self.norms[0](x))
        if self.graph_break:
            torch._dynamo.graph_break()
        return (h + self.b(self.norms[1](h))).pow(2).mean()


@pytest.fixture(autouse=True)
def _fresh_counters():
    counters.clear()  # Dynamo's and Inductor's counters outlive torch._dynamo.reset()


def _model(**kw):
    torch.manual_seed(0)
    return TwoBlocks(**kw)


def _step_matches_eager(model, compiled, x):
    """One loss+backward through ``compiled`` (a compiled deep copy of ``model``) and through
    ``model``; losses and gradients agree."""
    model.zero_grad(set_to_none=True)
    compiled.zero_grad(set_to_none=True)
    ref = model(x)
    ref.backward()
    out = compiled(x)
    out.backward()
    assert max_rel_err(ref.detach(), out.detach()) <= 1e-5
    for (name, p), q in zip(model.named_parameters(), compiled.parameters()):
        assert max_rel_err(p.grad, q.grad) <= 1e-5, name


def _compile(model, options, **kw):
    copy_ = copy.deepcopy(model)
    return copy_, torch.compile(copy_, backend="fxmem", options=options, **kw)


def _reports(compiled):
    """The reports of every graph fxmem planned for ``compiled``, oldest first."""
    return [g.report for c in fxmem.compilations(compiled) for g in c.graphs]


def test_graph_break_plans_each_graph():
    model = _model(graph_break=True)
    _, compiled = _compile(model, EAGER)
    _step_matches_eager(model, compiled, torch.randn(4, 16))
    assert counters["graph_break"], "the model did not break the graph"
    comps = fxmem.compilations(compiled)
    assert len(comps) == 2  # one Dynamo graph per side of the break
    assert [len(c.graphs) for c in comps] == [1, 1]  # each planned once
    assert all(rep.saved_bytes > 0 for rep in _reports(compiled))


def test_dynamic_compiles_once_across_shapes():
    model = _model()
    _, compiled = _compile(model, EAGER, dynamic=True)
    for b, s in [(2, 8), (3, 12), (5, 6)]:
        _step_matches_eager(model, compiled, torch.randn(b, s, 16))
    assert counters["stats"]["unique_graphs"] == 1
    comps = fxmem.compilations(compiled)
    assert len(comps) == 1 and len(comps[-1].graphs) == 1
    # one plan, as a formula over the batch and sequence sizes
    assert {"x.size(0)", "x.size(1)"} <= set(_reports(compiled)[0].symbols.values())


def _plan_of(rep):
    return rep.saved_bytes, rep.saved_formula, [(c.id, c.config, c.enabled) for c in rep.clusters]


@pytest.mark.slow
def test_changed_options_recompile_same_options_replan_the_same():
    # two layers, and activations (not parameter gradients) make the peak: level 1 keeps less
    w = build("tiny_gpt", batch=4, seq=32, vocab=64, d=32, layers=2)

    def plan_at(level):
        _, compiled = _compile(w.model, {**EAGER, "level": level})
        out = w.loss(compiled(**w.batch))
        out.backward()
        (rep,) = _reports(compiled)
        assert rep.level == level
        return _plan_of(rep)

    plans = [plan_at(0), plan_at(1)]  # the same module, compiled twice
    assert plans[0][0] != plans[1][0], "levels 0 and 1 kept the same bytes"
    torch._dynamo.reset()
    assert plan_at(0) == plans[0]


def test_cache_key_has_version_source_and_options(monkeypatch):
    p0, p1 = (partition.Partitioner(fxmem.resolve({"level": n})) for n in (0, 1))
    assert p0.uuid() == partition.Partitioner(fxmem.resolve({"level": 0})).uuid()
    assert p0.uuid() != p1.uuid()
    key = p0.uuid()
    monkeypatch.setattr(fxmem.version, "__version__", fxmem.__version__ + ".post1")  # what the key reads
    partition._source_key.cache_clear()
    try:
        assert p0.uuid() != key
    finally:
        monkeypatch.undo()
        partition._source_key.cache_clear()
    # Inductor pickles its config, the partitioner included, into its cache key: that must work
    # once the partitioner holds plans (fx graphs are cyclic), or every compile bypasses the cache
    made = []

    def spy(*args, **kwargs):
        made.append(partition.Partitioner(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(fxmem.backend, "Partitioner", spy)
    model = _model()
    _, compiled = _compile(model, EAGER)
    compiled(torch.randn(2, 16)).backward()
    (comp,) = fxmem.compilations(compiled)
    assert made and made[-1].planned and made[-1].planned == comp.graphs  # it holds the graph's plan
    assert pickle.loads(pickle.dumps(made[-1])) == made[-1].uuid()


@pytest.mark.slow
@pytest.mark.inductor
def test_inductor_cache_serves_warm_run_and_misses_on_changed_option(tmp_path):
    from torch._inductor.utils import clear_caches, fresh_cache

    torch.manual_seed(0)
    model, x = Block(8, 32), torch.randn(4, 8)  # the smallest graph: Inductor is slow on CPU

    def run(options):
        torch._dynamo.reset()
        clear_caches()  # Inductor's in-memory caches: the next compile must go to the disk cache
        counters.clear()
        # no lowering: the rule below names the GELU's cluster of aten ops
        _, compiled = _compile(model, {"inner": "inductor", "lowering": False, **options})
        out = compiled(x).pow(2).mean()
        out.backward()
        (rep,) = _reports(compiled)  # planned even when Inductor's cache serves the graphs
        return dict(counters["inductor"]), rep

    with fresh_cache(dir=str(tmp_path)):
        cold, rep0 = run({})
        warm, rep0_warm = run({})
        # keep the GELU's output, which level 0 recomputes (decomposed under Inductor: mul+mul+erf+...)
        (gelu,) = [c.id for c in rep0.clusters if c.enabled and "erf" in c.id]
        changed, rep1 = run({"config": f"{gelu}:0:-1"})
    assert not any(k.endswith("bypass") for c in (cold, warm, changed) for k in c), (cold, warm, changed)
    assert cold.get("fxgraph_cache_miss") == 2 and not cold.get("fxgraph_cache_hit")  # forward, backward
    assert warm.get("fxgraph_cache_hit") == 2 and not warm.get("fxgraph_cache_miss")
    assert _plan_of(rep0_warm) == _plan_of(rep0)
    assert changed.get("fxgraph_cache_miss") == 2 and not changed.get("fxgraph_cache_hit")
    assert rep1.saved_bytes != rep0.saved_bytes  # a new plan, not a stale one


STAGES = ("fxmem: compiling", "fxmem per-example", "fxmem lowering", "fxmem plan", "fxmem split",
          "fxmem compile")


def test_debug_log_names_each_stage(caplog, monkeypatch):
    monkeypatch.setattr(fxmem.backend, "LONG_STAGE_S", float("inf"))  # no stage counts as long, however loaded
    caplog.set_level(logging.DEBUG, logger="fxmem")
    model = _model()
    _, compiled = _compile(model, EAGER)
    compiled(torch.randn(2, 16)).backward()
    debug = [r.getMessage() for r in caplog.records if r.name == "fxmem" and r.levelno == logging.DEBUG]
    for stage in STAGES:
        assert any(m.startswith(stage) for m in debug), f"no DEBUG message for {stage!r}: {debug}"
    # the report table is logged at INFO (shown whenever the fxmem logger is on, report=True or
    # not), and nothing else is: no other INFO message, nothing above INFO
    info = [r.getMessage() for r in caplog.records if r.name == "fxmem" and r.levelno == logging.INFO]
    assert len(info) == 1 and info[0].startswith("fxmem memory plan: graph"), info
    assert not [r for r in caplog.records if r.name == "fxmem" and r.levelno > logging.INFO]


def test_a_long_stage_is_logged_at_info_with_its_time(caplog, monkeypatch):
    monkeypatch.setattr(fxmem.backend, "LONG_STAGE_S", 0.0)  # every stage counts as long
    caplog.set_level(logging.INFO, logger="fxmem")
    _, compiled = _compile(_model(), EAGER)
    compiled(torch.randn(2, 16)).backward()
    info = [r.getMessage() for r in caplog.records if r.name == "fxmem" and r.levelno == logging.INFO]
    stages = [m.split(": done in")[0] for m in info if ": done in" in m]
    assert stages == ["fxmem per-example", "fxmem lowering",
                      "fxmem compile (AOT trace, plan, split, eager inner compiler)", "fxmem record"], info
    assert all(re.search(r": done in \d+\.\d s$", m) for m in info if ": done in" in m), info


def test_report_option_logs_table_at_info(caplog, monkeypatch):
    monkeypatch.setattr(fxmem.backend, "LONG_STAGE_S", float("inf"))
    caplog.set_level(logging.INFO, logger="fxmem")
    model = _model()
    _, compiled = _compile(model, {**EAGER, "report": True})
    compiled(torch.randn(2, 16)).backward()
    info = [r.getMessage() for r in caplog.records if r.name == "fxmem" and r.levelno == logging.INFO]
    assert len(info) == 1 and info[0].startswith("fxmem memory plan: graph"), info
    assert "saved activations:" in info[0]


def test_library_does_not_print(capfd):
    model = _model(graph_break=True)
    _, compiled = _compile(model, EAGER, dynamic=True)
    for b in (2, 3):
        compiled(torch.randn(b, 16)).backward()
    fxmem.report(compiled)
    out, err = capfd.readouterr()
    assert out == "" and err == "", (out, err)


def test_recompile_limit_warns_once_at_the_users_line():
    """Past Dynamo's recompile limit the frame runs eagerly: fxmem says so once per frame,
    pointing at the caller's line; a frame compiled by another backend gets no fxmem warning."""
    import warnings

    from fxmem.recompiles import RecompileLimitWarning

    model = Block()
    # config.patch, not monkeypatch.setattr: pytest >= 9.2 undoes a setattr on an attribute that
    # is not in the module's __dict__ by deleting it, and torch's config module hides a deleted
    # key, so every later compile in the worker failed
    for backend, expected in (("fxmem", 1), ("eager", 0)):
        torch._dynamo.reset()
        options = EAGER if backend == "fxmem" else None
        compiled = torch.compile(model, backend=backend, options=options, dynamic=False)
        with warnings.catch_warnings(record=True) as caught, torch._dynamo.config.patch(recompile_limit=2):
            warnings.simplefilter("always")
            for batch in range(2, 7):  # 5 shapes, limit 2: the 3rd to 5th run eagerly
                compiled(torch.randn(batch, 16)).sum().backward()
        ours = [w for w in caught if issubclass(w.category, RecompileLimitWarning)]
        assert len(ours) == expected, [str(w.message) for w in caught]
        if ours:
            assert ours[0].filename == __file__ and "recompile_limit (2)" in str(ours[0].message)
            assert "dynamic=True" in str(ours[0].message)


@pytest.mark.inductor
def test_changing_sequence_lengths_print_nothing(tmp_path):
    """Five steps of a GPT-2 at changing sequence lengths with default options: nothing on stderr
    (fxmem's probes used to print fx tracebacks at symbolic shapes)."""
    import subprocess
    import sys

    script = tmp_path / "steps.py"
    script.write_text(
        "import torch\n"
        "from transformers import GPT2Config, GPT2LMHeadModel\n"
        "torch.manual_seed(0)\n"
        "m = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=512, use_cache=False,\n"
        "                               bos_token_id=0, eos_token_id=0))\n"
        "c = torch.compile(m, backend='fxmem')\n"
        "for s in [64, 48, 64, 32, 50]:\n"
        "    ids = torch.randint(0, 512, (2, s))\n"
        "    c(input_ids=ids, labels=ids).loss.backward()\n"
        "print('ok')\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0 and done.stdout == "ok\n", done.stderr[-3000:]
    assert done.stderr == ""


def test_compile_warnings_point_at_the_users_line():
    """A warning raised while Dynamo compiles (a rule that matches nothing, here) names the
    user's call, not a line inside fxmem or torch."""
    import warnings

    compiled = torch.compile(_model(), backend="fxmem", options={**EAGER, "config": "softmax+:1:-1"})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled(torch.randn(4, 16)).backward()  # the line warnings must name
    ours = [w for w in caught if "matches no cluster" in str(w.message)]
    assert ours and all(w.filename == __file__ for w in ours), [(w.filename, w.lineno) for w in caught]
