import importlib

import pytest
import torch
import torch.nn.functional as F
from torch.func import grad, grad_and_value, vmap

from fxmem.profiling import saved_tensor_bytes
from fxmem_kernels.linear_cross_entropy import (
    linear_cross_entropy,
    linear_cross_entropy_backward_op,
    linear_cross_entropy_op,
    reference,
)

from .util import assert_same, assert_triton_matches_portable, cuda_test

# The module (the package's attribute of this name is the function it exports).
lce_mod = importlib.import_module("fxmem_kernels.linear_cross_entropy")

V = 40
OPTIONS = {  # name -> keyword arguments (beyond reduction)
    "plain": {},
    "ignore+smoothing": dict(label_smoothing=0.1),
    "scale+softcap": dict(logit_scale=0.7, softcap=3.0),
    "zloss": dict(z_loss=1e-2, logit_scale=1.3),
    "all": dict(label_smoothing=0.2, softcap=2.0, z_loss=0.1, ignore_index=3),
}


_ref = reference  # the unfused expression, written out (fxmem_kernels.linear_cross_entropy.reference)


def _inputs(shape, h_dim=16, v=V, bias=False, dtype=torch.float32, ignore=-100, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(*shape, h_dim, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(v, h_dim, generator=g) / 2).to(dtype).requires_grad_()
    b = torch.randn(v, generator=g).to(dtype).requires_grad_() if bias else None
    t = torch.randint(0, v, shape, generator=g)
    t.view(-1)[::4] = ignore  # some ignored targets
    return h, w, b, t


def _check(shape, bias, reduction, opts, impl="torch", dtype=torch.float32, workspace=None):
    h, w, b, t = _inputs(shape, bias=bias, dtype=dtype, ignore=opts.get("ignore_index", -100))
    kw = dict(opts, reduction=reduction)
    if workspace is not None:
        kw["workspace_bytes"] = workspace
    assert_same(lambda h, w, b: linear_cross_entropy(h, w, t, b, impl=impl, **kw),
                lambda h, w, b: _ref(h, w, t, b, **kw), [h, w, b], dtype=dtype)


# 3 rows of fp32 logits + softcap buffer per chunk: several chunks, a ragged last one.
SMALL_WS = 3 * V * 4 * 2


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("opts", list(OPTIONS), ids=list(OPTIONS))
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(13,), (2, 5)])
def test_matches_plain_pytorch_fp32(reduction, opts, bias, shape):
    _check(shape, bias, reduction, OPTIONS[opts], workspace=SMALL_WS)


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("opts", ["plain", "all"])
@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_given_logits_are_read_not_recomputed(reduction, opts, impl, monkeypatch):
    """``logits=``: the same loss and gradients, from the caller's logits (a chunk of them is
    copied: poisoning the weight's data after the logits are computed would show a recompute)."""
    if impl == "triton":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    h, w, b, t = _inputs((2, 5), bias=True, ignore=OPTIONS[opts].get("ignore_index", -100))
    kw = dict(OPTIONS[opts], reduction=reduction, workspace_bytes=SMALL_WS)
    logits = F.linear(h, w, b).detach().view(-1, V)
    assert_same(lambda h, w, b: linear_cross_entropy(h, w, t, b, impl=impl, logits=logits, **kw),
                lambda h, w, b: _ref(h, w, t, b, **kw), [h, w, b])
    if reduction == "mean":  # the loss comes from the logits given, whatever the weight holds
        wrong = linear_cross_entropy(h, torch.zeros_like(w), t, b, impl=impl, logits=logits, **kw)
        torch.testing.assert_close(wrong, _ref(h, w, t, b, **kw))
    with pytest.raises(ValueError, match=r"logits must have shape \[10, 40\]"):
        linear_cross_entropy(h, w, t, b, logits=logits[:4], **kw)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_default_workspace_one_chunk(reduction):
    _check((3, 7), True, reduction, OPTIONS["all"])


def test_no_ignored_targets_and_ignore_index_absent():
    h, w, _, _ = _inputs((9,))
    t = torch.randint(0, V, (9,), generator=torch.Generator().manual_seed(1))
    assert_same(lambda h, w: linear_cross_entropy(h, w, t, impl="torch"),
                lambda h, w: F.cross_entropy(F.linear(h, w), t), [h, w])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_low_precision_matches(dtype, reduction):
    # Against the fp32 expression on the same (rounded) inputs; gradients come back in dtype.
    _check((12,), True, reduction, OPTIONS["ignore+smoothing"], dtype=dtype,
           workspace=5 * V * 6)
    h, w, b, t = _inputs((4,), bias=True, dtype=dtype)
    loss = linear_cross_entropy(h, w, t, b, reduction=reduction)
    gh, gw, gb = torch.autograd.grad(loss.float().sum(), [h, w, b])
    assert loss.dtype == gh.dtype == gw.dtype == gb.dtype == dtype


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_loss_dtype_keeps_a_bf16_inputs_loss_unrounded(reduction):
    # As F.cross_entropy(linear(h, w, b).float(), t) under bf16 (what autocast computes): bf16
    # logits, fp32 loss; without loss_dtype the loss would be rounded to bf16 (2**-9 relative).
    h, w, b, t = _inputs((3, 7), bias=True, dtype=torch.bfloat16)
    loss = linear_cross_entropy(h, w, t, b, reduction=reduction, loss_dtype=torch.float32, workspace_bytes=5 * V * 6)
    ref = F.cross_entropy(F.linear(h, w, b).float().view(-1, V), t.view(-1), reduction=reduction)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, ref.view(loss.shape), rtol=1e-5, atol=1e-6)
    grads = torch.autograd.grad(loss.sum(), [h, w, b])
    assert all(g.dtype == torch.bfloat16 for g in grads)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("opts", ["plain", "all", "zloss"])
