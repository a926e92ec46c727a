"""make_private: the Opacus-style loop's .grad against a float64 per-example loop, the noise at
step, the accounting (and its state_dict), secure mode, the validator and fix, bad arguments."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad
from torch.utils.data import DataLoader, TensorDataset

from fxmem.dpsgd import PrivacyEngine, UnsupportedModuleError, epsilon, fix, make_private, validate
from fxmem.dpsgd.rnn import LoopRNN

EAGER = {"inner": "eager"}
C = 0.5


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.LayerNorm(8), nn.Linear(8, 3))


def _data(n: int = 20):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


def clipped_mean_f64(model: nn.Module, x, y, expected: int, make=_model) -> dict:
    """sum_i min(1, C/||g_i||) g_i / expected, g_i the gradient of example i's loss, in float64
    (on a copy built by ``make()`` with ``model``'s state)."""
    m64 = make()
    m64.load_state_dict(model.state_dict())
    m64 = m64.double()
    params = {k: v.detach() for k, v in m64.named_parameters()}
    total = {k: torch.zeros_like(v) for k, v in params.items()}
    for i in range(len(x)):
        g = grad(lambda p: F.cross_entropy(functional_call(m64, p, (x[i:i + 1].double(),)), y[i:i + 1]))(params)
        norm = torch.sqrt(sum((v ** 2).sum() for v in g.values())).item()
        for k in g:
            total[k] += g[k] * min(1.0, C / norm)
    return {k: v / expected for k, v in total.items()}


@pytest.fixture(scope="module")
def private():
    """One compiled private model (chunks of 3) shared by the tests below."""
    model = _model()
    x, y = _data()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    loader = DataLoader(TensorDataset(x, y), batch_size=5)
    engine = PrivacyEngine()
    pm, popt, pl = engine.make_private(module=model, optimizer=opt, data_loader=loader, noise_multiplier=0.0,
                                       max_grad_norm=C, microbatch_size=3, options=EAGER)
    return engine, model, pm, popt, pl


@pytest.mark.slow
def test_the_plain_loop_leaves_the_clipped_mean_on_grad(private):
    engine, model, pm, popt, pl = private
    assert pm.expected_batch_size == 5 and popt.sample_rate == 5 / 20
    sizes = []
    torch.manual_seed(2)  # Poisson batch sizes vary (deterministically here)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "runs unchunked" warning
        for step, (xb, yb) in enumerate(pl):
            popt.zero_grad()
            loss = F.cross_entropy(pm(xb), yb)
            loss.backward()
            want = clipped_mean_f64(model, xb, yb, expected=5)
            for k, p in model.named_parameters():
                assert p.grad is not None and p.grad.shape == p.shape
                assert (p.grad.double() - want[k]).abs().max() <= 1e-4, (step, k)
            popt.step()
            sizes.append(len(xb))
    assert len(sizes) == len(pl) == 4 and len(set(sizes)) > 1
    assert any(s % 3 for s in sizes)  # a last chunk padded to 3
    assert pm._grad_fns[1].chosen_microbatch_size() == 3
    assert engine.accountant.steps == 0 and popt.noiseless_steps == 4
    assert engine.get_epsilon(1e-5) == popt.epsilon(1e-5) == float("inf")  # noise 0: no privacy


def test_noise_at_step_is_sigma_c_over_the_expected_batch_from_the_generator():
    model = _model()
    x, y = _data()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    loader = DataLoader(TensorDataset(x, y), batch_size=4)
    pm, popt, _ = make_private(module=model, optimizer=opt, data_loader=loader,
                               noise_multiplier=2.0, max_grad_norm=C, noise_generator=torch.Generator().manual_seed(7),
                               microbatch_size=None, options=EAGER)
    F.cross_entropy(pm(x[:6]), y[:6]).backward()
    before = {k: (p.detach().clone(), p.grad.clone()) for k, p in model.named_parameters()}
    popt.step()
    g = torch.Generator().manual_seed(7)
    for k, p in model.named_parameters():
        w, clean = before[k]
        noise = torch.normal(0.0, 2.0 * C / 4, p.shape, generator=g)
        torch.testing.assert_close(w - p.detach(), clean + noise)
    assert popt.accountant.steps == 1
    assert popt.epsilon(1e-5) == pytest.approx(epsilon(2.0, 4 / 20, 1, 1e-5, accountant="prv"))  # Opacus' default


def test_secure_mode_noise_is_not_reproducible_from_torch_seed():
    """Opacus' guarantee: no seed of the user's reproduces the noise (or the batches)."""
    def one(seed: int):
        torch.manual_seed(seed)
        model = _model()
        x, y = _data()
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        loader = DataLoader(TensorDataset(x, y), batch_size=4)
        pm, popt, pl = make_private(module=model, optimizer=opt, data_loader=loader,
                                    noise_multiplier=1.0, max_grad_norm=C, secure_mode=True, microbatch_size=None,
                                    options=EAGER)
        torch.manual_seed(seed)
        batches = [len(b[0]) for b in pl]
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        popt.step()
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), batches, popt

    a, ba, opt_a = one(0)
    b, bb, _ = one(0)
    assert not torch.equal(a, b)
    assert opt_a.secure_mode and opt_a.generator is not None
    # 4 draws halved: the std is still sigma * C / E
    big = opt_a._noise(torch.zeros(200_000), 1.5)
    assert big.std().item() == pytest.approx(1.5, rel=0.02)


