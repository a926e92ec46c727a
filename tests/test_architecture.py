"""The project's structure as tests: no import cycles, no process-wide registries that hold results
(a compile's graphs die with its compiled function), fxmem in torch's logging, lint clean."""

from __future__ import annotations

import ast
import gc
import os
import shutil
import subprocess
import sys
import weakref
from pathlib import Path

import networkx as nx
import pytest
import torch
import torch.fx as fx

import fxmem

ROOT = Path(__file__).resolve().parents[1]


def _modules(folders: tuple[str, ...] = ("fxmem", "fxmem_kernels")) -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, is a package's ``__init__``) for every file under ``folders``."""
    mods = {}
    for folder in folders:
        for p in ROOT.glob(f"{folder}/**/*.py"):
            parts = list(p.relative_to(ROOT).with_suffix("").parts)
            is_pkg = parts[-1] == "__init__"
            mods[".".join(parts[:-1] if is_pkg else parts)] = (p, is_pkg)
    return mods


def _type_only(tree: ast.AST) -> set[int]:
    """The ids of every node inside an ``if TYPE_CHECKING:`` block (``typing.TYPE_CHECKING`` too)."""
    return {id(x) for n in ast.walk(tree) if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test)
            for b in n.body for x in ast.walk(b)}


def _imported(node: ast.AST, package: str, known) -> list[str]:
    """The dotted names an import statement loads (relative ones resolved against ``package``):
    ``from . import x`` with ``x`` a module loads ``x``, else the module and its names."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:
        up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
        base = ".".join(up + ([node.module] if node.module else []))
    subs = [f"{base}.{a.name}" for a in node.names]
    return subs if all(known(s) for s in subs) else [base, *subs]


def import_graph(type_only: bool = False, bench: bool = False) -> nx.DiGraph:
    """Module -> module it imports, every import that runs counted (function-level ones too).
    ``type_only``: also those under ``if TYPE_CHECKING:`` (they never run, but they tie the two
    modules' designs just the same). ``bench``: also bench/'s scripts, named ``bench.<file>``,
    whose bare imports resolve as they run (their own folder, then bench/, on ``sys.path``)."""
    mods = _modules(("fxmem", "fxmem_kernels", "bench") if bench else ("fxmem", "fxmem_kernels"))

    def resolve(name: str, search: tuple[str, ...]) -> str:
        for prefix in search:  # "": the checkout's root; "bench." etc.: a script's sys.path entries
            full = prefix + name
            while full and full not in mods:
                full = full.rsplit(".", 1)[0] if "." in full else ""
            if full and (not prefix or full.startswith(prefix)):
                return full
        return ""

    g = nx.DiGraph()
    for mod, (path, is_pkg) in mods.items():
        g.add_node(mod)
        tree = ast.parse(path.read_text())
        skip = set() if type_only else _type_only(tree)
        package = mod if is_pkg else mod.rsplit(".", 1)[0]
        search = ("",)
        if mod.startswith("bench."):
            search = (package + ".", "bench.", "") if package != "bench" else ("bench.", "")
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            relative = isinstance(node, ast.ImportFrom) and node.level
            for t in _imported(node, package, lambda s: resolve(s, ("",) if relative else search) == s):
                r = resolve(t, ("",) if relative else search)
                if r and r != mod:
                    g.add_edge(mod, r)
    return g


def test_no_import_circle_even_through_type_only_imports():
    """No two modules of fxmem, fxmem_kernels or bench/ import each other, directly or around a
    circle, counting the imports under ``if TYPE_CHECKING:`` and inside functions: a circle that
    only a type annotation or a function-local import keeps from failing at import time is still
    two modules that cannot be understood (or moved) one without the other."""
    g = import_graph(type_only=True, bench=True)
    assert len(g) > 80, "the module scan found too few modules"
    assert {"bench.harness", "bench.tables", "fxmem.report.model", "fxmem.remat.partition"} <= set(g)
    assert set(g.edges) > set(import_graph(bench=True).edges), "type-only imports were not read"
    assert g.has_edge("bench.render", "bench.harness"), "bench's bare imports were not resolved"
    circles = [sorted(c) for c in nx.strongly_connected_components(g) if len(c) > 1]
    assert not circles, "import circles: " + "; ".join(
        " <-> ".join(c) + " (" + ", ".join(f"{a} -> {b}" for a in c for b in g.successors(a) if b in c) + ")"
        for c in circles)


def test_the_planner_sits_below_the_backend_and_the_reports():
    g = import_graph()
    remat = [m for m in g if m.startswith("fxmem.remat")]
    assert "fxmem.remat.partition" in remat
    above = {"fxmem", "fxmem.backend", "fxmem.per_example"}
    bad = [(m, t) for m in remat for t in nx.descendants(g, m)
           if t in above or t.startswith(("fxmem.report", "fxmem.per_example", "fxmem.dpsgd"))]
    assert not bad, f"remat/ reaches up into: {bad}"


def test_the_planner_and_the_graph_analyses_import_no_stage_above_them():
    """remat/ and graph/ know nothing of the inner compiler, the reports or the compile records:
    the target's memory model reaches the planner as an object (remat.settings.Target)."""
    g = import_graph()
    above = ("fxmem.inner", "fxmem.report", "fxmem.compilation", "fxmem.backend")
    bad = [(m, t) for m in g if m.startswith(("fxmem.remat", "fxmem.graph")) for t in g.successors(m)
           if t.startswith(above)]
    assert not bad, f"remat/ or graph/ imports a stage above it: {bad}"


def test_options_flow_down_unchanged():
    """No module but options.py makes a changed copy of the options (``dataclasses.replace`` of an
    ``Options``): each stage derives its own settings from them instead."""
    found = []
    for mod, (path, _) in _modules().items():
        if mod == "fxmem.options":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func) in ("replace", "dataclasses.replace") \
                    and node.args and "opt" in ast.unparse(node.args[0]).lower():
                found.append(f"{mod}:{node.lineno}: {ast.unparse(node)}")
    assert not found, "Options replaced downstream: " + "; ".join(found)


