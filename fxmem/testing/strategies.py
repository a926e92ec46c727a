"""Hypothesis strategies for fxmem's property tests, public so users can run them on their own
models: random model specs, fxmem option sets, and per-example batches."""
from __future__ import annotations

from hypothesis import strategies as st

from .models import ACTIVATIONS, BLOCKS, NORMS, ModelSpec


@st.composite
def model_specs(draw, max_blocks: int = 3, dropout: bool = True) -> ModelSpec:
    """Stacks of blocks (MLP, SwiGLU, attention, causal conv1d) with LayerNorm/RMSNorm or none,
    GELU/SiLU/ReLU, residuals on or off, tied or untied head, dropout, random widths and depth."""
    heads = draw(st.sampled_from([1, 2]))
    return ModelSpec(
        vocab=draw(st.sampled_from([16, 33])),
        d=heads * draw(st.sampled_from([4, 8])),
        blocks=tuple(draw(st.lists(st.sampled_from(BLOCKS), min_size=1, max_size=max_blocks))),
        norm=draw(st.sampled_from(NORMS)),
        activation=draw(st.sampled_from(ACTIVATIONS)),
        hidden=draw(st.sampled_from([8, 24])),
        heads=heads,
        residual=draw(st.booleans()),
        tied=draw(st.booleans()),
        dropout=draw(st.sampled_from([0.0, 0.0, 0.2])) if dropout else 0.0,
        batch=draw(st.integers(1, 3)),
        seq=draw(st.sampled_from([4, 7])),
    )


def rule_strings(cluster_ids: list[str]):
    """Config rule lists over the given cluster ids plus one that matches nothing."""
    ids = sorted(cluster_ids) + ["nosuch+"]
    return st.lists(st.builds(lambda c, s, n: f"{c}:{s}:{n}", st.sampled_from(ids),
                              st.sampled_from([0, 1, 2]), st.sampled_from([-1, 1, 2])), max_size=3)


@st.composite
def plan_options(draw, budgets: bool = True) -> dict:
    """Recompute-planner options: a level, maybe a budget fraction."""
    opts = {"level": draw(st.sampled_from([0, 1, 2]))}
    if budgets and draw(st.booleans()):
        opts["memory_budget"] = draw(st.sampled_from([0.2, 0.5, 0.8, 1.0]))
    return opts


@st.composite
def options(draw) -> dict:
    """Whole option sets: planner options, lowering on/off, and a microbatch size (used only by
    graphs that have per-example regions)."""
    opts = draw(plan_options())
    opts["lowering"] = draw(st.booleans())
    opts["microbatch_size"] = draw(st.sampled_from([None, 1, 2, 3]))
    return opts
