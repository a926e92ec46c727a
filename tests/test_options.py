import json
import re

import pytest
import torch

from fxmem.lowering import enabled
from fxmem.options import LOWERING_PATTERNS, Options, Rule, resolve

ENV0 = {}


def test_defaults():
    o = resolve({}, env=ENV0)
    assert o == Options() and o.level == 0 and o.inner == "inductor" and o.config == ()
    assert dict(o.lowering) == {"dropout": False}  # every pattern but seeded dropout
    assert {p.name for p in enabled(o.lowering)} == set(LOWERING_PATTERNS) - {"dropout"}


def test_env_and_explicit_precedence():
    env = {"FXMEM_MEMORY_OPT_LEVEL": "2", "FXMEM_MEMORY_OPT_CONFIG": "add+gelu+:1:-1,mm+:2:3"}
    o = resolve({}, env=env)
    assert o.level == 2
    assert o.config == (Rule("add+gelu+", 1, -1), Rule("mm+", 2, 3))
    o = resolve({"level": 1, "config": ["x+:0:1"]}, env=env)
    assert o.level == 1 and o.config == (Rule("x+", 0, 1),)


def test_config_from_json_file(tmp_path):
    path = tmp_path / "rules.json"
    path.write_text(json.dumps(["add+gelu+:1:-1", "Cast+:2:2"]))
    o = resolve({}, env={"FXMEM_MEMORY_OPT_CONFIG": str(path)})
    assert [str(r) for r in o.config] == ["add+gelu+:1:-1", "Cast+:2:2"]


def test_budget_forms():
    assert resolve({"memory_budget": "512MB"}, env=ENV0).memory_budget == 512 * 10**6
    assert resolve({"memory_budget": "1.5GiB"}, env=ENV0).memory_budget == int(1.5 * 2**30)
    assert resolve({"memory_budget": 1000}, env=ENV0).memory_budget == 1000
    assert resolve({"memory_budget": 0.5}, env=ENV0).memory_budget == 0.5
    assert resolve({"memory_budget": 0.0}, env=ENV0).memory_budget == 0.0
    assert resolve({"peak_budget": "6GB"}, env=ENV0).peak_budget == 6 * 10**9
    assert resolve({"peak_budget": 4096}, env=ENV0).peak_budget == 4096


def test_options_are_frozen():
    o = resolve({}, env=ENV0)
    with pytest.raises(AttributeError):
        o.level = 2


@pytest.mark.parametrize("options, match", [
    ({"levle": 1}, r"option 'levle': unknown option \(value 1\); did you mean 'level'\? allowed keys: level, config"),
    ({"xyzzy": 1}, r"option 'xyzzy': unknown option \(value 1\); allowed keys: level, config"),
    ({"level": "high"}, r"option 'level': got 'high'; allowed: 0, 1 or 2"),
    ({"level": 3}, r"option 'level': got 3; allowed: 0, 1 or 2"),
    ({"level": -1}, r"option 'level': got -1; allowed: 0, 1 or 2"),
    ({"level": True}, r"option 'level': got True; allowed: 0, 1 or 2"),
    ({"config": ["add+gelu+:1"]},
     r"option 'config': malformed rule 'add\+gelu\+:1'; expected 'cluster:strategy:count'"),
    ({"config": "add+:7:-1"}, r"option 'config': malformed rule 'add\+:7:-1'"),
    ({"config": "add+:1:0"}, r"option 'config': malformed rule 'add\+:1:0'"),
    ({"config": ":1:-1"}, r"option 'config': malformed rule ':1:-1'"),
    ({"config": "/no/such/rules.json"}, r"option 'config': config file '/no/such/rules.json' does not exist"),
    ({"config": 5}, r"option 'config': got 5; allowed: a list of 'cluster:strategy:count' strings"),
    ({"memory_budget": -5}, r"option 'memory_budget': got -5; allowed: a non-negative number of bytes"),
    ({"memory_budget": "-1GB"}, r"option 'memory_budget': got '-1GB'; allowed: a non-negative number of bytes"),
    ({"memory_budget": "12 parsecs"}, r"option 'memory_budget': got '12 parsecs'"),
    ({"memory_budget": 1.5}, r"option 'memory_budget': got 1.5; allowed: a fraction in \[0, 1\]"),
    ({"peak_budget": 0.5}, r"option 'peak_budget': got 0.5; allowed: a non-negative number of bytes"),
    ({"peak_budget": "-2GB"}, r"option 'peak_budget': got '-2GB'"),
    ({"memory_budget": 0.5, "peak_budget": "1GB"}, r"options 'memory_budget' \(0.5\) and 'peak_budget' "
                                                    r"\(1000000000\): give one"),
    ({"inner": "tvm"}, r"option 'inner': got 'tvm'; allowed: 'inductor' or 'eager'"),
    ({"microbatch_size": 0}, r"option 'microbatch_size': got 0; allowed: None, a positive int, or 'auto'"),
    ({"lowering": {"bias_gleu": True}}, r"option 'lowering.bias_gleu': got True; did you mean 'bias_gelu'\? "
                                        r"allowed: pattern names"),
    ({"plan_shape": {"input_ids": [0, 4]}}, r"option 'plan_shape': got \{'input_ids': \[0, 4\]\}"),
    ({"strict": "yes"}, r"option 'strict': got 'yes'; allowed: True or False"),
])
def test_bad_options(options, match):
    with pytest.raises(ValueError, match=match):
        resolve(options, env=ENV0)