def test_triton_kernel_through_interpreter(reduction, opts, monkeypatch):
    # Tiny fp32 shapes; vocab tiles of 16 so the online log-sum-exp spans several tiles
    # (the last one ragged), and a workspace of 4 rows so there are several chunks.
    monkeypatch.setattr(lce_mod, "_MAX_BLOCK_V", 16)
    _check((7,), opts != "plain", reduction, OPTIONS[opts], impl="triton", workspace=4 * V * 4)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_vmap_grad_gives_per_example_gradients(reduction):
    h, w, b, t = [x.detach() if x is not None else None for x in _inputs((4, 6), bias=True)]
    kw = dict(reduction=reduction, label_smoothing=0.1, z_loss=1e-3)

    def per_example(fn):
        return vmap(grad_and_value(lambda w, b, h, t: fn(h, w, t, b, **kw), argnums=(0, 1, 2)),
                    in_dims=(None, None, 0, 0))(w, b, h, t)

    (gw, gb, gh), loss = per_example(linear_cross_entropy)
    (rw, rb, rh), rloss = per_example(_ref)
    assert gw.shape == (4, V, 16) and gb.shape == (4, V) and gh.shape == h.shape
    for a, r in [(loss, rloss), (gw, rw), (gb, rb), (gh, rh)]:
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_backward_recomputes_when_forward_computed_no_gradients(reduction):
    # A gradient the forward was not asked for (a transform hid requires_grad) comes from the
    # backward op, which recomputes the logits from the saved log-sum-exp.
    h, w, b, t = _inputs((9,), bias=True)
    opts = (-100, 0.1, 0.7, 4.0, 1e-2, SMALL_WS, "torch")
    kw = dict(label_smoothing=0.1, logit_scale=0.7, softcap=4.0, z_loss=1e-2, reduction=reduction)
    assert_same(lambda h, w, b: lce_mod._LinearCrossEntropy.apply(h, w, b, t, opts, reduction,
                                                                  (False, False, False), None, None)[0],
                lambda h, w, b: _ref(h, w, t, b, **kw), [h, w, b])


def test_vmap_grad_per_token_losses():
    # reduction="none": the backward op recomputes the logits, per example.
    h, w, _, t = [x.detach() if x is not None else None for x in _inputs((3, 5))]
    wts = torch.linspace(0.5, 2, 5)
    loss = lambda fn: (lambda w, h, t: (fn(h, w, t, reduction="none") * wts).sum())
    got = vmap(grad(loss(linear_cross_entropy), argnums=(0, 1)), in_dims=(None, 0, 0))(w, h, t)
    want = vmap(grad(loss(_ref), argnums=(0, 1)), in_dims=(None, 0, 0))(w, h, t)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_vmap_forward_and_grad_of_vmap():
    h, w, _, t = [x.detach() if x is not None else None for x in _inputs((3, 5))]
    # per-token losses with only the rows batched (one call), and with the weight batched too
    torch.testing.assert_close(vmap(lambda h, t: linear_cross_entropy(h, w, t, reduction="none"))(h, t),
                               _ref(h, w, t, reduction="none"))
    ws = torch.randn(3, V, 16)
    torch.testing.assert_close(vmap(linear_cross_entropy)(h, ws, t),
                               vmap(_ref)(h, ws, t))
    # grad of a vmapped loss: gradients summed over the examples
    f = lambda fn: (lambda w: vmap(lambda h, t: fn(h, w, t), in_dims=(0, 0))(h, t).sum())
    torch.testing.assert_close(grad(f(linear_cross_entropy))(w), grad(f(_ref))(w))


def test_keeps_no_more_than_unfused():
    h, w, b, t = _inputs((64,), h_dim=32, v=512, bias=True)
    for reduction in ("mean", "none"):
        fused = saved_tensor_bytes(lambda h, w, b: linear_cross_entropy(h, w, t, b,
                                                                        reduction=reduction),
                                   h, w, b)
        plain = saved_tensor_bytes(lambda h, w, b: F.cross_entropy(F.linear(h, w, b), t,
                                                                   reduction=reduction),
                                   h, w, b)
        assert fused <= plain, (reduction, fused, plain)
    # per-token losses keep only the log-sum-exp (the inputs, target included, exist anyway)
    assert saved_tensor_bytes(lambda h, w, t: linear_cross_entropy(h, w, t, reduction="none"),
                              h, w, t) == 64 * 4


