import subprocess
import sys
import textwrap

import pytest
import torch
from helpers import compare_step

import fxmem
from fxmem.backend import OptionError
from fxmem.models import build

EAGER = {"inner": "eager"}
SMALL = {"hf_gpt2": dict(batch=2, seq=32), "hf_llama": dict(batch=2, seq=32),
         "tiny_gpt": dict(batch=2, seq=32), "mlp_chain": dict(batch=16, width=64, depth=6)}


def _compile(options, **kw):
    return lambda m: torch.compile(m, backend="fxmem", options=options, **kw)


@pytest.mark.parametrize("name", sorted(SMALL))
def test_eager_inner_matches_eager(name):
    compiled = compare_step(build(name, **SMALL[name]), _compile(EAGER))
    comps = fxmem.compilations(compiled)
    assert comps and comps[-1].graphs, "fxmem's partitioner was not used"


@pytest.mark.slow
@pytest.mark.parametrize("name", ["hf_gpt2", "hf_llama"])
def test_dynamic_shapes_one_compile(name):
    w = build(name, **SMALL[name])
    batches = [build(name, batch=b, seq=s).batch for b, s in [(2, 32), (3, 48), (4, 24)]]
    compiled = compare_step(w, _compile(EAGER, dynamic=True), batches=batches)
    comps = fxmem.compilations(compiled)
    # the shapes change but nothing recompiles: each Dynamo graph is compiled once
    assert comps and len({str(c.compile_id) for c in comps}) == len(comps)
    for c in comps:
        assert len(c.graphs) <= 1


def test_inference_graph_passes_through():
    w = build("mlp_chain", **SMALL["mlp_chain"])
    compiled = torch.compile(w.model, backend="fxmem", options=EAGER)
    with torch.no_grad():
        assert torch.equal(compiled(**w.batch), w.model(**w.batch))


@pytest.mark.slow
@pytest.mark.inductor
@pytest.mark.parametrize("name, kw", [("mlp_chain", dict(batch=8, width=32, depth=3)),
                                      ("hf_gpt2", dict(batch=2, seq=16, layers=1, vocab=512, d=64)),
                                      ("hf_llama", dict(batch=2, seq=16, layers=1, vocab=512, d=64))])
def test_inductor_inner_matches_eager(name, kw):
    compiled = compare_step(build(name, **kw), _compile({"inner": "inductor"}))
    assert any(c.graphs for c in fxmem.compilations(compiled)), "Inductor did not call fxmem's partitioner"


def test_bad_option_is_a_one_line_value_error():
    m = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError) as info:
        torch.compile(m, backend="fxmem", options={"level": 7})(torch.randn(2, 4))
    assert isinstance(info.value, OptionError)
    # Dynamo appends a hint line; the error itself is one line
    assert str(info.value).splitlines()[0] == "option 'level': got 7; allowed: 0, 1 or 2"


def test_unexpected_backend_kwargs():
    from fxmem import fxmem_backend

    with pytest.raises(ValueError, match="unexpected arguments"):
        fxmem_backend(None, [], mode="max-autotune")


@pytest.mark.slow
def test_backend_found_without_import():
    """A fresh interpreter finds backend="fxmem" through the entry point, never importing fxmem."""
    code = textwrap.dedent("""
        import sys, torch
        m = torch.nn.Linear(8, 8)
        x = torch.randn(4, 8)
        assert "fxmem" not in sys.modules
        out = torch.compile(m, backend="fxmem", options={"inner": "eager"})(x)
        out.sum().backward()
        assert torch.allclose(out, m(x))
        print("ok", "fxmem" in sys.modules)
    """)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["ok", "True"]
