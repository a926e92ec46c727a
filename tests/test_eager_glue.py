"""Eager code between the graphs of a step (issue #56 [whole-step]): the time-series transformers'
pattern, a layer loop with LayerDrop (``if torch.rand([]) < p: skip the layer``), which Dynamo
cannot resume inside, so it runs the model's ``forward`` eagerly and compiles each layer on its
own. What the eager code saves for its backward (a layer norm's input and statistics, a dropout
mask) is alive from the forward to its backward, beside the graphs' saved values:
``predict_peak`` counts it (found from the graphs' inputs, through eager autograd's nodes).

And the parameter gradients eager backward code makes (an eager embedding's dense table
gradient); and transformers' ``deprecate_kwarg`` wrapper, one code object for every decorated
``forward``: fxmem has Dynamo skip the wrapper's own frame (the method it calls is compiled), so
that more than ``recompile_limit`` decorated methods do not send the step to eager; another
shared wrapper is named in the warning.
"""
import types
import warnings

import pytest
import sympy
import torch
import torch.nn.functional as F
from torch import nn

import fxmem
from fxmem.profiling import step_perf

B, S, D = 8, 64, 32


class Layer(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.up, self.down = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(x)))


class LayerDropModel(nn.Module):
    """HF's encoder shape: an embedding, a layer norm and dropout in the stack's ``forward`` (eager:
    Dynamo skips the frame), LayerDrop in the layer loop, each layer a graph of its own."""

    def __init__(self, d=D, layers=3, layerdrop=0.1):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.layers = nn.ModuleList(Layer(d) for _ in range(layers))
        self.head = nn.Linear(d, 1)
        self.layerdrop = layerdrop

    def forward(self, x):
        h = F.dropout(self.norm(x * 2.0), p=0.1, training=self.training)
        for layer in self.layers:
            if self.training and torch.rand([]) < self.layerdrop:  # LayerDrop: a graph break in the loop
                continue
            h = layer(h)
        return self.head(h).square().mean()


def _step(model: nn.Module, x: torch.Tensor, options: dict, autocast: bool = False):
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fxmem", options={"inner": "eager", **options})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            model.zero_grad(set_to_none=True)
            torch.manual_seed(1)  # the same layers dropped every step
            with step_perf("cpu") as perf, torch.autocast("cpu", torch.bfloat16, enabled=autocast):
                compiled(x).backward()
    assert not [w for w in caught if "falling back" in str(w.message)]
    return perf.result.peak_bytes, fxmem.report(compiled)


def _eager_saved_bytes(rep) -> int:
    """Bytes the report holds as made by eager code (taken by a graph run, or saved for eager's
    backward on the way to it): the entries ``[-2 - input position, bytes, ...]`` of each run."""
    return sum(e[1] for run in rep.step_outputs for e in run if len(e) == 4)


@pytest.mark.parametrize("level", [0, 1])
def test_layerdrop_loop_step_predicted_within_5_percent(level):
    torch.manual_seed(0)
    model = LayerDropModel()
    x = torch.randn(B, S, D)
    peak, rep = _step(model, x, {"level": level})
    assert len(rep.step_graphs()) >= 2  # the loop ran eagerly, a graph a layer
    predicted = rep.predict_peak()
    assert abs(predicted / peak - 1) <= 0.05, (predicted, peak)


def test_eager_saved_values_counted_once_with_their_sizes():
    """What the eager prologue keeps for its backward, counted once (the first layer's run takes
    its output; later runs walk no node twice): the dropout's output (the first graph's input),
    the dropout mask (float, as CPU dropout saves it), the layer norm's input (``x * 2``), its
    mean and reciprocal deviation (one float per row)."""
    torch.manual_seed(0)
    model = LayerDropModel(layerdrop=0.0)  # no layer dropped: still the loop's break
    x = torch.randn(B, S, D)
    _, rep = _step(model, x, {"level": 1})
    act = B * S * D * 4
    assert _eager_saved_bytes(rep) == 3 * act + 2 * B * S * 4


