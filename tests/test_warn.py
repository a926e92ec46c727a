"""fxmem's warnings name the user's line (the call that compiled), not a line inside fxmem or torch."""

import importlib
import sys
import warnings

import pytest
import torch

from fxmem.warn import MAX_CHARS


def test_a_planner_warning_points_at_the_users_call():
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
    compiled = torch.compile(model, backend="fxmem", options={"inner": "eager", "config": "nosuchcluster+:1:-1"})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = sys._getframe().f_lineno + 1
        compiled(torch.randn(4, 8)).sum().backward()
    ours = [w for w in caught if "nosuchcluster+" in str(w.message)]
    assert ours and all(w.filename == __file__ for w in ours), [(w.filename, w.lineno) for w in caught]
    assert {w.lineno for w in ours} == {line}  # the compiled call


def _chain(x, *ws):
    """Saving nothing recomputes the whole chain at once: 0 bytes is met only at a higher peak."""
    x = x.cos()
    for w in ws:
        x = torch.mm(x, w).cos()
    return x.sum()


def _boom(*args, **kwargs):
    raise RuntimeError("boom: " + "a long reason " * 30)


@pytest.mark.parametrize("options, patch, expect", [
    ({"config": "no+such+cluster+with+a+long+name+" * 4 + ":1:-1"}, None, "matches no cluster"),
    ({"memory_budget": 0}, None, "memory_budget=0 is met only at a higher peak"),
    ({"peak_budget": 1}, None, "peak_budget=1 bytes is below every plan's step peak"),
    ({}, ("fxmem.remat.partition", "plan"), "stage 'plan' failed (RuntimeError: boom: a long"),
])
def test_warnings_are_short_and_point_at_the_users_call(options, patch, expect, monkeypatch):
    """At most MAX_CHARS each (the details are in the report's notes and the fxmem log)."""
    if patch:
        monkeypatch.setattr(importlib.import_module(patch[0]), patch[1], _boom)
    torch.manual_seed(0)
    inputs = [torch.randn(32, 32, requires_grad=True) for _ in range(4)]
    compiled = torch.compile(_chain, backend="fxmem", options={"inner": "eager", **options})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = sys._getframe().f_lineno + 1
        compiled(*inputs).backward()
    ours = [str(w.message) for w in caught if str(w.message).startswith("fxmem")]
    assert any(expect in m for m in ours), ours
    assert all(len(m) <= MAX_CHARS for m in ours), [len(m) for m in ours]
    assert {(w.filename, w.lineno) for w in caught if str(w.message).startswith("fxmem")} == {(__file__, line)}