def test_bad_env_names_the_variable():
    with pytest.raises(ValueError, match=r"environment variable FXMEM_MEMORY_OPT_LEVEL: got '5'; allowed: 0, 1 or 2"):
        resolve({}, env={"FXMEM_MEMORY_OPT_LEVEL": "5"})
    with pytest.raises(ValueError, match=r"environment variable FXMEM_MEMORY_OPT_CONFIG: malformed rule 'nonsense'"):
        resolve({}, env={"FXMEM_MEMORY_OPT_CONFIG": "nonsense"})


@pytest.mark.parametrize("name, default", [("FXMEM_REPORT", "off"), ("FXMEM_MEASURE_SCRATCH", "on"),
                                           ("FXMEM_KERNELS_TRITON", "off")])
def test_every_on_off_env_var_refuses_garbage(name, default):
    """Each on/off variable fxmem reads is checked when options resolve, whether it is an option
    (FXMEM_REPORT) or read where it acts (the measurements, the kernels' dispatch)."""
    with pytest.raises(ValueError, match=rf"environment variable {name}: got 'maybe'; allowed: 1/true/yes/on or "
                                         rf"0/false/no/off \(unset: {default}\)"):
        resolve({}, env={name: "maybe"})
    resolve({}, env={name: " Off "})  # any case, spaces around


def test_fxmem_report_env_is_a_flag():
    assert resolve({}, env={"FXMEM_REPORT": "yes"}).report is True
    assert resolve({}, env={"FXMEM_REPORT": "0"}).report is False
    assert resolve({"report": False}, env={"FXMEM_REPORT": "1"}).report is False  # options= wins


@pytest.mark.parametrize("value, match", [
    ("0.5", r"option 'memory_budget': got '0.5'; bytes must be a whole number; for a fraction of level 0's saved "
            r"bytes pass the float memory_budget=0.5"),
    ("1.5", r"option 'memory_budget': got '1.5'; bytes must be a whole number; allowed: a non-negative number"),
    ("0.5B", r"option 'memory_budget': got '0.5B'; bytes must be a whole number"),
])
def test_a_fractional_byte_string_is_refused(value, match):
    with pytest.raises(ValueError, match=match):
        resolve({"memory_budget": value}, env=ENV0)
    assert resolve({"memory_budget": "512"}, env=ENV0).memory_budget == 512  # whole bytes without a unit: fine
    assert resolve({"memory_budget": "0.5KB"}, env=ENV0).memory_budget == 500


def test_a_bad_option_fails_the_compile_as_an_option_error():
    """Through torch.compile: OptionError itself (not BackendCompilerFailed), naming the option."""
    import torch

    from fxmem import OptionError

    compiled = torch.compile(torch.nn.Linear(2, 2), backend="fxmem", options={"inner": "eager", "memory_budget": "0.5"})
    with pytest.raises(OptionError, match=r"pass the float memory_budget=0.5"):
        compiled(torch.randn(3, 2))