def test_double_backward_raises():
    h, w, _, t = _inputs((5,))
    with pytest.raises(RuntimeError, match="double backward is not supported"):
        torch.autograd.grad(linear_cross_entropy(h, w, t), w, create_graph=True)
    f = lambda w: linear_cross_entropy(h.detach(), w, t, reduction="sum")
    with pytest.raises(RuntimeError, match="double backward is not supported"):
        grad(lambda w: grad(f)(w).sum())(w.detach())


def test_second_backward_through_retained_graph_raises():
    h, w, _, t = _inputs((5,))
    loss = linear_cross_entropy(h, w, t)
    torch.autograd.grad(loss, w, retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        torch.autograd.grad(loss, w)


def test_all_targets_ignored_matches_torch():
    h, w, _, _ = _inputs((4,))
    t = torch.full((4,), -100)
    loss = linear_cross_entropy(h, w, t)
    assert torch.isnan(loss) and torch.isnan(F.cross_entropy(F.linear(h, w), t))
    gh, gw = torch.autograd.grad(loss, [h, w])
    assert not gh.any() and not gw.any()


def test_bad_arguments_name_what_is_allowed():
    h, w, b, t = _inputs((4,), bias=True)
    with pytest.raises(ValueError, match=r"reduction must be one of \('mean', 'sum', 'none'\)"):
        linear_cross_entropy(h, w, t, reduction="avg")
    with pytest.raises(ValueError, match=r"weight must have shape \[V, 16\]"):
        linear_cross_entropy(h, w[:, :8], t)
    with pytest.raises(ValueError, match=r"bias must have shape \[40\]"):
        linear_cross_entropy(h, w, t, b[:5])
    with pytest.raises(ValueError, match=r"target must have shape \[4\]"):
        linear_cross_entropy(h, w, t[:3])
    with pytest.raises(ValueError, match="target must have an integer dtype"):
        linear_cross_entropy(h, w, t.float())
    with pytest.raises(ValueError, match="weight must have hidden's dtype"):
        linear_cross_entropy(h, w.double(), t)
    with pytest.raises(ValueError, match="hidden must have a floating dtype"):
        linear_cross_entropy(h.double(), w.double(), t)
    with pytest.raises(ValueError, match=r"workspace_bytes=100 is too small for one row of 40 "
                                         r"logits .* needs at least 160"):
        linear_cross_entropy(h, w, t, workspace_bytes=100)
    with pytest.raises(ValueError, match=r"label_smoothing must be in \[0, 1\]"):
        linear_cross_entropy(h, w, t, label_smoothing=1.5)
    with pytest.raises(ValueError, match="softcap must be None"):
        linear_cross_entropy(h, w, t, softcap=0.0)
    with pytest.raises(ValueError, match="z_loss must be"):
        linear_cross_entropy(h, w, t, z_loss=-1.0)
    with pytest.raises(ValueError, match="impl must be one of"):
        linear_cross_entropy(h, w, t, impl="cuda")
    with pytest.raises(ValueError, match=r"target values must be in \[0, 40\) or ignore_index"):
        linear_cross_entropy(h, w, torch.tensor([0, 1, 40, 2]))


def test_opcheck():
    h, w, b, t = [x.detach() for x in _inputs((2, 3), bias=True)]
    for reduction in ("mean", "none"):
        torch.library.opcheck(linear_cross_entropy_op,
                              (h, w, b, t, -100, 0.1, reduction, 1.0, 2.0, 0.01, 2**20, "torch",
                               True, True, True))
    torch.library.opcheck(linear_cross_entropy_op, (h, w, None, t))
    lse = torch.logsumexp(F.linear(h, w, b), -1)
    torch.library.opcheck(linear_cross_entropy_backward_op,
                          (torch.randn(2, 3), h, w, b, t, lse, -100, 0.1, 1.0, None, 0.0,
                           2**20, "torch", True, False, True))


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_compiles_into_a_graph(reduction):
    h, w, b, t = _inputs((2, 5), bias=True)
    kw = dict(reduction=reduction, label_smoothing=0.1, softcap=5.0)
    compiled = torch.compile(lambda h, w, b: linear_cross_entropy(h, w, t, b, **kw),
                             backend="aot_eager", fullgraph=True)
    assert_same(compiled, lambda h, w, b: _ref(h, w, t, b, **kw), [h, w, b])


@cuda_test
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_cuda_triton_matches(dtype, reduction):
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(300, 64, device="cuda", generator=g).to(dtype).requires_grad_()
    w = (torch.randn(5000, 64, device="cuda", generator=g) / 8).to(dtype).requires_grad_()
    b = torch.randn(5000, device="cuda", generator=g).to(dtype).requires_grad_()
    t = torch.randint(0, 5000, (300,), device="cuda", generator=g)
    t[::5] = -100
    kw = dict(reduction=reduction, label_smoothing=0.1, softcap=30.0, z_loss=1e-4)
    assert_triton_matches_portable(
        lambda h, w, b, impl: linear_cross_entropy(h, w, t, b, workspace_bytes=2**20, impl=impl, **kw),
        lambda h, w, b: _ref(h, w, t, b, **kw), [h, w, b], dtype=dtype)
