"""A step that graph breaks split into several graphs is predicted as a whole
(``MemoryReport.predict_peak``: each graph's kept values alive until its backward, the
parameter gradients of the later graphs' backwards beside the earlier ones'), not graph by graph."""
import copy

import pytest
import torch
from torch import nn

import fxmem
from fxmem.profiling import step_perf


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Broken(nn.Module):
    """Four blocks with a graph break after each: Dynamo runs ``forward`` eagerly (a break in
    a loop) and compiles the functions it calls: the embedding, the block's ``forward`` (one
    graph that runs four times a step), the head and the loss."""

    def __init__(self, d=64, vocab=256, layers=4):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.head = nn.Linear(d, vocab)

    def tokens(self, ids):
        return self.embed(ids)

    def loss(self, x, ids):
        return nn.functional.cross_entropy(self.head(x).flatten(0, 1), ids.flatten())

    def forward(self, ids):
        x = self.tokens(ids)
        for b in self.blocks:
            x = b(x)
            torch._dynamo.graph_break()
        return self.loss(x, ids)


def _measured_and_predicted(options):
    torch.manual_seed(0)
    model = Broken()
    ids = torch.randint(0, 256, (8, 32))
    compiled = torch.compile(model, backend="fxmem", options={"inner": "eager", **options})
    for _ in range(3):
        model.zero_grad(set_to_none=True)
        with step_perf("cpu") as perf:
            compiled(ids).backward()
    return perf.result.peak_bytes, fxmem.report(compiled)


@pytest.mark.parametrize("options", [{"level": 0}, {"level": 1}, {"memory_budget": 0.0}])
def test_a_graph_broken_step_is_predicted_as_a_whole(options):
    torch._dynamo.reset()
    measured, rep = _measured_and_predicted(options)
    assert len(rep.step) == 6 and len(set(rep.step)) == 3  # the block's graph once per call
    whole = rep.predict_peak()
    one_graph = max(g.predict_peak() for g in rep.graphs)
    assert abs(whole / measured - 1) <= 0.05, (whole, measured)
    assert one_graph < 0.8 * measured  # what the graph-by-graph prediction missed
    again = fxmem.MemoryReport.from_json(rep.to_json())
    assert again.step == rep.step and again.predict_peak() == whole


def test_max_batch_uses_the_whole_step():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Broken()
    compiled = torch.compile(model, backend="fxmem", dynamic=True, options={"inner": "eager"})
    compiled(torch.randint(0, 256, (8, 32))).backward()
    rep = fxmem.report(compiled)
    resident = rep.resident_bytes()
    cap = resident + rep.predict_peak()  # exactly the step at batch 8
    assert rep.max_batch(cap, seq=32) == 8
    last = copy.copy(rep)
    last.step = []  # the latest graph alone (a report from before steps were recorded)
    assert last.max_batch(cap, seq=32) > 8
