import pytest
import torch
import torch.nn.functional as F

from fxmem.profiling import saved_tensor_bytes
from fxmem_kernels.dropout import seeded_dropout, seeded_dropout_backward_op, seeded_dropout_op

from .util import TOL, cuda_test

IMPLS = ["torch", "triton"]
SHAPES = [(7,), (3, 5), (2, 3, 17)]


def _x(shape, dtype=torch.float32, device="cpu"):
    # Nonzero entries, so the kept positions are exactly y != 0.
    x = torch.rand(shape, generator=torch.Generator().manual_seed(0)) + 0.5
    return x.to(device, dtype).requires_grad_()


def _step(x, p, seed, impl, weight):
    y = seeded_dropout(x, p, seed, impl=impl)
    (g,) = torch.autograd.grad((y.float() * weight).sum(), x)
    return y, g


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("p", [0.0, 0.3, 0.75])
def test_mask_is_consistent_and_reproducible(impl, shape, p):
    x = _x(shape)
    w = torch.randn(shape)
    y, g = _step(x, p, 1234, impl, w)
    keep = y != 0
    torch.testing.assert_close(y, x * keep / (1 - p), **TOL[torch.float32])
    torch.testing.assert_close(g, w * keep / (1 - p), **TOL[torch.float32])
    y2, g2 = _step(x, p, 1234, impl, w)
    assert torch.equal(y, y2) and torch.equal(g, g2)  # same seed: bit-identical
    if p == 0:
        assert keep.all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision(dtype):
    x, w = _x((4, 33), dtype), torch.randn(4, 33)
    y, g = _step(x, 0.4, 9, "torch", w)
    assert y.dtype == g.dtype == dtype
    keep = y != 0
    torch.testing.assert_close(y, x * keep / 0.6, **TOL[dtype])
    torch.testing.assert_close(g, (w * keep / 0.6).to(dtype), **TOL[dtype])


@pytest.mark.parametrize("impl", IMPLS)
def test_float64_keeps_precision_and_the_float32_mask(impl):
    x, w = _x((3, 40), torch.float64), torch.randn(3, 40, dtype=torch.float64)
    y, g = _step(x, 0.3, 5, impl, w)
    assert y.dtype == g.dtype == torch.float64
    keep = y != 0
    assert torch.equal(keep, seeded_dropout(x.float(), 0.3, 5, impl=impl) != 0)
    torch.testing.assert_close(y, x * keep / 0.7, rtol=1e-7, atol=0)
    torch.testing.assert_close(g, w * keep / 0.7, rtol=1e-7, atol=0)


def test_triton_mask_is_tl_rand():
    # tl.rand(20240601, arange(12)) computed with TRITON_INTERPRET=1 (where tl.rand runs): the
    # kernel's written-out Philox keeps exactly where tl.rand >= p.
    u = torch.tensor([0.18202351033687592, 0.9588744044303894, 0.8670640587806702,
                      0.3227252960205078, 0.7064331769943237, 0.15423725545406342,
                      0.03430052474141121, 0.5523594617843628, 0.6235981583595276,
                      0.5878349542617798, 0.8105875849723816, 0.9963756203651428])
    for p in (0.5, 0.3227252960205078, 0.9):
        y = seeded_dropout(torch.ones(12), p, 20240601, impl="triton")
        assert torch.equal(y != 0, u >= p)


def test_portable_mask_is_the_seeded_generator():
    y = seeded_dropout(torch.ones(5, 40), 0.3, 77, impl="torch")
    u = torch.rand(5, 40, generator=torch.Generator().manual_seed(77))
    assert torch.equal(y != 0, u >= 0.3)


