"""fxmem.report: the table, JSON round trip, predicted peaks against measurement, max_batch."""

import copy
import json
import logging
import subprocess
import sys
import textwrap

import pytest
import torch

import fxmem
from fxmem.models import build
from fxmem.profiling import step_perf
from fxmem.report.render import LEAST_PEAK_USED, LEVEL0_USED

SMALL = dict(layers=2, vocab=4096, d=64, heads=2)  # logits matter, as in real LMs


def _measured(workload, compiled, model, batch):
    for _ in range(2):  # the second step is measured
        model.zero_grad(set_to_none=True)
        with step_perf("cpu") as perf:
            workload.loss(compiled(**batch)).backward()
    return perf.result.peak_bytes


@pytest.fixture(scope="module")
def compiled_llama():
    torch._dynamo.reset()
    w = build("hf_llama", batch=2, seq=32, **SMALL)
    model = copy.deepcopy(w.model)
    # The report of the planner's level-1 plan of the aten graph (its cross-entropy's logits-sized
    # buffers make the peak): lowering, on by default, would fuse the loss away.
    compiled = torch.compile(model, backend="fxmem", options={"inner": "eager", "level": 1, "lowering": False},
                             dynamic=True)
    _measured(w, compiled, model, w.batch)
    # The report is taken now: each test starts with torch._dynamo.reset() (conftest), which drops
    # the compiled graphs and their records (a later call compiles afresh).
    rep = fxmem.report(compiled)
    assert len(rep.graphs) == 1
    return w, model, compiled, rep


def test_table_lists_clusters_totals_and_symbols(compiled_llama):
    _, _, _, rep = compiled_llama
    text = str(rep)
    assert "fxmem memory plan: graph" in text and "level 1" in text
    assert "saved activations:" in text and "predicted step peak:" in text and "recompute cost:" in text
    assert "input_ids.size(0) = labels.size(0) = 2; input_ids.size(1) = labels.size(1) = 32" in text  # one symbol each
    assert "*input_ids.size(0)*input_ids.size(1)" in text


@pytest.mark.slow
@pytest.mark.parametrize("batch, seq", [(2, 32), (4, 16), (2, 64), (3, 48)])  # not 1: Dynamo specializes size 1
def test_predict_peak_matches_measurement(compiled_llama, batch, seq):
    w, model, compiled, rep = compiled_llama
    inputs = build("hf_llama", batch=batch, seq=seq, **SMALL).batch
    measured = _measured(w, compiled, model, inputs)
    assert abs(rep.predict_peak(input_ids=(batch, seq)) - measured) <= 0.02 * measured


@pytest.mark.parametrize("batch, seq", [(2, 32), (4, 48)])
def test_peak_breakdown_sums_to_the_peak_and_names_the_vocabulary_sized_tensors(compiled_llama, batch, seq):
    _, _, _, rep = compiled_llama
    b = rep.peak_breakdown(input_ids=(batch, seq))
    assert b["peak"] == rep.predict_peak(input_ids=(batch, seq)) == sum(n for _, n in b["live"])
    assert b["phase"] == "backward"  # level 1: the cross-entropy backward's logits-sized buffers make the peak
    assert b["live"][0][1] == batch * seq * SMALL["vocab"] * 4
    assert "largest alive:" in str(rep)


@pytest.mark.slow
def test_max_batch_fits_and_next_does_not(compiled_llama):
    """The device holds the parameters (and the optimizer's state) beside the step's peak."""
    w, model, compiled, rep = compiled_llama
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())  # the graph reads some of them
    assert params <= rep.resident_bytes() <= params + buffers
    assert rep.resident_bytes("adam") == rep.resident_bytes() + 2 * params
    cap = rep.resident_bytes() + rep.predict_peak(input_ids=(5, 32)) + 1000
    b = rep.max_batch(cap, seq=32)
    assert b == 5
    assert rep.resident_bytes() + rep.predict_peak(input_ids=(b + 1, 32)) > cap
    measured = _measured(w, compiled, model, build("hf_llama", batch=b, seq=32, **SMALL).batch)
    assert measured + params <= cap
    assert rep.max_batch(cap, seq=32, optimizer="adam") < b  # Adam's two moments do not fit beside batch 5
    assert rep.max_batch(cap + 2 * params, seq=32, optimizer="adam") == b
    assert rep.max_batch(100) == 0
    with pytest.raises(ValueError, match="optimizer must be one of None, 'sgd', 'momentum', 'adam', 'adamw'"):
        rep.max_batch(cap, optimizer="lion")