def test_accountant_state_dict_resumes_and_make_private_with_epsilon_meets_the_target():
    engine = PrivacyEngine()
    model = _model()
    x, y = _data()
    loader = DataLoader(TensorDataset(x, y), batch_size=4)
    _, popt, pl = engine.make_private_with_epsilon(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=loader,
        target_epsilon=5.0, target_delta=1e-5, epochs=3, max_grad_norm=C, microbatch_size=None, options=EAGER)
    steps = 3 * len(loader)
    assert engine.accountant.accountant == "prv"  # Opacus' default
    assert epsilon(popt.noise_multiplier, 4 / 20, steps, 1e-5, accountant="prv") <= 5.0
    assert epsilon(popt.noise_multiplier * 0.95, 4 / 20, steps, 1e-5, accountant="prv") > 5.0  # the smallest (~)
    engine.accountant.step(popt.noise_multiplier, popt.sample_rate, steps=steps)
    state = engine.state_dict()
    resumed = PrivacyEngine()
    resumed.load_state_dict(state)
    assert resumed.get_epsilon(1e-5) == engine.get_epsilon(1e-5) <= 5.0
    with pytest.raises(ValueError, match="'prv' accountant's"):
        PrivacyEngine("rdp").accountant.load_state_dict({**state["accountant"], "accountant": "prv"})


def test_batchnorm_is_named_with_groupnorm_and_fix_replaces_it():
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 4 * 4, 2))
    errors = validate(model)
    assert len(errors) == 1 and "1: BatchNorm2d" in str(errors[0]) and "GroupNorm" in str(errors[0])
    x, y = torch.randn(4, 3, 6, 6), torch.randint(0, 2, (4,))
    with pytest.raises(UnsupportedModuleError, match=r"(?s)BatchNorm2d.*use GroupNorm"):
        make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                     data_loader=DataLoader(TensorDataset(x, y), batch_size=2), noise_multiplier=1.0,
                     max_grad_norm=1.0)
    fixed = fix(model)
    assert isinstance(fixed[1], nn.GroupNorm) and fixed[1].num_groups == 8 and fixed[1].num_channels == 8
    assert isinstance(model[1], nn.BatchNorm2d)  # the original is kept
    assert validate(fixed) == []
    assert "GRU" in str(validate(nn.GRU(3, 4))[0]) and isinstance(fix(nn.GRU(3, 4)), LoopRNN)


@pytest.mark.parametrize("kwargs, name", [
    (dict(noise_multiplier=-1.0), "noise_multiplier"),
    (dict(max_grad_norm=0.0), "max_grad_norm"),
    (dict(loss_reduction="avg"), "loss_reduction"),
    (dict(data_loader=[1, 2]), "data_loader"),
    (dict(optimizer=torch.optim.SGD([nn.Parameter(torch.ones(2))], lr=0.1)), "optimizer"),
    (dict(microbatch_size=0), "microbatch_size"),
])
def test_bad_arguments_raise_naming_them(kwargs, name):
    model = _model()
    x, y = _data()
    args = dict(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                data_loader=DataLoader(TensorDataset(x, y), batch_size=4), noise_multiplier=1.0, max_grad_norm=1.0)
    with pytest.raises(ValueError, match=name):
        make_private(**{**args, **kwargs})


