"""make_private against Opacus 1.6's own make_private: grad_sample_mode's names, per-layer
clipping, per-sample gradients on request, and the arguments fxmem refuses by name."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import grad, vmap
from torch.utils.data import DataLoader, TensorDataset

from fxmem.dpsgd import PrivacyEngine, clipped_grad, make_private
from fxmem.dpsgd.private import GRAD_SAMPLE_MODES

FXMEM_KW = dict(microbatch_size=3, options={"inner": "eager"})  # eager graphs: a fast compile
# Per-layer bounds, one per parameter in the optimizer's order (the reverse of the module's, so
# that a mix-up of the two orders shows); small enough that every layer is clipped somewhere.
BOUNDS = [0.05, 0.3, 0.02, 0.1, 0.2, 0.01]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.LayerNorm(8), nn.Linear(8, 3))


def _loader() -> DataLoader:
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(20, 6, generator=g), torch.randint(0, 3, (20,), generator=g))
    return DataLoader(data, batch_size=5)


def _one_step(engine, **kwargs) -> tuple[nn.Module, object, list[torch.Tensor], list]:
    """One batch of Opacus' loop without Poisson sampling (the same 5 examples for both
    libraries), no noise: ``(model, optimizer, .grad after step(), p.grad_sample after backward)``."""
    model = _model()
    optimizer = torch.optim.SGD(list(model.parameters())[::-1], lr=0.0)
    out = engine.make_private(module=model, optimizer=optimizer, data_loader=_loader(), noise_multiplier=0.0,
                              poisson_sampling=False, **kwargs)
    private, dp_optimizer, loader = out[0], out[1], out[-1]
    criterion = out[2] if len(out) == 4 else nn.CrossEntropyLoss()
    x, y = next(iter(loader))
    dp_optimizer.zero_grad()
    criterion(private(x), y).backward()
    samples = [getattr(p, "grad_sample", None) for p in model.parameters()]
    samples = [s.detach().clone() if isinstance(s, torch.Tensor) else s for s in samples]
    dp_optimizer.step()
    return model, dp_optimizer, [p.grad.detach().clone() for p in model.parameters()], samples


def _relative(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    scale = max(w.abs().max().item() for w in want)
    return max((g - w).abs().max().item() for g, w in zip(got, want)) / scale


@pytest.mark.parametrize("ghost", [True, False], ids=["ghost-norms", "materialized"])
def test_per_layer_clipping_is_opacus_per_layer(ghost):
    """clipping="per_layer", max_grad_norm a list in the optimizer's order: .grad after step()
    within 1e-5 of Opacus' DPPerLayerOptimizer (largest element), with fxmem's ghost norms and
    without; the noise is scaled by the bounds' L2 norm, as Opacus'."""
    opacus = pytest.importorskip("opacus", reason="the reference is Opacus' per-layer clipping (pip install opacus)")
    _, o_opt, want, _ = _one_step(opacus.PrivacyEngine(), max_grad_norm=BOUNDS, clipping="per_layer")
    options = {**FXMEM_KW["options"], "ghost_clipping": ghost}
    _, f_opt, got, _ = _one_step(PrivacyEngine(), max_grad_norm=BOUNDS, clipping="per_layer",
                                 microbatch_size=3, options=options)
    err = _relative(got, want)
    print(f"per-layer clipping, ghost norms {ghost}: max |fxmem - opacus| / max |opacus| = {err:.2e}")
    assert err < 1e-5
    (step,) = f_opt.module._grad_fns.values()  # the route taken: both Linear weights by ghost norms, or neither
    assert [d.choice for plan in step.plans for d in plan.ghost or []] == (["ghost"] * 2 if ghost else [])
    assert f_opt.max_grad_norms == BOUNDS == o_opt.max_grad_norms
    assert f_opt.max_grad_norm == pytest.approx(o_opt.max_grad_norm, rel=1e-6)
    assert f_opt.max_grad_norm == pytest.approx(math.hypot(*BOUNDS))


def test_grad_sample_on_request_is_opacus_grad_sample():
    """grad_sample=True: after backward each parameter has p.grad_sample [B, *p.shape], within
    1e-5 of Opacus' (hooks) per parameter; .grad is still the clipped mean; zero_grad() clears it."""
    opacus = pytest.importorskip("opacus", reason="the reference is Opacus' p.grad_sample (pip install opacus)")
    _, _, want_grad, want = _one_step(opacus.PrivacyEngine(), max_grad_norm=0.5)
    model, f_opt, got_grad, got = _one_step(PrivacyEngine(), max_grad_norm=0.5, grad_sample=True, **FXMEM_KW)
    for (name, p), g, w in zip(model.named_parameters(), got, want):
        assert g.shape == (5, *p.shape) == w.shape, name
        err = (g - w).abs().max().item() / w.abs().max().item()
        assert err < 1e-5, f"{name}: grad_sample differs from Opacus' by {err:.2e} (relative)"
    assert _relative(got_grad, want_grad) < 1e-5
    f_opt.zero_grad()
    assert all(p.grad_sample is None for p in model.parameters())


def test_grad_sample_is_off_by_default():
    model, _, _, samples = _one_step(PrivacyEngine(), max_grad_norm=0.5, **FXMEM_KW)
    assert samples == [None] * len(samples)