def test_bad_json_file(tmp_path):
    path = tmp_path / "rules.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match=r"option 'config': config file .* is not valid JSON"):
        resolve({"config": str(path)}, env=ENV0)
    path.write_text(json.dumps({"a": 1}))
    with pytest.raises(ValueError, match=r"the JSON file must hold a list"):
        resolve({"config": str(path)}, env=ENV0)


def test_config_file_errors_name_the_file(tmp_path):
    path = tmp_path / "rules.json"
    where = re.escape(f"config file '{path}'")
    path.write_bytes(b'["add+:1:-1", "caf\xe9"]')  # latin-1, not UTF-8
    with pytest.raises(ValueError, match=rf"option 'config': {where} is not UTF-8 text \(byte 18: invalid"):
        resolve({"config": str(path)}, env=ENV0)
    path.write_text(json.dumps(["add+:1:-1", "nonsense"]))
    with pytest.raises(ValueError, match=rf"option 'config': malformed rule 'nonsense' in {where}"):
        resolve({"config": str(path)}, env=ENV0)
    path.write_text(json.dumps(["add+:1:-1", 7]))
    with pytest.raises(ValueError, match=rf"option 'config': got 7 in {where}"):
        resolve({"config": str(path)}, env=ENV0)
    path.write_text(json.dumps({"a": 1}))
    with pytest.raises(ValueError, match=rf"environment variable FXMEM_MEMORY_OPT_CONFIG: {where} holds \{{'a': 1\}}"):
        resolve({}, env={"FXMEM_MEMORY_OPT_CONFIG": str(path)})


@pytest.mark.parametrize("name", ["dir.json", "rules"])
def test_config_path_that_is_a_directory_says_so(tmp_path, name):
    """A directory is not reported as missing: the error says it is one and that a file is expected."""
    (tmp_path / name).mkdir()
    where = re.escape(f"option 'config': config file '{tmp_path / name}' is a directory; allowed: a path to a "
                      "file holding a JSON list of 'cluster:strategy:count' strings")
    with pytest.raises(ValueError, match=where):
        resolve({"config": str(tmp_path / name)}, env=ENV0)


def test_report_path_is_a_file_path_and_its_folder_is_created(tmp_path):
    """A path in a missing folder compiles, and the report lands there; a folder is refused."""
    missing = tmp_path / "no" / "such"
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 4))
    compiled = torch.compile(m, backend="fxmem", options={"inner": "eager", "report_path": str(missing / "mem.json")})
    compiled(torch.randn(2, 4)).sum().backward()
    written = list(missing.glob("mem.*.json"))
    assert len(written) == 1 and json.loads(written[0].read_text())
    with pytest.raises(ValueError, match=re.escape(f"option 'report_path': '{tmp_path}' is a directory; allowed: a "
                                                   f"file path in it, e.g. '{tmp_path / 'mem.json'}'")):
        resolve({"report_path": str(tmp_path)}, env=ENV0)
    assert resolve({"report_path": tmp_path / "mem.json"}, env=ENV0).report_path == str(tmp_path / "mem.json")
    assert resolve({"report_path": "mem.json"}, env=ENV0).report_path == "mem.json"  # the working directory


class _Linear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, x):
        return self.lin(x).relu().sum()


@pytest.mark.parametrize("dynamic", [False, True])
def test_plan_shape_names_are_checked_against_the_graphs_dims(dynamic):
    """An unknown name (static or dynamic graph) is an OptionError naming it and listing the
    graph's dims; an input given more sizes than it has dims too; a known name plans there."""
    import fxmem
    from fxmem import OptionError

    dims = re.escape("x.size(0) = ") + (r"s\d+" if dynamic else "8") + re.escape(", x.size(1) = 16")
    for plan_shape, match in [({"x": [64], "nosuch": [2]}, rf"option 'plan_shape': 'nosuch' names no input or "
                                                          rf"dimension of this graph; the graph's dims: {dims}; "),
                              ({"x": [1, 2, 3]}, rf"option 'plan_shape': 'x': got \[1, 2, 3\]; allowed: at most 2 "
                                                 rf"sizes; the graph's dims: {dims}")]:
        torch._dynamo.reset()
        compiled = torch.compile(_Linear(), backend="fxmem", dynamic=dynamic,
                                 options={"inner": "eager", "plan_shape": plan_shape})
        with pytest.raises(OptionError, match=match):
            compiled(torch.randn(8, 16))
    torch._dynamo.reset()
    compiled = torch.compile(_Linear(), backend="fxmem", dynamic=dynamic,
                             options={"inner": "eager", "plan_shape": {"x": [64, 16]}})
    compiled(torch.randn(8, 16)).backward()
    (comp,) = fxmem.compilations(compiled)
    sizes = comp.graphs[0].sizes
    assert {sizes.names[s]: v for s, v in sizes.values.items()} == ({"x.size(0)": 64, "x.size(1)": 16} if dynamic
                                                                    else {})


