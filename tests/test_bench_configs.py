"""bench/configs.py: budget configurations at any fraction, and clear errors."""

import pytest

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