def test_json_round_trip(compiled_llama, tmp_path):
    _, _, _, rep = compiled_llama
    path = tmp_path / "mem.json"
    rep.to_json(str(path))
    data = json.loads(path.read_text())
    assert data["fxmem_report"] == 1 and data["graphs"][0]["level"] == 1
    back = fxmem.MemoryReport.from_json(str(path))
    assert back.graphs == rep.graphs
    assert back.predict_peak(input_ids=(7, 40)) == rep.predict_peak(input_ids=(7, 40))
    with pytest.raises(ValueError, match="not an fxmem report"):
        fxmem.MemoryReport.from_json('{"something": 1}')


def test_bad_shape_name_is_a_clear_error(compiled_llama):
    _, _, _, rep = compiled_llama
    with pytest.raises(ValueError,
                       match=r"predict_peak: 'pixels' names no dynamic input dimension .* allowed: input_ids"):
        rep.predict_peak(pixels=(1, 2))


@pytest.mark.slow
def test_plot_writes_a_png(compiled_llama, tmp_path):
    _, _, _, rep = compiled_llama
    path = rep.plot(str(tmp_path / "pareto.png"))
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_explain_and_report_logging(caplog, tmp_path):
    torch._dynamo.reset()
    w = build("hf_gpt2", batch=2, seq=16, **SMALL)
    with caplog.at_level(logging.INFO, logger="fxmem"):
        rep = fxmem.explain(w.model, options={"inner": "eager", "report": True,
                                              "report_path": str(tmp_path / "r.json")}, **w.batch)
    assert rep.graphs and rep.graphs[-1].symbols
    assert "fxmem memory plan" in caplog.text
    written = list(tmp_path.glob("r.*.json"))
    assert written and fxmem.MemoryReport.from_json(str(written[0])).graphs[0].level == 0
    # r.<compile id, "/" as "_">.<graph index within that compile>.json
    g = rep.graphs[-1]
    assert g.compile_id and (tmp_path / f"r.{g.compile_id.replace('/', '_')}.{g.index}.json") in written