class _Recurrent(nn.Module):
    """A plain nn.RNN/GRU/LSTM (2 layers, both directions, batch_first) and a linear head."""

    def __init__(self, cls, **kwargs):
        super().__init__()
        self.rnn = cls(4, 5, num_layers=2, bidirectional=True, batch_first=True, **kwargs)
        self.head = nn.Linear(10, 3)

    def forward(self, x):
        return self.head(self.rnn(x)[0][:, -1])


@pytest.mark.slow
@pytest.mark.parametrize("cls, kwargs", [(nn.RNN, {"nonlinearity": "relu"}), (nn.GRU, {}), (nn.LSTM, {})])
def test_plain_recurrent_layers_give_the_clipped_mean_in_chunks_of_3(cls, kwargs):
    torch.manual_seed(0)
    model = _Recurrent(cls, **kwargs)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(7, 5, 4, generator=g), torch.randint(0, 3, (7,), generator=g)
    pm, _, _ = make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                            data_loader=DataLoader(TensorDataset(x, y), batch_size=4), noise_multiplier=0.0,
                            max_grad_norm=C, microbatch_size=3, options=EAGER)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "runs unchunked" warning
        F.cross_entropy(pm(x), y).backward()
    assert pm._grad_fns[1].chosen_microbatch_size() == 3
    ref = _Recurrent(cls, **kwargs)
    ref.load_state_dict(start)
    # Opacus' expected batch: int(len(dataset) / len(loader)) = int(7 / 2) = 3, not the batch size 4
    want = clipped_mean_f64(ref, x, y, expected=3, make=lambda: _Recurrent(cls, **kwargs))
    for k, p in model.named_parameters():
        assert (p.grad.double() - want[k]).abs().max() <= 1e-4, k


def test_grad_is_opacus_ghost_clipping_sum_over_the_expected_batch():
    """Noise 0: after ``backward()`` make_private's ``.grad`` times the expected batch size is
    the clipped sum Opacus' ghost clipping leaves on ``.grad`` (its optimizer divides at
    ``step()``), on the DP-SGD benchmark's GPT in chunks of 3. "Equal": within 1e-5 of the
    largest, Opacus' clip factor being ``C / (norm + 1e-6)``."""
    import copy

    from helpers import load_bench_module

    ghost, models = load_bench_module("ghost"), load_bench_module("dpsgd_models")
    torch.manual_seed(0)
    gpt = models.GPT(vocab=64, d=16, layers=1, heads=2, max_seq=8)
    ids = torch.randint(0, 64, (6, 8))
    opacus = ghost.opacus_variant(gpt, 1.0, 6)(None, ids, ids)
    ours = copy.deepcopy(gpt)
    module = models.Logits(ours)
    private, _, _ = make_private(module=module, optimizer=torch.optim.SGD(module.parameters(), lr=0.0),
                                 data_loader=DataLoader(TensorDataset(ids), batch_size=6), noise_multiplier=0.0,
                                 max_grad_norm=1.0, microbatch_size=3, options={"inner": "eager"})
    models.GPT.loss(private(ids), ids).backward()
    scale = max(g.abs().max().item() for g in opacus.values())
    for name, p in ours.named_parameters():
        err = (p.grad * 6 - opacus[name]).abs().max().item() / scale
        assert err <= 1e-5, f"{name}: {err:.2e} of the largest"


# --- Opacus parity: the same script with only the import changed ---------------------------------

class _RecordingSGD(torch.optim.SGD):
    """SGD that records, at each real step, the parameters and ``.grad`` it steps with (Opacus'
    and fxmem's DPOptimizer call the wrapped optimizer's ``step`` once per logical batch)."""

    def __init__(self, params, **kwargs):
        super().__init__(params, **kwargs)
        self.records = []

    def step(self, closure=None):
        params = [p for g in self.param_groups for p in g["params"]]
        self.records.append(([p.detach().clone() for p in params],
                             [None if p.grad is None else p.grad.detach().clone() for p in params]))
        return super().step(closure)