# The one module-level registry: a weak set of the live compile records (it holds none of them
# alive), so that fxmem.compilations() need not scan the heap.
# Weak registries (they hold nothing alive): every live compile's record; the slots that the keys
# baked into step_in_backward's compiled graphs name.
WEAK_REGISTRIES = {"fxmem.compilation": ("_LIVE", "weakref.WeakSet()"),
                   "fxmem.step_in_backward.runtime": ("_SLOTS", "weakref.WeakValueDictionary()")}


def test_no_module_level_container_collects_results():
    """A module-level name bound to an empty list/dict/set (or a counter) is where per-compile
    results accumulate; constant tables are written out where they are defined."""
    empty = ("[]", "{}", "set()", "list()", "dict()", "itertools.count()", "count()", "collections.defaultdict(list)",
             "defaultdict(list)", "weakref.WeakKeyDictionary()", "weakref.WeakValueDictionary()", "weakref.WeakSet()")
    found = []
    for mod, (path, _) in _modules().items():
        for node in ast.parse(path.read_text()).body:
            value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
            target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
            allowed = value is not None and (ast.unparse(target), ast.unparse(value)) == WEAK_REGISTRIES.get(mod)
            if value is not None and ast.unparse(value) in empty and not allowed:
                found.append(f"{mod}:{node.lineno}: {ast.unparse(node)}")
    assert not found, "module-level containers: " + "; ".join(found)