@pytest.mark.parametrize("impl", IMPLS)
def test_seeds_and_default_generator(impl):
    x = torch.ones(64)
    a, b = (seeded_dropout(x, 0.5, s, impl=impl) for s in (1, 2))
    assert not torch.equal(a, b)
    torch.manual_seed(5)
    a = seeded_dropout(x, 0.5, impl=impl)
    c = seeded_dropout(x, 0.5, impl=impl)  # a fresh seed per call
    torch.manual_seed(5)
    assert torch.equal(seeded_dropout(x, 0.5, impl=impl), a)
    assert not torch.equal(a, c)
    assert torch.equal(seeded_dropout(x, 0.5, torch.tensor(3), impl=impl),
                       seeded_dropout(x, 0.5, 3, impl=impl))


def test_fraction_kept():
    for p in (0.1, 0.5):
        kept = (seeded_dropout(torch.ones(1000, 1000), p, 3) != 0).float().mean().item()
        assert abs(kept - (1 - p)) < 3e-3
    kept = (seeded_dropout(torch.ones(8, 1024), 0.25, 3, impl="triton") != 0).float().mean()
    assert abs(kept.item() - 0.75) < 0.02  # 4 sigma at 8192 draws


def test_eval_is_identity():
    x = torch.randn(3, 4)
    assert seeded_dropout(x, 0.5, 1, training=False) is x


@pytest.mark.parametrize("impl", IMPLS)
def test_vmap_folds_batch_into_the_flat_index(impl):
    xs, w = torch.ones(4, 64), torch.randn(4, 64)
    f = lambda x: seeded_dropout(x, 0.5, 3, impl=impl)
    v = torch.func.vmap(f)(xs)
    assert torch.equal(v, f(xs))  # = one call on the stacked tensor
    assert torch.equal(v, torch.func.vmap(f)(xs))
    assert all(not torch.equal(v[0], v[i]) for i in range(1, 4))  # a mask per example
    assert torch.equal(torch.func.vmap(f, in_dims=1, out_dims=1)(xs.t().contiguous()), v.t())

    loss = lambda x, w: (seeded_dropout(x, 0.5, 3, impl=impl) * w).sum()
    g = torch.func.vmap(torch.func.grad(loss))(xs, w)
    torch.testing.assert_close(g, w * (v != 0) * 2)
    # Unbatched x with per-example cotangents: one mask, the same for every example.
    g = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(xs[0], w)
    torch.testing.assert_close(g, w * (f(xs[0]) != 0) * 2)


def test_vmap_with_drawn_seeds():
    xs, w = torch.ones(4, 64), torch.randn(4, 64)

    def f(x, w):
        y = seeded_dropout(x, 0.5)
        return (y * w).sum(), y

    torch.manual_seed(0)
    g, y = torch.func.vmap(torch.func.grad(f, has_aux=True), randomness="same")(xs, w)
    torch.testing.assert_close(g, w * (y != 0) * 2)
    torch.manual_seed(0)
    again = torch.func.vmap(torch.func.grad(f, has_aux=True), randomness="same")(xs, w)
    assert torch.equal(again[1], y)
    # randomness="different": a seed per example (one call per example).
    g, y = torch.func.vmap(torch.func.grad(f, has_aux=True), randomness="different")(xs, w)
    torch.testing.assert_close(g, w * (y != 0) * 2)
    assert all(not torch.equal(y[0], y[i]) for i in range(1, 4))


def test_keeps_only_the_seed():
    x = torch.randn(64, 256, requires_grad=True)
    plain = saved_tensor_bytes(lambda x: F.dropout(x, 0.1), x)
    assert plain >= 64 * 256  # the unfused op keeps a mask
    assert saved_tensor_bytes(lambda x: seeded_dropout(x, 0.1, 3), x) == 8  # the int64 seed
    seed = torch.tensor(3)
    assert saved_tensor_bytes(lambda x, s: seeded_dropout(x, 0.1, s), x, seed) == 0


def test_double_backward_raises():
    x = torch.randn(3, 4, requires_grad=True)
    with pytest.raises(RuntimeError, match="double backward is not supported"):
        torch.autograd.grad(seeded_dropout(x, 0.5, 1).sum(), x, create_graph=True)
    f = lambda x: seeded_dropout(x, 0.5, 1).pow(2).sum()
    with pytest.raises(RuntimeError, match="double backward is not supported"):
        torch.func.grad(lambda x: torch.func.grad(f)(x).sum())(x.detach())


