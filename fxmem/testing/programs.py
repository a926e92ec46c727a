"""Hypothesis strategies over random straight-line programs (x and weights through pointwise ops,
norms, softmax and matmuls): small joint graphs for planner and split properties."""

import torch
import torch.nn.functional as F
from hypothesis import strategies as st

D = 6
UNARY = {"gelu": F.gelu, "tanh": torch.tanh, "sigmoid": torch.sigmoid, "relu": torch.relu,
         "ln": lambda v: F.layer_norm(v, (D,)), "softmax": lambda v: torch.softmax(v, -1),
         "sum_keep": lambda v: v.sum(-1, keepdim=True) * v, "t_t": lambda v: v.t().contiguous().t()}
BINARY = {"add": torch.add, "mul": torch.mul, "linear": lambda v, w: v @ w}


@st.composite
def programs(draw, max_steps=8):
    """A random program over x (B, D) and weights (D, D): ``(n_weights, [(op, a, b), ...])``."""
    n_w = draw(st.integers(1, 3))
    steps = []
    for i in range(draw(st.integers(1, max_steps))):
        n_vals = 1 + i
        if draw(st.booleans()):
            steps.append((draw(st.sampled_from(sorted(UNARY))), draw(st.integers(0, n_vals - 1)), None))
        else:
            op = draw(st.sampled_from(sorted(BINARY)))
            a = draw(st.integers(0, n_vals - 1))
            b = draw(st.integers(0, n_w - 1)) if op == "linear" else draw(st.integers(0, n_vals - 1))
            steps.append((op, a, b))
    return n_w, steps


def run_program(steps, x, ws):
    vals = [x]
    for op, a, b in steps:
        if op in UNARY:
            vals.append(UNARY[op](vals[a]))
        elif op == "linear":
            vals.append(BINARY[op](vals[a], ws[b]))
        else:
            vals.append(BINARY[op](vals[a], vals[b]))
    return (vals[-1] * vals[-1]).mean() + vals[len(vals) // 2].sum() * 1e-3


def program_inputs(n_w, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, D, generator=g, requires_grad=True)
    return [x, *[torch.randn(D, D, generator=g, requires_grad=True) for _ in range(n_w)]]
