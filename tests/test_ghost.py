"""Ghost clipping inside per-example chunk graphs (fxmem/per_example/ghost.py): clipped sums equal
an explicit per-example loop with ghost norms on (untied and tied weights, HF GPT-2 and Llama),
ghost on equals ghost off, the mixed rule, decisions in the report, non-matching layers left
alone, the non-finite fallback. Eager inner compiler, tiny models."""

import logging

import pytest
import torch
import torch.nn.functional as F
from helpers import load_bench_models
from torch import nn
from torch.func import functional_call, grad

import fxmem
from fxmem.dpsgd import clipped_grad, make_functional
from fxmem.report.render import per_example_lines

RTOL = 1e-5


def _opts(ghost: bool = True) -> dict:
    return {"inner": "eager", "ghost_clipping": ghost}


models = load_bench_models()


def reference(loss_fn, C, args, batch_argnums, argnum=0):
    """sum_i min(1, C / ||g_i||) g_i over an explicit loop, norms in float64; and the norms."""
    B = args[batch_argnums[0]].shape[0]
    total, norms = None, []
    for i in range(B):
        one = [a[i] if k in batch_argnums else a for k, a in enumerate(args)]
        g = grad(loss_fn, argnums=argnum)(*one)
        norm = torch.sqrt(sum((v.double() ** 2).sum() for v in g.values()))
        factor = min(1.0, C / norm.item())
        total = {k: v.double() * factor for k, v in g.items()} if total is None else \
            {k: total[k] + v.double() * factor for k, v in g.items()}
        norms.append(norm)
    return {k: v.float() for k, v in total.items()}, torch.stack(norms).float()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def assert_close(got, want, rtol=RTOL):
    assert set(got) == set(want)
    for k in want:
        assert got[k].shape == want[k].shape, k
        assert rel_err(got[k], want[k]) <= rtol, f"{k}: relative error {rel_err(got[k], want[k]):.2e}"


def median_C(loss, args, batch_argnums):
    """A clipping norm with some examples clipped and some not."""
    norms = reference(loss, 1.0, args, batch_argnums)[1]
    return round(norms.median().item(), 4)


def decisions(fn) -> list[dict]:
    return [d.summary() for d in fn.plans[-1].ghost]


# --- the bench GPT, untied and tied -------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("tied", [False, True])
def test_gpt_ghost_matches_loop_and_ghost_off(tied):
    model, params, ids, labels = models.gpt(vocab=40, d=8, layers=1, heads=2, seq=5, batch=5)
    if tied:
        model.head.weight = model.wte.weight
        params = {k: v.detach() for k, v in model.named_parameters()}  # one entry for the tied pair
    loss = models.per_example_loss(model)
    C = median_C(loss, (params, ids, labels), (1, 2))
    want, want_norms = reference(loss, C, (params, ids, labels), (1, 2))
    fn = clipped_grad(loss, C, batch_argnums=(1, 2), microbatch_size=3, return_norms=True, options=_opts())
    grads, norms = fn(params, ids, labels)  # chunks of 3 and 2: two chunk graphs
    assert_close(grads, want)
    assert rel_err(norms, want_norms) <= RTOL
    ds = decisions(fn)
    ghost = {d["param"]: d for d in ds if d["choice"] == "ghost"}
    assert "args_0_wte_weight" in ghost and "args_0_blocks_0_qkv_weight" in ghost, ds
    if tied:
        assert "tied" in ghost["args_0_wte_weight"]["kind"] and ghost["args_0_wte_weight"]["tokens"] == 10
        assert "args_0_head_weight" not in ghost
    else:
        assert ghost["args_0_head_weight"]["kind"] == "linear"
    off = clipped_grad(loss, C, batch_argnums=(1, 2), microbatch_size=3, options=_opts(False))
    assert_close(grads, off(params, ids, labels), rtol=2e-6)
    assert off.plans[-1].ghost == []


# --- Hugging Face models from configs -----------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("builder", ["hf_gpt2", "hf_llama"])
def test_hf_models_ghost_matches_loop(builder):
    from fxmem.models import build

    w = build(builder, batch=4, seq=6, vocab=48, d=16, layers=1, heads=2)
    model = w.model
    model.set_attn_implementation("eager")
    fn, trainable, frozen = make_functional(model)

    def loss(tr, fr, ids, labels):
        return fn(tr, fr, input_ids=ids[None], labels=labels[None]).loss

    ids, labels = w.batch["input_ids"], w.batch["labels"]
    C = 1.5
    want, want_norms = reference(loss, C, (trainable, frozen, ids, labels), (2, 3))
    clipped = clipped_grad(loss, C, batch_argnums=(2, 3), microbatch_size=4, return_norms=True, options=_opts())
    grads, norms = clipped(trainable, frozen, ids, labels)
    assert_close(grads, want)
    assert rel_err(norms, want_norms) <= RTOL
    ds = decisions(clipped)
    assert all(d["choice"] == "ghost" for d in ds), ds
    kinds = {d["param"]: d["kind"] for d in ds}
    if builder == "hf_gpt2":  # wte tied to lm_head: one leaf, both uses, cross terms
        assert "tied" in kinds["args_0_transformer_wte_weight"]
        assert kinds["args_0_transformer_wpe_weight"] == "embedding"
        assert kinds["args_0_transformer_h_0_attn_c_attn_weight"] == "linear"  # Conv1D: x @ W
    else:
        assert kinds["args_0_model_embed_tokens_weight"] == "embedding"
        assert kinds["args_0_lm_head_weight"] == "linear"
        assert kinds["args_0_model_layers_0_self_attn_q_proj_weight"] == "linear"