def test_bad_arguments_name_what_is_allowed():
    x = torch.randn(2, 3)
    for p in (1.0, -0.1, 1.5, "0.5"):
        with pytest.raises(ValueError, match=r"p must be a number in \[0, 1\)"):
            seeded_dropout(x, p, 1)
    with pytest.raises(ValueError, match=r"p must be a number in \[0, 1\)"):
        seeded_dropout(x, 1.0, 1, training=False)
    for seed in (-1, 2**63, 1.5, torch.tensor([1, 2]), torch.tensor(1.0)):
        with pytest.raises(ValueError, match="seed must be None, an int in"):
            seeded_dropout(x, 0.5, seed)
    with pytest.raises(ValueError, match="x must be floating point"):
        seeded_dropout(torch.ones(3, dtype=torch.int64), 0.5, 1)
    with pytest.raises(ValueError, match="impl must be one of"):
        seeded_dropout(x, 0.5, 1, impl="cuda")


def test_opcheck():
    x, seed = torch.randn(3, 8), torch.tensor(11)
    torch.library.opcheck(seeded_dropout_op, (x, 0.3, seed, "torch"))
    torch.library.opcheck(seeded_dropout_backward_op, (torch.randn(3, 8), 0.3, seed, "torch"))
    torch.library.opcheck(seeded_dropout_backward_op,
                          (torch.randn(3, 8), 0.3, seed, "torch", torch.empty(0)))
    torch.library.opcheck(seeded_dropout_op, (x, 0.3, seed, "triton"),
                          test_utils=("test_schema", "test_faketensor"))


def test_compiles_into_a_graph():
    x = _x((3, 8))
    for seed in (5, None):
        compiled = torch.compile(lambda x: seeded_dropout(x, 0.3, seed), backend="aot_eager",
                                 fullgraph=True)
        torch.manual_seed(0)
        a = compiled(x)
        torch.manual_seed(0)
        b = seeded_dropout(x, 0.3, seed)
        assert torch.equal(a, b)
        assert torch.equal(torch.autograd.grad(a.sum(), x)[0], torch.autograd.grad(b.sum(), x)[0])


@cuda_test
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_cuda(dtype, impl):
    x, w = _x((64, 1000), dtype, "cuda"), torch.randn(64, 1000, device="cuda")
    y, g = _step(x, 0.2, 42, impl, w)
    keep = y != 0
    torch.testing.assert_close(y, x * keep / 0.8, **TOL[dtype])
    torch.testing.assert_close(g, (w * keep / 0.8).to(dtype), **TOL[dtype])
    y2, g2 = _step(x, 0.2, 42, impl, w)
    assert torch.equal(y, y2) and torch.equal(g, g2)
    assert abs(keep.float().mean().item() - 0.8) < 0.01


@cuda_test
def test_cuda_auto_draws_the_portable_masks_unless_triton_is_opted_in(monkeypatch):
    """The two implementations draw different masks for one seed: "auto" on CUDA draws the
    portable one's by default, Triton's with FXMEM_KERNELS_TRITON=1."""
    x, w = _x((64, 1000), device="cuda"), torch.randn(64, 1000, device="cuda")
    masks = {impl: _step(x, 0.5, 7, impl, w)[0] != 0 for impl in ("triton", "torch")}
    assert not torch.equal(masks["triton"], masks["torch"])
    monkeypatch.delenv("FXMEM_KERNELS_TRITON", raising=False)
    assert torch.equal(_step(x, 0.5, 7, "auto", w)[0] != 0, masks["torch"])
    monkeypatch.setenv("FXMEM_KERNELS_TRITON", "1")
    assert torch.equal(_step(x, 0.5, 7, "auto", w)[0] != 0, masks["triton"])