@pytest.mark.slow
def test_report_cli_runs_a_script(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import torch
        m = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))
        step = torch.compile(m, backend="fxmem", options={"inner": "eager"})
        step(torch.randn(8, 16)).sum().backward()
    """))
    run = subprocess.run([sys.executable, "-m", "fxmem", "report", str(script)], capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "fxmem memory plan: graph 0, level 0 (compile 0/0)" in run.stdout


@pytest.mark.slow
def test_report_of_a_model_never_includes_graphs_of_freed_models():
    """Regression: reports were matched by parameter ids, which Python reuses once a model is
    freed; compiling fresh copies in a loop gave 1, 1, 1, 2, 1, 3 graphs."""
    import gc

    w = build("tiny_gpt", batch=2, seq=8, layers=1, d=16, heads=2, vocab=32)
    for _ in range(4):
        torch._dynamo.reset()
        m = copy.deepcopy(w.model)
        c = torch.compile(m, backend="fxmem", options={"inner": "eager"})
        w.loss(c(**w.batch)).backward()
        assert len(fxmem.report(c).graphs) == 1
        del m, c
        gc.collect()


def test_a_recomputed_view_of_a_weight_saves_nothing(compiled_llama):
    # `t` of a weight is a view of a parameter: keeping it keeps no storage, so recomputing it
    # saves no bytes (the row must not claim the transpose's size).
    _, _, _, rep = compiled_llama
    rows = {r.id: r for r in rep.graphs[-1].clusters}
    assert rows["t+"].frequency > 0 and rows["t+"].recomputed > 0
    assert rows["t+"].saving_bytes == 0 and rows["t+"].saving_formula == "0"
    assert any(r.saving_bytes > 0 for r in rows.values())


class _TwoLayers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 32), torch.nn.Linear(32, 8)

    def forward(self, x):
        return self.b(torch.nn.functional.gelu(self.a(x))).square().mean()


def test_two_compiles_of_one_module_keep_their_own_records():
    """torch.compile(m, options=A) and torch.compile(m, options=B): each callable's records and
    report are its own compile's; the module itself has both (after module.compile(), that
    compile's); equal options share Dynamo's graph."""
    m, x = _TwoLayers(), torch.randn(4, 8)
    a = torch.compile(m, backend="fxmem", options={"inner": "eager", "lowering": False})
    b = torch.compile(m, backend="fxmem", options={"inner": "eager", "lowering": False, "level": 1})
    a(x).backward()
    b(x).backward()
    (ra,), (rb,) = fxmem.compilations(a), fxmem.compilations(b)
    assert (ra.options.level, rb.options.level) == (0, 1)
    assert [g.level for g in fxmem.report(a).graphs] == [0]
    assert [g.level for g in fxmem.report(b).graphs] == [1]
    assert fxmem.compilations(m) == [ra, rb]
    same = torch.compile(m, backend="fxmem", options={"inner": "eager", "lowering": False})
    same(x).backward()  # served by a's graph: Dynamo shares it between equal backends
    assert fxmem.compilations(same) == [ra] and fxmem.compilations(m) == [ra, rb]
    m.compile(backend="fxmem", options={"inner": "eager", "lowering": False, "level": 2})
    m(x).backward()  # the module's own compiled call: the module reports that compile
    assert [c.options.level for c in fxmem.compilations(m)] == [2]
    assert fxmem.compilations(a) == [ra] and fxmem.compilations(b) == [rb]


def test_two_compiles_of_one_function_keep_their_own_records():
    def step(w, x):
        return torch.nn.functional.gelu(x @ w).square().sum()

    w, x = torch.randn(8, 8, requires_grad=True), torch.randn(4, 8)
    f = torch.compile(step, backend="fxmem", options={"inner": "eager", "lowering": False})
    g = torch.compile(step, backend="fxmem", options={"inner": "eager", "lowering": False, "level": 2})
    f(w, x).backward()
    g(w, x).backward()
    assert [c.options.level for c in fxmem.compilations(f)] == [0]
    assert [c.options.level for c in fxmem.compilations(g)] == [2]
    assert [c.options.level for c in fxmem.compilations(f, match=[w])] == [0]
    assert [c.options.level for c in fxmem.compilations(step)] == [0, 2]  # the function itself: both


def test_human_units_never_print_zero_of_a_large_unit():
    from fxmem.report.render import human

    assert [human(b) for b in (0, 8, 1023, 1024, 1536, 500 * 2**10, 1000 * 2**10, 3 * 2**20 + 2**19, 7 * 2**30)] == \
        ["0 B", "8 B", "1023 B", "1 KiB", "1.5 KiB", "500 KiB", "1000 KiB", "3.5 MiB", "7 GiB"]


def _summary_and_modules(rep):
    g = rep.graphs[-1]
    lines = str(rep).splitlines()
    return g, lines


def test_report_opens_with_the_summary_and_attributes_kept_values_to_modules(compiled_llama):
    _, _, _, rep = compiled_llama
    g, lines = _summary_and_modules(rep)
    assert lines[0].startswith("fxmem memory plan: graph 0, level 1")
    assert lines[1].startswith("step peak (predicted): ") and "level 0 ~" in lines[1] and "eager" in lines[1]
    assert lines[2].startswith("kept activations: ") and lines[3].startswith("recompute cost: ")
    assert lines[4].startswith("largest at the peak (backward")
    assert "0.0 MiB" not in str(rep)
    # Every kept byte is attributed to a module, and the modules are the model's (model.layers.0 ...).
    assert sum(kept for _, kept, _ in g.modules) == g.saved_bytes
    assert any(m.startswith("model.layers.1.") for m, _, _ in g.modules)
    assert "model.layers.*." in "\n".join(lines[5:])  # repeated layers folded in the module table
    # The top holders are the peak's live values grouped by module: the largest is the head's logits.
    b = rep.peak_breakdown()
    assert lines[4].split(": ", 1)[1].startswith(f"{g.owners[b['live'][0][0]]} ")


@pytest.mark.slow
def test_gpt2_report_names_its_modules_and_says_which_plan_it_used():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=512, n_positions=64, use_cache=False,
                     loss_type="ForCausalLM", bos_token_id=0, eos_token_id=0)
    ids = torch.randint(0, 512, (2, 32))
    rep = fxmem.explain(GPT2LMHeadModel(cfg), {"inner": "eager", "level": 1}, input_ids=ids, labels=ids)
    g, lines = _summary_and_modules(rep)
    modules = {m for m, _, _ in g.modules}
    assert {"transformer.h.0.attn", "transformer.h.1.attn", "lm_head"} <= modules
    assert "transformer.h.*.attn" in str(rep) and "transformer.h.*.mlp" in str(rep)
    level0 = any(LEVEL0_USED in n for n in g.notes)
    fell_back = level0 or any(LEAST_PEAK_USED in n for n in g.notes)
    assert lines[0].endswith("used as asked") != fell_back
    assert ("level 0's plan used" in lines[0]) == level0
    assert ("the least-peak plan used" in lines[0]) == (fell_back and not level0)
