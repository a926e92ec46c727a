"""fxmem's warnings name the user's line (the call that compiled), not a line inside fxmem or torch."""

import sys
import warnings

import torch


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