def _tiny() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _bn_tiny() -> nn.Module:
    """BatchNorm over 64 features: fixed, GroupNorm(32, 64), two values a group in one example."""
    return nn.Sequential(nn.Linear(6, 64), nn.BatchNorm1d(64), nn.Tanh(), nn.Linear(64, 3))


def _opacus_script(PrivacyEngine, BatchMemoryManager=None, *, noise=1.0, epochs=2, validator=None, make=_tiny,
                   **make_private_kwargs):
    """An Opacus tutorial loop (40 examples, batch_size 10: sample rate 0.25, 4 steps an epoch);
    ``PrivacyEngine``/``BatchMemoryManager``/``validator`` (``ModuleValidator``: the model is
    fixed and validated first) are Opacus' or fxmem's (physical batches of at most 3). Returns
    (epsilon, engine, optimizer, [(x, y, step skipped) per physical batch])."""
    torch.manual_seed(0)
    model = make()
    if validator is not None:
        model = validator.fix(model)
        assert validator.validate(model, strict=True) == []
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(40, 6, generator=g), torch.randint(0, 3, (40,), generator=g))
    loader = DataLoader(data, batch_size=10)
    optimizer = _RecordingSGD(model.parameters(), lr=0.5)
    criterion = nn.CrossEntropyLoss()
    engine = PrivacyEngine()
    model, optimizer, loader = engine.make_private(module=model, optimizer=optimizer, data_loader=loader,
                                                   noise_multiplier=noise, max_grad_norm=C,
                                                   **make_private_kwargs)
    seen = []

    def one_epoch(batches):
        for x, y in batches:
            optimizer.zero_grad()
            loss = criterion(model(x), y)
            loss.backward()
            optimizer.step()
            seen.append((x, y, optimizer._is_last_step_skipped))

    for _ in range(epochs):
        if BatchMemoryManager is None:
            one_epoch(loader)
        else:
            with BatchMemoryManager(data_loader=loader, max_physical_batch_size=3,
                                    optimizer=optimizer) as physical_loader:
                one_epoch(physical_loader)
    return (engine.get_epsilon(1e-5) if noise else None), engine, optimizer, seen


FXMEM_KW = dict(microbatch_size=3, options=EAGER)  # the eager inner compiler, as everywhere in the tests


def test_default_accountant_and_epsilon_are_opacus():
    """The same 8 steps (noise 1.0, sample rate 10/40) through opacus.PrivacyEngine and
    fxmem.dpsgd.PrivacyEngine with their defaults: the same accountant (prv), the same epsilon;
    an explicit accountant still applies."""
    import opacus

    want, o_engine, _, _ = _opacus_script(opacus.PrivacyEngine)
    got, f_engine, f_opt, _ = _opacus_script(PrivacyEngine, **FXMEM_KW)
    print(f"epsilon at delta 1e-5 after 8 steps: opacus {want:.4f}, fxmem {got:.4f}")
    assert o_engine.accountant.mechanism() == "prv" == f_engine.accountant.accountant
    assert o_engine.accountant.history == f_engine.accountant.history == [(1.0, 0.25, 8)]
    assert got == pytest.approx(want, rel=0.01)
    assert f_opt.epsilon(1e-5) == got
    for name in ("rdp", "gdp"):
        engine = PrivacyEngine(name)
        engine.accountant.step(1.0, 0.25, steps=8)
        ref = opacus.PrivacyEngine(accountant=name)
        ref.accountant.history.append((1.0, 0.25, 8))
        assert engine.accountant.accountant == name
        assert engine.get_epsilon(1e-5) == pytest.approx(ref.get_epsilon(1e-5), rel=1e-9)
    assert make_private.__kwdefaults__["accountant"] == "prv"