def test_batch_tensor_saved_by_eager_code_is_not_counted():
    """A tensor the caller holds (alive before the step) that eager code saves for its backward
    (``norm(x) * mask``: the mask) is not the step's memory; the product is the layer's input."""

    class Masked(LayerDropModel):
        def forward(self, x, mask):
            h = self.norm(x) * mask
            for layer in self.layers:
                if self.training and torch.rand([]) < self.layerdrop:
                    continue
                h = layer(h)
            return self.head(h).square().mean()

    torch.manual_seed(0)
    model = Masked(layerdrop=0.0)
    x, mask = torch.randn(B, S, D), torch.ones(B, S, D)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fxmem", options={"inner": "eager", "level": 1})
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        compiled(x, mask).backward()
    act = B * S * D * 4
    # the product (the layer's input) and the norm's mean and reciprocal deviation; not the mask
    # (the product saves it: the caller's), nor x (the norm's saved input: the caller's), nor the
    # norm's output (the product does not save it: the mask needs no gradient)
    assert _eager_saved_bytes(fxmem.report(compiled)) == act + 2 * B * S * 4


def _block(name: str, forward) -> nn.Module:
    """A module of its own class ``name`` whose ``forward`` is ``forward``, with one linear layer."""
    cls = types.new_class(name, (nn.Module,))
    cls.forward = forward
    block = cls()
    nn.Module.__init__(block)
    block.lin = nn.Linear(D, D)
    return block


class DelayAggregation(nn.Module):
    """Autoformer's time-delay aggregation (training branch): the values rolled by each of the
    top-k delays, weighted by the delays' softmax scores, summed. ``data_dependent``: the delays
    are read from a tensor (``int(index[i])``: a graph break unless Dynamo captures scalars)."""

    def __init__(self, d=D, k=4, data_dependent=False):
        super().__init__()
        self.value, self.score, self.k, self.data_dependent = nn.Linear(d, d), nn.Linear(d, 1), k, data_dependent

    def forward(self, x):
        v = self.value(x)
        scores = torch.softmax(self.score(x).mean(1).squeeze(-1)[: self.k], 0)  # k weights
        delays = torch.arange(1, self.k + 1) * 3
        agg = torch.zeros_like(v)
        for i in range(self.k):
            shift = int(delays[i]) if self.data_dependent else 3 * (i + 1)
            agg = agg + v.roll(shifts=-shift, dims=1) * scores[i]
        return agg.square().mean()


@pytest.mark.parametrize("data_dependent", [False, True])
def test_rolled_values_are_recomputed_not_kept(data_dependent):
    """``roll`` is a copy fxmem may recompute (as ``cat`` or ``gather``): the graph keeps the
    values once, not each of the k rolled copies that the products save; the step equals eager's."""
    import copy

    torch.manual_seed(0)
    model = DelayAggregation(data_dependent=data_dependent)
    ref = copy.deepcopy(model)
    x = torch.randn(B, S, D)
    ref(x).backward()
    torch._dynamo.reset()
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        compiled = torch.compile(model, backend="fxmem", options={"inner": "eager", "level": 0})
        compiled(x).backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    rep = fxmem.report(compiled)
    (graph,) = rep.step_graphs()
    kept = int(sympy.sympify(graph.crossing["kept"]).subs(graph.values))
    act = B * S * D * 4
    assert kept < 2 * act, kept  # v (or x) once and the scores; the k rolled copies would be 4 * act


