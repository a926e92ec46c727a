"""make_private under torch.distributed, 2 gloo ranks on CPU: each rank Poisson-samples its shard,
the clipped sums are all-reduced, so both ranks' ``.grad`` = the clipped sum over the union of
their batches / the global expected batch size (against a float64 loop); the noise is rank 0's
draw on both ranks, so their parameters stay equal after ``step()``; epsilon is reported."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from helpers import free_port, gloo_group
from test_dpsgd_private import EAGER, C, _data, _model, clipped_mean_f64
from torch.utils.data import DataLoader, TensorDataset

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.slow,
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo"),
]
WORLD = 2


def _rank(rank: int, port: int, outdir: str) -> None:
    from fxmem.dpsgd import make_private

    with gloo_group(rank, port, WORLD):
        model = _model()
        x, y = _data()
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        loader = DataLoader(TensorDataset(x, y), batch_size=4)
        pm, popt, pl = make_private(module=model, optimizer=opt, data_loader=loader,
                                    noise_multiplier=1.0, max_grad_norm=C, microbatch_size=3, options=EAGER,
                                    noise_generator=torch.Generator().manual_seed(100 + rank))  # ranks differ
        torch.manual_seed(rank)
        xb, yb = next(iter(pl))
        start = {k: v.clone() for k, v in model.state_dict().items()}
        F.cross_entropy(pm(xb), yb).backward()
        grads = {k: p.grad.clone() for k, p in model.named_parameters()}
        popt.step()
        torch.save({"x": xb, "y": yb, "start": start, "grads": grads, "expected": pm.expected_batch_size,
                    "params": {k: p.detach().clone() for k, p in model.named_parameters()},
                    "epsilon": popt.epsilon(1e-5), "shard": len(pl.dataset)},
                   os.path.join(outdir, f"{rank}.pt"))


def test_make_private_on_two_gloo_ranks(tmp_path):
    os.environ.update(GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    mp.spawn(_rank, args=(free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    r0, r1 = (torch.load(tmp_path / f"{r}.pt", weights_only=False) for r in range(WORLD))
    # Opacus' rule on each rank's loader: sample rate 1 / len(shard loader) = 1/3 (10 examples in
    # batches of 4), global expected batch int(20 * 1/3) = 6
    assert r0["expected"] == r1["expected"] == 6 and r0["shard"] == r1["shard"] == 10
    x, y = torch.cat([r0["x"], r1["x"]]), torch.cat([r0["y"], r1["y"]])
    model = _model()
    model.load_state_dict(r0["start"])
    want = clipped_mean_f64(model, x, y, expected=6)
    for r in (r0, r1):
        for k, w in want.items():
            assert (r["grads"][k].double() - w).abs().max() <= 1e-4, k
    for k in want:  # one noise draw (rank 0's) applied on both ranks; and there was noise
        torch.testing.assert_close(r0["params"][k], r1["params"][k], rtol=0, atol=0)
        assert not torch.allclose(r0["params"][k], r0["start"][k] - r0["grads"][k])
    assert 0 < r0["epsilon"] == r1["epsilon"] < float("inf")