class _MLP(torch.nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.a, self.b = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

    def forward(self, x):
        return self.b(torch.nn.functional.gelu(self.a(x))).square().mean()


class _Norm(torch.nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.n, self.a = torch.nn.LayerNorm(d), torch.nn.Linear(d, d)

    def forward(self, x):
        return self.a(self.n(x)).relu().sum()


def _graph_modules() -> list[weakref.ref]:
    gc.collect()
    return [weakref.ref(o) for o in gc.get_objects() if isinstance(o, fx.GraphModule)]


@pytest.mark.slow
def test_graphs_die_with_their_compiled_function():
    """Compile several models (levels 0-2, lowering, a budget, a chunked per-example step), run
    them, delete them and reset Dynamo: every graph module made meanwhile is freed."""
    torch._dynamo.reset()
    before = {id(r()) for r in _graph_modules() if r() is not None}

    def train(model, options):
        compiled = torch.compile(model, backend="fxmem", options={"inner": "eager", **options})
        compiled(torch.randn(256, 16)).backward()
        comps = fxmem.compilations(compiled)
        assert comps and comps[-1].graphs and comps[-1].graphs[-1].report is not None
        return [weakref.ref(c) for c in comps]

    records = []
    records += train(_MLP(), {})
    records += train(_Norm(), {"level": 1, "lowering": True})
    records += train(_MLP(), {"level": 2, "memory_budget": 1.0})

    from fxmem.dpsgd import clipped_grad

    w = torch.randn(16, 4)
    fn = clipped_grad(lambda w, x, y: ((x @ w - y) ** 2).mean(), 1.0, batch_argnums=(1, 2), microbatch_size=4,
                      options={"inner": "eager"})
    fn(w, torch.randn(8, 16), torch.randn(8, 4))
    assert fn.chosen_microbatch_size() == 4
    records += [weakref.ref(c) for c in fxmem.compilations(fn.compiled)]
    new = [r for r in _graph_modules() if r() is not None and id(r()) not in before]
    assert len(new) >= 8, f"expected the compiles to make graph modules, found {len(new)}"
    del fn, w
    torch._dynamo.reset()
    gc.collect()
    alive = [type(r()).__name__ for r in new if r() is not None]
    assert not alive, f"{len(alive)} graph modules outlived their compiled functions: {alive}"
    assert not [r for r in records if r() is not None], "Compilation records outlived their compiled functions"


def test_a_second_model_of_a_compiled_class_reports_the_graphs_that_serve_it():
    """Dynamo serves a second instance of a compiled class from the first one's graphs (its
    parameters are graph inputs): its report is that graph's, not empty."""
    torch._dynamo.reset()
    first, second = _MLP(), _MLP()
    for m in (first, second):
        torch.compile(m, backend="fxmem", options={"inner": "eager"})(torch.randn(8, 16)).backward()
    one, two = fxmem.report(first), fxmem.report(second)
    assert len(one.graphs) == 1 and len(two.graphs) == 1
    assert two.graphs[0].saved_expr == one.graphs[0].saved_expr


def test_chunk_graphs_are_lowered_on_the_one_compile_path():
    """Per-example chunk graphs go through pattern lowering like whole graphs."""
    from fxmem.dpsgd import clipped_grad

    torch._dynamo.reset()
    norm_w, proj = torch.ones(16), torch.randn(16, 4)

    def loss(params, x, y):
        h = torch.nn.functional.layer_norm(x, (16,), params["n"])
        return ((h @ params["p"] - y) ** 2).mean()

    params = {"n": norm_w, "p": proj}
    fn = clipped_grad(loss, 1.0, batch_argnums=(1, 2), microbatch_size=4,
                      options={"inner": "eager", "lowering": True, "ghost_clipping": False})
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    got = fn(params, x, y)
    lowered = [row.pattern for c in fxmem.compilations(fn.compiled) for g in c.graphs for row in g.report.lowerings]
    assert "layer_norm" in lowered, lowered
    from fxmem.testing import per_example_reference

    want, _ = per_example_reference(loss, params, (x, y), 1.0)
    for k in want:
        torch.testing.assert_close(got[k].double(), want[k], rtol=1e-5, atol=1e-6)


_SCRIPT = """
import torch
m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 1))
step = torch.compile(m, backend="fxmem", options={"inner": "eager"})
step(torch.randn(2, 4)).sum().backward()
"""


def _run(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env}, cwd=tmp_path)


@pytest.mark.slow
def test_torch_logs_fxmem_prints_each_plan(tmp_path):
    run = _run(tmp_path, TORCH_LOGS="fxmem")
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stderr.count("fxmem memory plan: graph 0, level 0 (compile 0/0)") == 1, run.stderr[-2000:]


@pytest.mark.slow
def test_a_torch_trace_run_holds_the_plan_artifacts(tmp_path):
    run = _run(tmp_path, TORCH_TRACE=str(tmp_path / "trace"))
    assert run.returncode == 0, run.stderr[-2000:]
    text = "".join(p.read_text() for p in (tmp_path / "trace").glob("*.log"))
    assert text.count('"name": "fxmem_plan"') == 1, text[:2000]
    assert '"fxmem_report": 1' in text or '\\"fxmem_report\\": 1' in text


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff is not installed (pip install -e '.[test]')")
def test_ruff_is_clean_with_the_projects_configuration():
    run = subprocess.run(["ruff", "check", "."], capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-4000:]


def test_no_test_monkeypatches_a_torch_config_object():
    """torch's config modules (``torch._dynamo.config``, ``torch._inductor.config``, ...) are
    patched with their own ``config.patch``: pytest >= 9.2's ``monkeypatch.setattr`` undoes a
    setattr on a key missing from the module's ``__dict__`` by deleting it, and a deleted config
    key is hidden for the rest of the process (every later compile fails)."""
    offenders = []
    for path in sorted(Path(__file__).parent.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("setattr", "delattr") and node.args
                    and ast.unparse(node.func.value).endswith("monkeypatch")):
                target = ast.unparse(node.args[0])
                if "config" in target.split(".")[-1] or target.rstrip("\"'").endswith(".config"):
                    offenders.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    assert not offenders, offenders