@pytest.mark.slow
def test_batch_memory_manager_script_runs_with_only_the_import_changed():
    """Opacus' BatchMemoryManager loop (physical batches of at most 3 of Poisson logical batches
    of expected size 10): fxmem's takes one step per logical batch with ``.grad`` the clipped
    mean of the whole logical batch (noise 0; against a float64 per-example loop), accounts one
    step per logical batch, and reports Opacus' epsilon with noise 1."""
    import opacus
    from opacus.utils.batch_memory_manager import BatchMemoryManager as OpacusBMM

    from fxmem.dpsgd import BatchMemoryManager

    want, o_engine, _, _ = _opacus_script(opacus.PrivacyEngine, OpacusBMM)
    got, f_engine, f_opt, f_seen = _opacus_script(PrivacyEngine, BatchMemoryManager, **FXMEM_KW)
    print(f"BatchMemoryManager, epsilon at delta 1e-5 after 8 steps: opacus {want:.4f}, fxmem {got:.4f}")
    assert o_engine.accountant.history == f_engine.accountant.history == [(1.0, 0.25, 8)]
    assert got == pytest.approx(want, rel=0.01)
    assert len(f_opt.original_optimizer.records) == 8 == sum(not s for *_, s in f_seen)

    _, _, opt, seen = _opacus_script(PrivacyEngine, BatchMemoryManager, noise=0.0, **FXMEM_KW)
    records = opt.original_optimizer.records
    assert len(records) == 8 and opt.noiseless_steps == 8 and not opt._step_skip_queue
    assert all(len(x) <= 3 for x, _, _ in seen)
    logical, current = [], []
    for x, y, skipped in seen:  # physical batches up to a step that was not skipped: one logical batch
        current.append((x, y))
        if not skipped:
            logical.append(current)
            current = []
    assert len(logical) == 8 and not current
    sizes = [[len(x) for x, _ in batch] for batch in logical]
    assert any(len(s) >= 3 and len(set(s)) > 1 for s in sizes), sizes  # split unevenly (array_split's sizes)
    assert all(max(s) - min(s) <= 1 for s in sizes), sizes
    _assert_clipped_means(logical, records, sizes, _tiny)


def _assert_clipped_means(logical, records, sizes, make) -> None:
    """Each step's ``.grad`` (recorded) within 1e-4 of its logical batch's clipped mean (float64)."""
    names = [k for k, _ in make().named_parameters()]
    for step, (batch, (params, grads)) in enumerate(zip(logical, records)):
        model = make()
        model.load_state_dict(dict(zip(names, params)), strict=False)
        x, y = torch.cat([b[0] for b in batch]), torch.cat([b[1] for b in batch])
        want_grad = clipped_mean_f64(model, x, y, expected=10, make=make)
        for k, gr in zip(names, grads):
            assert (gr.double() - want_grad[k]).abs().max() <= 1e-4, (step, k, sizes[step])


@pytest.mark.slow
def test_opacus_script_with_module_validator_runs_with_only_the_imports_changed():
    """Issue #57's script: a BatchNorm model through ``ModuleValidator.fix``, ``PrivacyEngine``,
    ``BatchMemoryManager`` and ``get_epsilon``, with Opacus' imports or fxmem's: the same fixed
    model (GroupNorm), epsilon within 1% of Opacus', each step's ``.grad`` within 1e-4 of its
    logical batch's clipped mean."""
    import opacus
    from opacus.utils.batch_memory_manager import BatchMemoryManager as OpacusBMM
    from opacus.validators import ModuleValidator as OpacusValidator

    from fxmem.dpsgd import BatchMemoryManager, ModuleValidator

    fixed = ModuleValidator.fix(_bn_tiny())
    assert [type(m) for m in fixed] == [type(m) for m in OpacusValidator.fix(_bn_tiny())]
    assert not ModuleValidator.is_valid(_bn_tiny()) and ModuleValidator.is_valid(fixed)
    with pytest.raises(TypeError, match="takes no options"):
        ModuleValidator.fix(_bn_tiny(), num_groups=4)
    script = dict(make=_bn_tiny)
    want, *_ = _opacus_script(opacus.PrivacyEngine, OpacusBMM, validator=OpacusValidator, **script)
    got, *_ = _opacus_script(PrivacyEngine, BatchMemoryManager, validator=ModuleValidator, **script, **FXMEM_KW)
    print(f"ModuleValidator + BatchMemoryManager, epsilon at delta 1e-5: opacus {want:.4f}, fxmem {got:.4f}")
    assert got == pytest.approx(want, rel=0.01)
    _, _, opt, seen = _opacus_script(PrivacyEngine, BatchMemoryManager, noise=0.0, validator=ModuleValidator,
                                     **script, **FXMEM_KW)
    logical, current = [], []
    for x, y, skipped in seen:
        current.append((x, y))
        if not skipped:
            logical.append(current)
            current = []
    records = opt.original_optimizer.records
    assert len(logical) == len(records) == 8
    _assert_clipped_means(logical, records, [[len(x) for x, _ in b] for b in logical],
                          lambda: ModuleValidator.fix(_bn_tiny()))