# --- the mixed rule, 2-D inputs, layers it does not know ----------------------------------------


class Mixed(nn.Module):
    """Sequence input [T, 4]: a 4 -> 3 layer (P*Q = 12 < 2 T^2: materialized), a 3 -> 40 layer
    without bias (ghost), then a per-example-vector head (T = 1: ghost), and a Conv1d (not a
    linear or embedding: left alone)."""

    def __init__(self):
        super().__init__()
        self.small = nn.Linear(4, 3)
        self.wide = nn.Linear(3, 40, bias=False)
        self.conv = nn.Conv1d(40, 6, 3, padding=1)
        self.head = nn.Linear(6, 5)

    def forward(self, x, y):
        h = torch.tanh(self.wide(torch.tanh(self.small(x))))          # [T, 40]
        h = self.conv(h.t()[None])[0].mean(1)                         # [6]
        return F.cross_entropy(self.head(h)[None], y[None])


@pytest.mark.slow
def test_mixed_rule_two_dim_inputs_and_unknown_layers():
    torch.manual_seed(0)
    model = Mixed()
    params = {k: v.detach() for k, v in model.named_parameters()}
    x, y = torch.randn(6, 5, 4), torch.randint(0, 5, (6,))

    def loss(p, x, y):
        return functional_call(model, p, (x, y))

    C = median_C(loss, (params, x, y), (1, 2))
    want, _ = reference(loss, C, (params, x, y), (1, 2))
    fn = clipped_grad(loss, C, batch_argnums=(1, 2), microbatch_size=4, options=_opts())
    assert_close(fn(params, x, y), want)
    ds = {d["param"]: d for d in decisions(fn)}
    small, wide, head = ds["args_0_small_weight"], ds["args_0_wide_weight"], ds["args_0_head_weight"]
    assert small["choice"] == "materialize" and small["tokens"] == 5 and "2*T^2 = 50 > P*Q = 12" in small["reason"]
    assert wide["choice"] == "ghost" and wide["shape"] == (40, 3)
    assert head["choice"] == "ghost" and head["tokens"] == 1
    conv = [d for d in ds.values() if d["shape"] == (6, 40, 3)]
    assert len(conv) == 1 and conv[0]["choice"] == "materialize" and conv[0]["kind"] == "other"


@pytest.mark.slow
def test_report_records_each_decision():
    model, params, ids, labels = models.gpt(vocab=40, d=8, layers=1, heads=2, seq=5, batch=4)
    loss = models.per_example_loss(model)
    fn = clipped_grad(loss, 1.0, batch_argnums=(1, 2), microbatch_size=4, options=_opts())
    fn(params, ids, labels)
    summary = fn.plans[-1].summary()
    assert len(summary["ghost"]) == 7  # wte, wpe, qkv, proj, fc, out, head
    text = "\n".join(per_example_lines([summary]))
    # wpe: [5, 8] with T = 5 positions: 2*T^2 = 50 > 40, cheaper to materialize
    assert "ghost clipping: 6 of 7 per-example weight gradients never materialized" in text
    assert "args_0_wpe_weight (embedding, 5x8, T=5): materialize (2*T^2 = 50 > P*Q = 40" in text
    assert "args_0_head_weight (linear, 40x8, T=5): ghost (2*T^2 = 50 <= P*Q = 320)" in text
    rep = fxmem.report(fn.compiled)
    assert rep.per_example[-1]["ghost"] == summary["ghost"]
    assert "ghost clipping" in str(rep)


# --- non-finite values: the chunk reruns with materialized gradients -----------------------------


