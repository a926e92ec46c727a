"""``nn.RNN``/``nn.GRU``/``nn.LSTM`` as their cell loops in plain ops, so that ``vmap(grad)``
batches them and Dynamo traces them into one graph (the per-example pass can then chunk it).

``_VF.gru``/``_VF.rnn_tanh`` have no vmap batching rule that keeps the hidden state's batch dim
(``output with shape [1, 6] doesn't match the broadcast shape [6, 1, 6]``) and ``_VF.lstm`` is a
graph break. :class:`LoopRNN` computes the same recurrences (PyTorch's gate order and formulas,
every layer count, both directions, ``batch_first``, biases, inter-layer dropout) with
matmuls and pointwise ops, on the *same* parameters (same names), so

    shadow(model)     a module tree sharing every parameter and buffer of ``model``, with each
                      RNN replaced by its LoopRNN: ``functional_call(shadow(model), params)``
                      with ``model``'s own parameter dict gives the same outputs

is what :func:`make_private` differentiates per example, and :func:`fix` swaps the modules in
(for :func:`clipped_grad` users). Packed sequences and LSTM ``proj_size`` are refused.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["LoopRNN", "shadow"]

_ATTRS = ("mode", "input_size", "hidden_size", "num_layers", "bias", "batch_first", "dropout",
          "bidirectional", "proj_size", "nonlinearity")


class LoopRNN(nn.Module):
    """An ``nn.RNN``/``nn.GRU``/``nn.LSTM`` computed as its cell loop, on ``rnn``'s parameters
    (the same tensors, under the same names)."""

    def __init__(self, rnn: nn.RNNBase):
        super().__init__()
        if getattr(rnn, "proj_size", 0):
            raise ValueError(f"LoopRNN: LSTM proj_size={rnn.proj_size} is not supported (allowed: 0)")
        for a in _ATTRS:
            if hasattr(rnn, a):
                setattr(self, a, getattr(rnn, a))
        self._parameters = dict(rnn._parameters)
        self.training = rnn.training

    def extra_repr(self) -> str:
        return f"{self.mode}, {self.input_size}, {self.hidden_size}, num_layers={self.num_layers}, " \
               f"bidirectional={self.bidirectional}, batch_first={self.batch_first}"

    def _cell(self, x_proj: torch.Tensor, h, w_hh: torch.Tensor, b_hh):
        """One step: ``x_proj`` = x W_ih^T + b_ih (precomputed for the whole sequence)."""
        hh = h[0] if self.mode == "LSTM" else h
        h_proj = hh @ w_hh.t()
        if b_hh is not None:
            h_proj = h_proj + b_hh
        if self.mode == "LSTM":
            i, f, g, o = (x_proj + h_proj).chunk(4, -1)
            c = torch.sigmoid(f) * h[1] + torch.sigmoid(i) * torch.tanh(g)
            return torch.sigmoid(o) * torch.tanh(c), c
        if self.mode == "GRU":
            xr, xz, xn = x_proj.chunk(3, -1)
            hr, hz, hn = h_proj.chunk(3, -1)
            r, z = torch.sigmoid(xr + hr), torch.sigmoid(xz + hz)
            n = torch.tanh(xn + r * hn)
            return (1 - z) * n + z * h
        pre = x_proj + h_proj
        return torch.tanh(pre) if self.mode == "RNN_TANH" else torch.relu(pre)

    def forward(self, x: torch.Tensor, hx=None):
        if isinstance(x, nn.utils.rnn.PackedSequence):
            raise ValueError("LoopRNN: packed sequences are not supported (pass padded tensors)")
        batched = x.dim() == 3
        if not batched:
            x = x.unsqueeze(1)
        elif self.batch_first:
            x = x.transpose(0, 1)
        seq, batch = x.shape[0], x.shape[1]
        dirs = 2 if self.bidirectional else 1
        lstm = self.mode == "LSTM"
        if hx is None:
            zeros = x.new_zeros(self.num_layers * dirs, batch, self.hidden_size)
            hx = (zeros, zeros) if lstm else zeros
        elif not batched:
            hx = tuple(h.unsqueeze(1) for h in hx) if lstm else hx.unsqueeze(1)
        h_n, c_n = [], []
        layer_in = x
        for layer in range(self.num_layers):
            outs = []
            for d in range(dirs):
                sfx = f"_l{layer}" + ("_reverse" if d else "")
                p = self._parameters
                x_proj = layer_in @ p["weight_ih" + sfx].t()
                if self.bias:
                    x_proj = x_proj + p["bias_ih" + sfx]
                k = layer * dirs + d
                h = (hx[0][k], hx[1][k]) if lstm else hx[k]
                steps = range(seq - 1, -1, -1) if d else range(seq)
                ys = [None] * seq
                for t in steps:
                    h = self._cell(x_proj[t], h, p["weight_hh" + sfx], p["bias_hh" + sfx] if self.bias else None)
                    ys[t] = h[0] if lstm else h
                outs.append(torch.stack(ys))
                h_n.append(h[0] if lstm else h)
                if lstm:
                    c_n.append(h[1])
            layer_in = outs[0] if dirs == 1 else torch.cat(outs, -1)
            if self.dropout and self.training and layer < self.num_layers - 1:
                layer_in = F.dropout(layer_in, self.dropout, True)
        out, hn = layer_in, torch.stack(h_n)
        state = (hn, torch.stack(c_n)) if lstm else hn
        if not batched:
            out = out.squeeze(1)
            state = tuple(s.squeeze(1) for s in state) if lstm else state.squeeze(1)
        elif self.batch_first:
            out = out.transpose(0, 1)
        return out, state


def shadow(module: nn.Module) -> nn.Module:
    """``module``'s tree with every ``nn.RNN``/``nn.GRU``/``nn.LSTM`` replaced by its
    :class:`LoopRNN`; every parameter and buffer is shared (not copied), and the names are the
    same. ``module`` itself is not changed."""
    if isinstance(module, nn.RNNBase) and type(module) in (nn.RNN, nn.GRU, nn.LSTM):
        return LoopRNN(module)
    if not any(type(m) in (nn.RNN, nn.GRU, nn.LSTM) for m in module.modules()):
        return module
    new = copy.copy(module)
    new._parameters = dict(module._parameters)
    new._buffers = dict(module._buffers)
    new._modules = {name: shadow(child) if child is not None else None for name, child in module._modules.items()}
    return new