def test_batch_memory_manager_skips_step_noise_and_accounting_inside_a_logical_batch():
    """The optimizer's side of the protocol, by hand: a queued skip keeps params, ``.grad``
    (through ``zero_grad``) and the accountant; the next step noises, steps, accounts."""
    from fxmem.dpsgd import BatchMemoryManager

    model = _model()
    x, y = _data()
    pm, popt, pl = make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
                                data_loader=DataLoader(TensorDataset(x, y), batch_size=4), noise_multiplier=1.0,
                                max_grad_norm=C, microbatch_size=None, options=EAGER)
    start = [p.detach().clone() for p in model.parameters()]
    popt.signal_skip_step(True)
    popt.signal_skip_step(False)
    F.cross_entropy(pm(x[:3]), y[:3]).backward()
    first = [p.grad.clone() for p in model.parameters()]
    assert popt.step() is None and popt._is_last_step_skipped
    popt.zero_grad()
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), first))
    assert all(torch.equal(p, s) for p, s in zip(model.parameters(), start)) and popt.accountant.steps == 0
    F.cross_entropy(pm(x[3:5]), y[3:5]).backward()
    popt.step()
    assert not popt._is_last_step_skipped and popt.accountant.steps == 1
    assert not all(torch.equal(p, s) for p, s in zip(model.parameters(), start))
    popt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(ValueError, match="max_physical_batch_size"):
        BatchMemoryManager(data_loader=pl, max_physical_batch_size=0, optimizer=popt)
    with pytest.raises(ValueError, match="DPOptimizer"):
        BatchMemoryManager(data_loader=pl, max_physical_batch_size=2,
                           optimizer=torch.optim.SGD(model.parameters(), lr=1.0))
    with BatchMemoryManager(data_loader=pl, max_physical_batch_size=1, optimizer=popt) as physical:
        assert len(physical) == len(pl) * 4
        next(iter(physical))
        assert popt._step_skip_queue  # the loop left early: its signals are dropped on exit
    assert popt._step_skip_queue == []


def test_sample_rate_and_epsilon_are_opacus_when_the_batch_size_does_not_divide_the_dataset():
    """20 examples, ``batch_size=6`` (4 batches an epoch): Opacus' sample rate is
    ``1 / len(data_loader)`` = 0.25 (not 6 / 20) and its expected batch ``int(20 * 0.25)`` = 5;
    fxmem's make_private samples, divides and accounts with the same, so the same steps give
    Opacus' epsilon."""
    import opacus

    x, y = _data()

    def loader():
        return DataLoader(TensorDataset(x, y), batch_size=6)

    theirs = _model()
    o_engine = opacus.PrivacyEngine()
    o_model, o_opt, o_loader = o_engine.make_private(
        module=theirs, optimizer=torch.optim.SGD(theirs.parameters(), lr=0.1), data_loader=loader(),
        noise_multiplier=1.0, max_grad_norm=C)
    ours = _model()
    engine = PrivacyEngine()
    pm, popt, pl = engine.make_private(module=ours, optimizer=torch.optim.SGD(ours.parameters(), lr=0.1),
                                       data_loader=loader(), noise_multiplier=1.0, max_grad_norm=C,
                                       microbatch_size=None, options=EAGER)
    assert popt.sample_rate == 1 / len(o_loader) == o_loader.batch_sampler.sample_rate == 0.25
    assert pl.batch_sampler.sample_rate == 0.25 and len(pl) == len(o_loader) == 4
    assert pm.expected_batch_size == popt.expected_batch_size == o_opt.expected_batch_size == 5
    for _ in range(6):  # the accounting hooks of both optimizers' step(), nothing trained
        for opt, model in ((o_opt, theirs), (popt, ours)):
            opt.zero_grad()
            for p in model.parameters():
                p.grad = torch.zeros_like(p)
                p.grad_sample = torch.zeros(1, *p.shape)
            opt.step()
    assert o_engine.accountant.history == [(1.0, 0.25, 6)]
    assert engine.get_epsilon(1e-5) == pytest.approx(o_engine.get_epsilon(1e-5), rel=1e-9)