def test_nonfinite_chunk_falls_back_to_materialized(caplog):
    torch.manual_seed(0)
    lin1, lin2 = nn.Linear(4, 8), nn.Linear(8, 3)
    params = {"w1": lin1.weight.detach(), "b1": lin1.bias.detach(), "w2": lin2.weight.detach()}

    def loss(p, x):
        h = torch.tanh(x @ p["w1"].t() + p["b1"])   # [T, 8]
        return (h @ p["w2"].t()).square().mean()

    x = torch.randn(6, 2, 4)
    x[4, 1, 2] = float("inf")   # example 4: the w1 gradient has inf/nan elements (nan_to_num -> 0)
    got = clipped_grad(loss, 1.0, microbatch_size=3, options=_opts())
    with caplog.at_level(logging.WARNING, logger="fxmem"):
        g_on = got(params, x)
    off = clipped_grad(loss, 1.0, microbatch_size=3, options=_opts(False))(params, x)
    assert any(d.choice == "ghost" for d in got.plans[-1].ghost)
    assert all(torch.isfinite(v).all() for v in g_on.values())
    assert_close(g_on, off, rtol=1e-6)
    assert "rerunning it with materialized per-example gradients" in caplog.text


def test_chunk_graphs_fuse_the_loss_only_when_it_is_asked_for():
    """With ghost clipping, a per-example chunk's fused cross-entropy would materialize the output
    projection's per-example weight gradient: a lowering dict that leaves the pattern out (the
    default) leaves it unfused there; lowering=True or naming it fuses it."""
    from fxmem.options import resolve
    from fxmem.per_example.stage import chunk_lowering as _chunk_lowering

    lce = "fused_linear_cross_entropy"
    assert dict(_chunk_lowering(resolve({}, env={}))) == {"dropout": False, lce: False}
    assert _chunk_lowering(resolve({"lowering": True}, env={})) is True
    assert _chunk_lowering(resolve({"lowering": False}, env={})) is False
    assert dict(_chunk_lowering(resolve({"lowering": {lce: True}}, env={}))) == {lce: True}
    assert dict(_chunk_lowering(resolve({"ghost_clipping": False}, env={}))) == {"dropout": False}


def test_all_finite_catches_every_non_finite_output():
    from fxmem.per_example.ghost import _all_finite

    ok = [torch.ones(5), torch.zeros(3, dtype=torch.bfloat16), torch.arange(4)]  # ints are skipped
    assert _all_finite(ok) and _all_finite([]) and _all_finite([torch.arange(3)])
    for bad in (float("inf"), -float("inf"), float("nan")):
        x = torch.ones(6)
        x[2] = bad
        assert not _all_finite([torch.ones(2), x])
    both = torch.ones(4)
    both[0], both[1] = float("inf"), -float("inf")  # cancels to nan, still caught
    assert not _all_finite([both])
    # half precision: summed in float32, so a large finite tensor does not overflow into a fallback
    assert _all_finite([torch.full((8,), 60000.0, dtype=torch.float16)])


# --- a ghost rewrite that fails: the failure policy ----------------------------------------------


def _linear_step(options):
    """One linear layer on 2 tokens per example: a ghost norm (2*T^2 = 8 <= P*Q = 12)."""
    torch.manual_seed(0)
    params = {"w": torch.randn(3, 4)}

    def loss(p, x):
        return (x @ p["w"].t()).square().mean()

    return loss, params, torch.randn(5, 2, 4), clipped_grad(loss, 0.1, microbatch_size=3, options=options)


def test_a_failing_ghost_rewrite_raises_under_strict_and_else_warns_once_and_materializes(monkeypatch):
    """A ghost rewrite that raises is a stage failure (``fxmem/fallback.py``, stage "ghost"): under
    ``strict`` its error reaches the caller; otherwise one RuntimeWarning naming the stage, and
    the chunk runs with materialized per-example gradients: the loop's sums, no ghost decision."""
    import fxmem.per_example.ghost.hook as hook

    def boom(*args, **kwargs):
        raise RuntimeError("injected ghost failure")

    monkeypatch.setattr(hook, "rewrite", boom)
    loss, params, x, strict = _linear_step({**_opts(), "strict": True})
    with pytest.raises(RuntimeError, match="injected ghost failure"):
        strict(params, x)
    loss, params, x, step = _linear_step(_opts())
    with pytest.warns(RuntimeWarning) as caught:
        got = step(params, x)
    failed = [str(w.message) for w in caught if "stage 'ghost' failed" in str(w.message)]
    assert len(failed) == 1 and "injected ghost failure" in failed[0] and "no ghost norms" in failed[0], \
        [str(w.message) for w in caught]
    assert not [w for w in caught if "unchunked" in str(w.message)]
    assert step.chosen_microbatch_size() == 3 and step.plans[-1].ghost == []
    want, _ = reference(loss, 0.1, (params, x), (1,))
    assert_close(got, want)
    monkeypatch.undo()  # the same step with a working rewrite: a ghost norm, the same sums
    loss, params, x, ghost = _linear_step(_opts())
    assert_close(ghost(params, x), want)
    assert [d.choice for d in ghost.plans[-1].ghost] == ["ghost"]
