"""Data-dependent sizes (issue #56): with ``capture_scalar_outputs`` / ``capture_dynamic_output_shape_ops``
Dynamo keeps ``.item()``, ``nonzero`` and boolean-mask indexing in the graph, their sizes unbacked
symbols (``u0``) without a hint. fxmem plans such graphs (no fallback), each unbacked symbol at a
value it names in the report: the one seen at run time, else its range's upper bound, else a default."""

from __future__ import annotations

import copy
import warnings

import pytest
import sympy
import torch
from torch import nn

import fxmem
from fxmem.graph.sizes import unbacked_value

CAPTURE = dict(capture_scalar_outputs=True, capture_dynamic_output_shape_ops=True)


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.gelu(self.up(x))
        return x + self.down(h).tanh()


class Selective(nn.Module):
    """Repeated blocks over the rows a mask selects (``x[mask]``: a ``nonzero``-sized tensor) and
    over the first ``k`` rows, ``k`` read with ``.item()``."""

    def __init__(self, d: int = 16, layers: int = 3):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.head = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = x[:, 0] > 0
        rows = x[mask]  # nonzero: an unbacked row count
        k = (x[:, 1] > 0).sum().item()
        torch._check(k >= 0)
        torch._check(k <= x.shape[0])
        first = x.narrow(0, 0, k)  # .item(): an unbacked row count
        loss = x.new_zeros(())
        for h in (rows, first, x):
            for block in self.blocks:
                h = block(h)
            loss = loss + self.head(h).square().sum()
        return loss


def _step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    loss = model(x)
    loss.backward()
    return loss.detach()


def _compiled(options: dict, x: torch.Tensor):
    torch.manual_seed(0)
    model = Selective()
    ref = copy.deepcopy(model)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fxmem", options={"inner": "eager", **options})
    with torch._dynamo.config.patch(**CAPTURE), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss = _step(compiled, x)
    return model, ref, compiled, loss, [str(w.message) for w in caught if "fxmem" in str(w.message)]


@pytest.fixture
def batch() -> torch.Tensor:
    return torch.randn(12, 16, generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("level", [0, 1])
def test_a_data_dependent_graph_is_planned_without_fallback_and_equals_eager(batch, level):
    model, ref, compiled, loss, fxmem_warnings = _compiled({"level": level, "strict": True}, batch)
    assert not [w for w in fxmem_warnings if "falling back" in w], fxmem_warnings
    rep = fxmem.report(compiled)
    assert len(rep.graphs) == 1  # the graph holds the data-dependent ops: no graph break
    g = rep.graphs[0]
    assert any(s.startswith("u") for s in g.values), g.values  # planned with its unbacked symbols
    assert torch.equal(loss, _step(ref, batch))
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad), name
    assert str(rep)  # the report renders (it read every symbol's value)


def test_level_1_plans_a_peak_at_most_level_0s(batch):
    peaks = {}
    for level in (0, 1):
        _, _, compiled, _, _ = _compiled({"level": level}, batch)
        peaks[level] = fxmem.report(compiled).predict_peak()
    assert 0 < peaks[1] <= peaks[0], peaks


def test_the_report_names_the_value_each_data_dependent_size_was_planned_at(batch):
    _, _, compiled, _, _ = _compiled({"level": 1}, batch)
    notes = [n for n in fxmem.report(compiled).graphs[0].notes if n.startswith("data-dependent size")]
    # x[mask]'s rows: at most the batch's 12 (nonzero's range); narrow's k: at most x.shape[0]
    assert any("planned at 12 (upper bound)" in n for n in notes), notes


def test_an_unbacked_symbol_without_a_bound_takes_the_default_within_its_range():
    from torch._inductor import config as inductor_config
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    env = ShapeEnv()
    free = env.create_unbacked_symint().node.expr
    assert unbacked_value(env, free) == (inductor_config.unbacked_symint_fallback, "default")
    bounded = env.create_unbacked_symint()
    torch._check(bounded <= 40)
    torch._check(bounded >= 0)
    assert unbacked_value(env, bounded.node.expr) == (40, "upper bound")
    high = env.create_unbacked_symint()
    torch._check(high >= 10 ** 6)
    assert unbacked_value(env, high.node.expr) == (10 ** 6, "default")
    seen = env.create_unbacked_symint().node.expr
    env.set_real_tensor_prop_unbacked_vals(seen, 7)
    assert unbacked_value(env, seen) == (7, "seen")
    assert isinstance(free, sympy.Symbol)


def test_the_min_cut_survives_networkx_preflow_push_indexing_past_its_levels(batch, monkeypatch):
    """networkx's preflow-push raised IndexError on a data-dependent graph under some node orders
    (its ``_assert_scalar`` nodes reach no source edge): the cut is taken with Edmonds-Karp then,
    the same cut."""
    import fxmem.remat.mincut as mincut

    _, _, compiled, _, _ = _compiled({"level": 1, "strict": True}, batch)
    want = fxmem.report(compiled).graphs[0]

    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise IndexError("list index out of range")

    monkeypatch.setattr(mincut, "preflow_push", broken)
    _, _, compiled, _, fxmem_warnings = _compiled({"level": 1, "strict": True}, batch)
    got = fxmem.report(compiled).graphs[0]
    assert calls and not fxmem_warnings
    assert (got.saved_bytes, got.saved_expr, got.predict_peak()) == (want.saved_bytes, want.saved_expr,
                                                                      want.predict_peak())


def test_with_real_tensor_propagation_the_plan_takes_the_sizes_seen(batch):
    with torch._functorch.config.patch(fake_tensor_propagate_real_tensors=True):
        _, _, compiled, _, fxmem_warnings = _compiled({"level": 1, "strict": True}, batch)
    notes = [n for n in fxmem.report(compiled).graphs[0].notes if n.startswith("data-dependent size")]
    rows, k = int((batch[:, 0] > 0).sum()), int((batch[:, 1] > 0).sum())
    assert {f"planned at {rows} (seen)", f"planned at {k} (seen)"} <= {n.split(" ", 3)[3] for n in notes}, notes


class RolledByItem(nn.Module):
    """A value rolled by a shift read with ``int()`` (Autoformer's time-delay aggregation): the
    backward that recomputes the roll takes the shift as a SymInt expression (``-u0``)."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.value, self.out = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor, delay: torch.Tensor) -> torch.Tensor:
        v = self.value(x)
        return self.out(v.roll(shifts=-int(delay[0]), dims=1) * v.sigmoid()).square().mean()


@pytest.mark.inductor
def test_inductor_binds_an_unbacked_symbol_handed_over_as_an_expression():
    """Inductor binds ``u0`` in the backward only from an input that is ``u0`` itself: the split
    hands over the SymInt that made it beside ``-u0`` (``split.handoff``; it failed with
    ``NameError: name 'u0' is not defined`` in the backward's code)."""
    torch.manual_seed(0)
    model, x, delay = RolledByItem(), torch.randn(2, 12, 8), torch.tensor([5])
    ref = copy.deepcopy(model)
    ref(x, delay).backward()
    torch._dynamo.reset()
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        compiled = torch.compile(model, backend="fxmem", options={"inner": "inductor", "level": 1})
        compiled(x, delay).backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