@pytest.mark.parametrize("options, config", [
    ({}, {}),
    ({"layout_optimization": True}, {"layout_optimization": True}),
    ({"level": 1}, {"layout_optimization": False, "allow_buffer_reuse": False}),
    ({"memory_budget": 0.5}, {"layout_optimization": False, "allow_buffer_reuse": False}),
    ({"level": 2, "layout_optimization": True}, {"layout_optimization": True, "allow_buffer_reuse": False}),
])
def test_inductor_config_trades_speed_for_memory_only_where_memory_comes_first(options, config):
    """Level 0 without budgets keeps Inductor's own choices (the layout where the option sets
    it); a level or budget turns its channels-last copies and its buffer pool off."""
    assert resolve(options).inductor_config() == config


def test_plan_shape_on_a_sequential_takes_its_forward_parameter_name():
    """Dynamo names an nn.Sequential's input args[0]; plan_shape takes that or the forward's own
    parameter name (``input``), and a wrong key's error lists exactly the keys accepted."""
    import fxmem
    from fxmem import OptionError

    def run(plan_shape):
        torch._dynamo.reset()
        model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU())
        compiled = torch.compile(model, backend="fxmem", dynamic=True,
                                 options={"inner": "eager", "plan_shape": plan_shape})
        compiled(torch.randn(8, 16)).sum().backward()
        (comp,) = fxmem.compilations(compiled)
        sizes = comp.graphs[0].sizes
        return {sizes.names[s]: v for s, v in sizes.values.items()}

    assert run({"input": [64, 16]}) == run({"args[0]": [64, 16]}) == {"args[0].size(0)": 64, "args[0].size(1)": 16}
    with pytest.raises(OptionError, match=r"option 'plan_shape': 'inputs' names no input or dimension of this "
                                          r"graph; the graph's dims: args\[0\]\.size\(0\) = (s\d+), "
                                          r"args\[0\]\.size\(1\) = 16; allowed keys: 'input' or 'args\[0\]' "
                                          r"\(at most 2 sizes\), '\1' \(one size\)(\n|$)"):
        run({"inputs": [64, 16]})
    with pytest.raises(OptionError, match=r"'input': got \[1, 2, 3\]; allowed: at most 2 sizes"):
        run({"input": [1, 2, 3]})


def test_200k_rules_parse_fast_and_warn_once():
    """Rules are deduplicated and validated once each (the last of identical rules keeps its
    place); rules that match nothing give one warning in total, naming how many, not one each."""
    import time
    import warnings

    distinct = [f"nosuch{i}+:1:-1" for i in range(100)]
    rules = distinct * 2000  # 200,000 rules, 100 distinct
    started = time.perf_counter()
    o = resolve({"inner": "eager", "config": ",".join(rules)}, env=ENV0)
    assert [str(r) for r in o.config] == distinct
    assert time.perf_counter() - started < 5
    assert [str(r) for r in resolve({"config": ["a+:1:-1", "b+:0:-1", "a+:1:-1"]}, env=ENV0).config] == \
        ["b+:0:-1", "a+:1:-1"]  # the last identical rule's place: a+ comes after b+, as written

    torch._dynamo.reset()
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    compiled = torch.compile(model, backend="fxmem", options={"inner": "eager", "config": rules})
    started = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled(torch.randn(4, 8)).sum().backward()
    ours = [str(w.message) for w in caught if "match no cluster" in str(w.message)]
    assert len(ours) == 1 and ours[0].startswith("fxmem: 100 rules match no cluster of this graph: nosuch0+:1:-1"), ours
    assert time.perf_counter() - started < 60
