"""fxmem.dpsgd's private training loop: Poisson sampling, DPSGD.step against a hand-written step
with the same noise, epsilon against opacus' accountant called directly, train() logging."""

import math

import pytest
import torch
from torch.func import grad
from torch.utils.data import DataLoader, TensorDataset

from fxmem.dpsgd import DPSGD, PoissonSampler, StepLog, poisson_loader, train

EAGER = {"inner": "eager"}


def _linear_task(n=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(4, 3, generator=g)
    x = torch.randn(n, 4, generator=g)
    return x, x @ w + 0.01 * torch.randn(n, 3, generator=g)


def _loss(p, x, y):  # ONE example
    return ((x @ p["w"] + p["b"] - y) ** 2).sum()


def _params():
    return {"w": torch.zeros(4, 3), "b": torch.zeros(3)}


def _hand_step(params, x, y, C, sigma, E, lr, generator):
    """The DP-SGD step written out: per-example grads one by one, clip, sum, noise, SGD."""
    total = {k: torch.zeros_like(v) for k, v in params.items()}
    for i in range(x.shape[0]):
        g = grad(_loss)(params, x[i], y[i])
        norm = math.sqrt(sum((v.double() ** 2).sum().item() for v in g.values()))
        for k in total:
            total[k] += g[k] * min(1.0, C / norm)
    return {k: v - lr * (total[k] + sigma * C * torch.randn(v.shape, generator=generator)) / E
            for k, v in params.items()}


# --- Poisson sampling -------------------------------------------------------------------------


def test_poisson_sampler_draws_each_example_with_the_sample_rate():
    s = PoissonSampler(1000, 0.05, steps=200, generator=torch.Generator().manual_seed(0))
    batches = list(s)
    sizes = torch.tensor([len(b) for b in batches], dtype=torch.float64)
    assert len(batches) == len(s) == 200
    assert abs(sizes.mean().item() - 50) < 2.5 and abs(sizes.var().item() - 47.5) < 15  # binomial
    assert all(b == sorted(set(b)) and all(0 <= i < 1000 for i in b) for b in batches)
    assert len(PoissonSampler(100, 0.04)) == 25  # one epoch in expectation by default


def test_poisson_loader_collates_empty_batches_and_adapts_a_users_loader():
    x, y = torch.randn(10, 3), torch.arange(10)
    data = TensorDataset(x, y)
    loader = poisson_loader(data, 1, steps=50, generator=torch.Generator().manual_seed(3))
    batches = list(loader)
    assert len(batches) == 50 and any(len(b[1]) == 0 for b in batches)  # q = 0.1: empty steps occur
    empty = next(b for b in batches if len(b[1]) == 0)
    assert empty[0].shape == (0, 3) and empty[1].dtype == y.dtype
    full = next(b for b in batches if len(b[1]))
    assert torch.equal(full[0], x[full[1]])

    def collate(items):
        return {"x": torch.stack([i[0] for i in items]), "y": torch.stack([i[1] for i in items])}

    users = DataLoader(data, batch_size=4, collate_fn=collate)
    adapted = poisson_loader(users, steps=5)
    assert adapted.batch_sampler.sample_rate == 0.4 and adapted.dataset is data
    assert all(set(b) == {"x", "y"} for b in adapted)


@pytest.mark.parametrize("kwargs, message", [
    (dict(data=TensorDataset(torch.zeros(4, 1))), "expected_batch_size is needed"),
    (dict(data=TensorDataset(torch.zeros(4, 1)), expected_batch_size=5),
     r"expected_batch_size must be an int in \[1, 4\]"),
    (dict(data=TensorDataset(torch.zeros(4, 1)), expected_batch_size=2, steps=-1), "steps must be an int >= 0"),
])
def test_poisson_loader_bad_arguments_raise_naming_them(kwargs, message):
    with pytest.raises(ValueError, match=message):
        poisson_loader(kwargs.pop("data"), **kwargs)


def test_dpsgd_bad_arguments_raise_naming_them():
    p = _params()
    opt = torch.optim.SGD(p.values(), lr=0.1)
    common = dict(clipping_norm=1.0, noise_multiplier=1.0)
    with pytest.raises(ValueError, match="expected_batch_size 8 is larger than dataset_size 4"):
        DPSGD(_loss, p, opt, expected_batch_size=8, dataset_size=4, **common)
    with pytest.raises(ValueError, match="optimizer must be a torch.optim.Optimizer"):
        DPSGD(_loss, p, "sgd", expected_batch_size=2, dataset_size=4, **common)
    with pytest.raises(ValueError, match="noise_multiplier must be a finite number >= 0"):
        DPSGD(_loss, p, opt, expected_batch_size=2, dataset_size=4, clipping_norm=1.0, noise_multiplier=-1)
    with pytest.raises(ValueError, match=r"delta must be a number in \(0.0, 1.0\)"):
        DPSGD(_loss, p, opt, expected_batch_size=2, dataset_size=4, delta=2.0, **common)
    with pytest.raises(ValueError, match="log_every must be a positive int"):
        train(DPSGD(_loss, p, opt, expected_batch_size=2, dataset_size=4, **common), [], log_every=0)


# --- the step and the loop ----------------------------------------------------------------------


def test_step_equals_the_hand_written_step_and_epsilon_the_accountants():
    from opacus.accountants import RDPAccountant

    x, y = _linear_task()
    C, sigma, E, lr, N = 0.5, 0.7, 8, 0.1, 64
    params = _params()
    dp = DPSGD(_loss, params, torch.optim.SGD(params.values(), lr=lr), clipping_norm=C, noise_multiplier=sigma,
               expected_batch_size=E, dataset_size=N, microbatch_size=3,
               generator=torch.Generator().manual_seed(7), options=EAGER)
    ref = {k: v.clone() for k, v in params.items()}
    ref_gen = torch.Generator().manual_seed(7)
    for b in (7, 0, 10):  # a padded chunk, an empty step, another size: no recompile
        rec = dp.step(x[:b], y[:b])
        ref = _hand_step(ref, x[:b], y[:b], C, sigma, E, lr, ref_gen)
        for k in params:
            torch.testing.assert_close(params[k], ref[k], rtol=1e-5, atol=1e-6)
        assert rec.batch_size == b and (math.isnan(rec.loss) if b == 0 else rec.loss > 0)
    assert dp.steps == 3 and len(dp.clipped(2).plans) == 1
    opacus = RDPAccountant()
    opacus.history = [(sigma, E / N, 3)]
    assert rec.epsilon == dp.epsilon() == pytest.approx(opacus.get_epsilon(delta=1e-5), rel=1e-12)


def test_train_on_poisson_batches_lowers_the_loss_and_logs_epsilon():
    x, y = _linear_task(256)
    params = _params()
    dp = DPSGD(_loss, params, torch.optim.Adam(params.values(), lr=0.05), clipping_norm=1.0,
               noise_multiplier=0.5, expected_batch_size=32, dataset_size=256, microbatch_size=16,
               accountant="prv", generator=torch.Generator().manual_seed(0), options=EAGER)
    loader = poisson_loader(TensorDataset(x, y), 32, steps=60, generator=torch.Generator().manual_seed(1))
    lines = []
    logs = train(dp, loader, log_every=20, log=lines.append)
    assert len(logs) == 60 and all(isinstance(s, StepLog) for s in logs)
    assert len(lines) == 3 and lines[-1].startswith("step 60/60: batch ") and "epsilon" in lines[-1]
    assert [s.epsilon is not None for s in logs].count(True) == 3
    first, last = sum(s.loss for s in logs[:5]) / 5, sum(s.loss for s in logs[-5:]) / 5
    assert last < 0.5 * first
    assert logs[-1].epsilon == pytest.approx(dp.accountant.epsilon(1e-5))
    assert dp.accountant.history == [(0.5, 0.125, 60)]


@pytest.mark.slow
def test_dpsgd_demo_runs_from_the_command_line(capsys):
    from fxmem.__main__ import main

    main(["dpsgd-demo", "--steps", "4", "--log-every", "2", "--batch", "16", "--microbatch", "8"])
    out = capsys.readouterr().out
    assert "step 2/4: batch " in out and "step 4/4: batch " in out and "epsilon" in out
    assert "-DP; fxmem compiles: 1" in out
    with pytest.raises(SystemExit):
        main([])  # usage: lists the command
    assert "dpsgd-demo" in capsys.readouterr().out


def test_dpsgd_noises_its_own_sums_in_place():
    """``DPSGD.step`` adds the noise to the clipped sums it owns (``noised_``): the numbers are
    ``add_noise``'s (same generator draws) and no second set of gradient-sized tensors exists."""
    import torch

    from fxmem.dpsgd.noise import add_noise, noised_

    g = torch.Generator().manual_seed(3)
    sums = {"w": torch.randn(64, 32), "b": torch.randn(32)}
    expected = add_noise(sums, 1.3, 0.7, torch.Generator().manual_seed(7))
    own = {k: v.clone() for k, v in sums.items()}
    gen = torch.Generator().manual_seed(7)
    ptrs = {k: v.data_ptr() for k, v in own.items()}
    got = {k: noised_(v, 1.3 * 0.7, gen) for k, v in own.items()}
    for k in sums:
        assert got[k].data_ptr() == ptrs[k]  # in place
        assert torch.equal(got[k], expected[k])
    half = torch.randn(8, dtype=torch.bfloat16, generator=g)
    assert noised_(half, 1.0, torch.Generator().manual_seed(1)).dtype == torch.float32  # drawn and added in float32