def test_recompile_limit_on_a_shared_wrapper_names_the_wrapper():
    """A decorator of fxmem's user (not transformers') wraps more functions than the recompile
    limit: the warning names the wrapper's code and the limit to raise, not ``dynamic=True``."""
    import functools

    from fxmem.recompiles import RecompileLimitWarning

    def logged(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            return fn(*args, **kwargs)
        return wrapper

    blocks = []
    for k in range(4):
        def forward(self, x):
            return self.lin(x).relu() + x
        forward.__code__ = forward.__code__.replace(co_name=f"forward_{k}")
        blocks.append(_block(f"Logged{k}", logged(forward)))
    stack = nn.ModuleList(blocks)

    def run(x):
        for block in stack:
            if torch.rand([]) < 0.0:
                continue
            x = block(x)
        return x.square().mean()

    torch._dynamo.reset()
    compiled = torch.compile(run, backend="fxmem", options={"inner": "eager"})
    with warnings.catch_warnings(record=True) as caught, torch._dynamo.config.patch(recompile_limit=2):
        warnings.simplefilter("always")
        compiled(torch.randn(4, D)).backward()
    ours = [str(w.message) for w in caught if issubclass(w.category, RecompileLimitWarning)]
    assert len(ours) == 1, ours
    assert "'wrapper'" in ours[0] and "shared by several functions" in ours[0] and "dynamic=True" not in ours[0]


@torch._dynamo.disable
def _embed(table: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
    return table(ids)  # eager: Dynamo runs this between two graphs


class EagerEmbedding(nn.Module):
    """A token embedding looked up by eager code (a function Dynamo does not trace), the layers and
    the head in graphs: ``tied``, the head shares the embedding's table (T5's, SwitchTransformers');
    ``twice``, a second eager lookup of the same table (an encoder's and a decoder's)."""

    def __init__(self, vocab=4096, d=D, tied=True, twice=False):
        super().__init__()
        self.emb, self.twice = nn.Embedding(vocab, d), twice
        self.layers = nn.ModuleList(Layer(d) for _ in range(2))
        self.head = nn.Linear(d, vocab, bias=False)
        if tied:
            self.head.weight = self.emb.weight

    def forward(self, ids):
        h = _embed(self.emb, ids)
        for layer in self.layers:
            h = layer(h)
        if self.twice:
            h = h + _embed(self.emb, ids.flip(1))
        return F.cross_entropy(self.head(h).flatten(0, 1), ids.flatten())


@pytest.mark.parametrize("tied, twice, kinds, options", [
    (True, False, [1], {}),
    (False, False, [0], {}),
    (True, True, [1, 2], {}),
    (True, False, [2], {"autocast": True}),  # the head's gradient: the cast's own tensor, summed in place
    pytest.param(True, True, [2, 2], {"inner": "inductor"}, marks=pytest.mark.inductor),  # a buffer of its own
])
def test_eager_parameter_gradients_are_in_the_step(tied, twice, kinds, options):
    """An eager embedding's backward makes a dense [vocab, dim] gradient: held from then on
    (untied), or added to the gradient the head's graph made (tied): out of place where that is
    a view of another tensor (the eager inner compiler's ``mm(...).t()`` in fp32: both and the sum
    alive, the step's peak), in place where it is a tensor of its own (under bf16 autocast the
    cast's gradient; Inductor's buffer), as are later ones. ``predict_peak`` counts them (it
    missed 2 tables of 512 KiB when tied)."""
    from fxmem.report.memory import EagerGrad

    torch.manual_seed(0)
    model = EagerEmbedding(tied=tied, twice=twice)
    ids = torch.randint(0, 4096, (2, 4))
    options = dict(options)
    autocast = options.pop("autocast", False)
    peak, rep = _step(model, ids, {"level": 1, **options}, autocast=autocast)
    table = 4096 * D * 4
    rows = [how for run in rep.step_eager_grads for b, how in run if b == table]
    assert sorted(rows) == sorted(EagerGrad(k) for k in kinds), rep.step_eager_grads
    predicted = rep.predict_peak()
    assert abs(predicted / peak - 1) <= 0.05, (predicted, peak)


def _decorated_forward(k: int):
    """A distinct ``forward`` (its own code object, as every model class has) decorated with
    transformers' ``deprecate_kwarg``: every decoration shares the wrapper's one code object."""
    from transformers.utils.deprecation import deprecate_kwarg

    def forward(self, x):
        return self.lin(x).relu() + x

    forward.__code__ = forward.__code__.replace(co_name=f"forward_{k}")
    return deprecate_kwarg("past_key_values", "99.0", new_name="cache")(forward)


def test_shared_decorator_wrapper_does_not_reach_the_recompile_limit():
    pytest.importorskip("transformers")
    from fxmem.recompiles import RecompileLimitWarning

    n = 12  # more decorated methods than Dynamo's recompile_limit (8)
    blocks = []
    for k in range(n):
        cls = types.new_class(f"Block{k}", (nn.Module,))
        cls.forward = _decorated_forward(k)
        block = cls()
        nn.Module.__init__(block)
        block.lin = nn.Linear(D, D)
        blocks.append(block)

    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(blocks)

        def forward(self, x):
            for block in self.blocks:
                if torch.rand([]) < 0.0:  # a break in the loop: the blocks are the frames Dynamo starts at
                    continue
                x = block(x)
            return x.square().mean()

    model = Stack()
    x = torch.randn(4, D)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fxmem", options={"inner": "eager"})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled(x).backward()
    assert not [w for w in caught if issubclass(w.category, RecompileLimitWarning)]
    assert len(fxmem.report(compiled).step_graphs()) == n  # every block compiled, none left to eager