@pytest.mark.parametrize("mode", sorted(GRAD_SAMPLE_MODES))
def test_every_opacus_grad_sample_mode_is_accepted_and_returns_opacus_tuple(mode):
    """Each mode Opacus' make_private accepts gives Opacus' return shape (the ghost modes add the
    criterion, returned as given: fxmem's clipping needs no wrapped loss)."""
    model, criterion = _model(), nn.CrossEntropyLoss()
    out = make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=_loader(),
                       noise_multiplier=1.0, max_grad_norm=1.0, criterion=criterion, grad_sample_mode=mode,
                       **FXMEM_KW)
    if mode.startswith("ghost"):
        assert len(out) == 4 and out[2] is criterion
        assert out[0]._clip_args["options"]["ghost_clipping"] is True
    else:
        assert len(out) == 3


def test_ghost_mode_grad_is_opacus_ghost_mode_grad():
    """grad_sample_mode="ghost" in Opacus' ghost loop (its criterion, one backward): .grad after
    step() within 1e-5 of Opacus' ghost clipping."""
    opacus = pytest.importorskip("opacus", reason="the reference is Opacus' ghost clipping (pip install opacus)")
    kwargs = dict(max_grad_norm=0.5, grad_sample_mode="ghost", criterion=nn.CrossEntropyLoss())
    _, _, want, _ = _one_step(opacus.PrivacyEngine(), **kwargs)
    _, _, got, _ = _one_step(PrivacyEngine(), **kwargs, **FXMEM_KW)
    assert _relative(got, want) < 1e-5


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(grad_sample_mode="hook"), ValueError,
     r"grad_sample_mode must be one of \('hooks', 'functorch', 'ew', 'ghost', 'ghost_fsdp'\), got 'hook'"),
    (dict(grad_sample_mode="ghost_tp"), NotImplementedError, r"grad_sample_mode='ghost_tp' .*tensor parallelism"),
    (dict(grad_sample_mode="no_op"), NotImplementedError, r"grad_sample_mode='no_op'"),
    (dict(clipping="adaptive"), NotImplementedError, r"clipping='adaptive' \(Opacus' AdaClipDPOptimizer\)"),
    (dict(clipping="layer"), ValueError, r"clipping must be one of \('flat', 'per_layer'\), got 'layer'"),
    (dict(target_unclipped_quantile=0.5, clipbound_learning_rate=0.2), NotImplementedError,
     r"\['clipbound_learning_rate', 'target_unclipped_quantile'\] are Opacus' adaptive clipping arguments"),
    (dict(batch_size=3), TypeError, r"unexpected arguments \['batch_size'\]"),
    (dict(batch_first=False), NotImplementedError, r"batch_first=False .*batch as dim 0"),
    (dict(wrap_model=False), NotImplementedError, r"wrap_model=False"),
    (dict(rand_on_empty=True), NotImplementedError, r"rand_on_empty=True"),
    (dict(grad_sample_mode="ghost", options={"ghost_clipping": False}), ValueError, r"pick one"),
    (dict(clipping="per_layer"), ValueError, r"needs max_grad_norm as a list of 6 bounds"),
    (dict(clipping="per_layer", max_grad_norm=[1.0] * 5), ValueError, r"list of 6 bounds"),
    (dict(clipping="per_layer", max_grad_norm=[1.0] * 5 + [0.0]), ValueError, r"max_grad_norm.*positive"),
    (dict(grad_sample=1), ValueError, r"grad_sample must be True or False"),
])
def test_opacus_arguments_fxmem_refuses_are_named(kwargs, error, message):
    model = _model()
    args = dict(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=_loader(),
                noise_multiplier=1.0, max_grad_norm=1.0)
    with pytest.raises(error, match=message):
        make_private(**{**args, **kwargs})


def test_a_noise_generator_in_secure_mode_is_refused_as_opacus_refuses_it():
    model = _model()
    with pytest.raises(ValueError, match=r"noise_generator cannot be given in secure mode"):
        make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=_loader(),
                     noise_multiplier=1.0, max_grad_norm=1.0, secure_mode=True,
                     noise_generator=torch.Generator().manual_seed(0))


def test_per_layer_needs_a_bound_for_every_trainable_parameter():
    model = _model()
    optimizer = torch.optim.SGD(list(model.parameters())[:4], lr=0.1)
    with pytest.raises(ValueError, match=r"does not step the trainable parameters \['3.weight', '3.bias'\]"):
        make_private(module=model, optimizer=optimizer, data_loader=_loader(), noise_multiplier=1.0,
                     max_grad_norm=[1.0] * 4, clipping="per_layer")


def test_clipped_grad_with_a_bound_per_tensor_clips_each_tensor_to_its_own():
    """clipped_grad(loss, [C_1, ..., C_k]): sum_i of each tensor's per-example gradient times
    min(1, C_j / its own norm), within 1e-6 of a float64 loop, in chunks of 3 and unchunked."""
    torch.manual_seed(0)
    params = {"w": torch.randn(6, 3), "b": torch.randn(3)}
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    bounds = [0.2, 0.05]

    def loss(p, x, y):
        return F.cross_entropy((x @ p["w"] + p["b"])[None], y[None])

    p64 = {k: v.double() for k, v in params.items()}
    per = vmap(grad(loss), in_dims=(None, 0, 0))(p64, x.double(), y)
    want = {k: (per[k] * (c / per[k].flatten(1).norm(dim=1)).clamp(max=1).view(-1, *[1] * (per[k].dim() - 1))).sum(0)
            for k, c in zip(params, bounds)}
    for mb in (3, None):
        got = clipped_grad(loss, bounds, batch_argnums=(1, 2), microbatch_size=mb, **{"options": FXMEM_KW["options"]})(
            params, x, y)
        for k in want:
            torch.testing.assert_close(got[k].double(), want[k], rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match=r"clipping_norm has 3 bounds \(per-layer clipping\) for 2 differentiated"):
        clipped_grad(loss, [1.0, 1.0, 1.0], batch_argnums=(1, 2))(params, x, y)
