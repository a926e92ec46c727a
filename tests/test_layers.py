"""Level 1's layers come from the graph's structure (issue [generality]): repeated blocks, whatever
their names, a block applied several times with shared weights, ``nn.TransformerEncoder``'s
layers, residual conv blocks, stacks of blocks; none where nothing repeats."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxmem
from fxmem.remat.layers import layers


class Block(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Shared(nn.Module):
    """ALBERT-style: one block's weights applied three times."""

    def __init__(self):
        super().__init__()
        self.block, self.head = Block(), nn.Linear(16, 4)

    def forward(self, x):
        for _ in range(3):
            x = self.block(x)
        return self.head(x).square().mean()


class Named(nn.Module):
    """Residual conv blocks under names without numbers, then a head."""

    class Res(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.conv1, self.conv2 = nn.Conv2d(c, c, 3, padding=1), nn.Conv2d(c, c, 3, padding=1)
            self.bn = nn.BatchNorm2d(c)

        def forward(self, x):
            return F.relu(x + self.bn(self.conv2(F.relu(self.conv1(x)))))

    def __init__(self):
        super().__init__()
        self.stem, self.first, self.second, self.head = nn.Conv2d(3, 8, 3), self.Res(8), self.Res(8), nn.Linear(8, 4)

    def forward(self, x):
        return self.head(self.second(self.first(self.stem(x))).mean((2, 3))).square().mean()


class Stacks(nn.Module):
    """Two stacks of the same class (an encoder and a decoder, T5-style), each of two blocks:
    the blocks are the layers, not the stacks."""

    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks, self.norm = nn.ModuleList([Block(), Block()]), nn.LayerNorm(16)

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return self.norm(x)

    def __init__(self):
        super().__init__()
        self.encoder, self.decoder = self.Stack(), self.Stack()

    def forward(self, x):
        return self.decoder(self.encoder(x)).square().mean()


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 3, enable_nested_tensor=False)

    def forward(self, x):
        return self.enc(x).square().mean()


class Recurrent(nn.Module):
    """An ``nn.GRU`` of two stacked layers (one leaf module): AOTAutograd unrolls it over the
    sequence, and each step of each layer is a layer."""

    def __init__(self):
        super().__init__()
        self.rnn, self.head = nn.GRU(16, 16, 2, batch_first=True), nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.rnn(x)[0]).square().mean()


class Flat(nn.Module):
    """Leaf modules only: nothing repeats that is a block."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x):
        return self.b(F.gelu(self.a(x))).square().mean()


def _layer_keys(model: nn.Module, x: torch.Tensor) -> list[str]:
    """The layers of ``model``'s joint graph, in graph order."""
    compiled = torch.compile(model, backend="fxmem", options={"inner": "eager", "level": 1})
    with torch._dynamo.config.patch(allow_rnn=True):  # else Dynamo leaves an RNN to eager
        compiled(x).backward()
    (graph,) = [g for c in fxmem.compilations(compiled) for g in c.graphs]
    key = layers(graph.plan.problem.joint)
    return list(dict.fromkeys(key[n] for n in graph.plan.problem.joint.gm.graph.nodes if n in key))


SEQ = torch.randn(2, 5, 16)


@pytest.mark.parametrize("model, x, expected", [
    (Shared, SEQ, ["block", "block@1", "block@2"]),
    pytest.param(Encoder, SEQ, ["enc.layers.0", "enc.layers.1", "enc.layers.2"], marks=pytest.mark.slow),
    (Named, torch.randn(2, 3, 8, 8), ["first", "second"]),
    pytest.param(Stacks, SEQ, ["encoder.blocks.0", "encoder.blocks.1", "decoder.blocks.0", "decoder.blocks.1"],
                 marks=pytest.mark.slow),
    (Recurrent, torch.randn(2, 3, 16), [f"rnn.step{i}" for i in range(6)]),
    (Flat, SEQ, []),
], ids=["shared-weights", "nn.TransformerEncoder", "residual-blocks", "stacks", "recurrent-steps", "no-blocks"])
def test_layers_are_the_repeated_blocks(model, x, expected):
    torch.manual_seed(0)
    assert _layer_keys(model(), x) == expected


@pytest.mark.slow
def test_level1_on_a_shared_weight_stack_recomputes_each_application():
    """The three applications of one block are three layers: level 1 keeps their boundaries and
    recomputes inside them, so it keeps fewer bytes than level 0 (it used one layer for all three)."""
    torch.manual_seed(0)
    saved = {}
    for level in (0, 1):
        torch._dynamo.reset()
        compiled = torch.compile(Shared(), backend="fxmem", options={"inner": "eager", "level": level})
        compiled(torch.randn(16, 32, 16)).backward()
        (graph,) = [g for c in fxmem.compilations(compiled) for g in c.graphs]
        saved[level] = graph.plan.saved_bytes
        if level:
            assert any("3 layers found" in n for n in graph.plan.notes), graph.plan.notes
    assert saved[1] < saved[0], saved
