"""fxmem.dpsgd: clipped per-example gradient sums against an explicit per-example loop, for every
microbatch size; HF models; make_functional; noise; accounting against opacus; the sensitivity
property; argument errors. Every compile uses the eager inner compiler (Inductor: 30-60 s each)."""

import contextlib
import math
import warnings

import pytest
import torch
from helpers import load_bench_models
from hypothesis import given
from hypothesis import strategies as st
from torch.func import grad

from fxmem.dpsgd import (
    PrivacyAccountant,
    UnsupportedModuleError,
    add_noise,
    clipped_grad,
    epsilon,
    fix,
    make_functional,
    noise_multiplier_for,
)

EAGER = {"inner": "eager"}
RTOL = 1e-5


models = load_bench_models()


# --- the reference: an explicit per-example Python loop ---------------------------------------


def reference(loss_fn, C, args, batch_argnums, argnum=0):
    """sum_i min(1, C / ||g_i||) g_i, with g_i = grad(loss_fn)(args at example i); norms; losses."""
    B = args[batch_argnums[0]].shape[0]
    total, norms, losses = None, [], []
    for i in range(B):
        one = [a[i] if k in batch_argnums else a for k, a in enumerate(args)]
        g = grad(loss_fn, argnums=argnum)(*one)
        losses.append(loss_fn(*one).detach())
        norm = torch.sqrt(sum((v.double() ** 2).sum() for v in g.values())).float()
        factor = min(1.0, C / norm.item())
        total = {k: v * factor for k, v in g.items()} if total is None else \
            {k: total[k] + v * factor for k, v in g.items()}
        norms.append(norm)
    return total, torch.stack(norms), torch.stack(losses)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def assert_grads_close(got, want, rtol=RTOL):
    assert set(got) == set(want)
    for k in want:
        assert got[k].shape == want[k].shape, k
        assert rel_err(got[k], want[k]) <= rtol, f"{k}: relative error {rel_err(got[k], want[k]):.2e}"


def l2(tree) -> float:
    return math.sqrt(sum((v.double() ** 2).sum().item() for v in tree.values()))


# --- a tiny plain GPT, every microbatch size --------------------------------------------------

B_GPT = 10


@pytest.fixture(scope="module")
def tiny_gpt():
    model, params, ids, labels = models.gpt(vocab=32, d=8, layers=1, heads=2, seq=4, batch=B_GPT)
    loss = models.per_example_loss(model)
    norms = reference(loss, 1.0, (params, ids, labels), (1, 2))[1]
    C = round(norms.median().item(), 4)  # some examples clipped, some not
    want = reference(loss, C, (params, ids, labels), (1, 2))
    assert (want[1] > C).any() and (want[1] < C).any()
    return loss, C, params, ids, labels, want


@pytest.mark.slow
@pytest.mark.parametrize("microbatch_size", [None, 1, 3, 8, B_GPT])
def test_gpt_clipped_sum_matches_loop(tiny_gpt, microbatch_size):
    loss, C, params, ids, labels, (want, want_norms, want_losses) = tiny_gpt
    fn = clipped_grad(loss, C, batch_argnums=(1, 2), microbatch_size=microbatch_size,
                      return_norms=True, return_losses=True, options=EAGER)
    grads, norms, losses = fn(params, ids, labels)
    assert_grads_close(grads, want)
    assert norms.shape == losses.shape == (B_GPT,)
    assert rel_err(norms, want_norms) <= RTOL
    assert rel_err(losses, want_losses) <= RTOL
    again = fn(params, ids, labels)[0]  # second call: the compiled graph, no recompile
    assert_grads_close(again, want)
    assert fn.chosen_microbatch_size() == (None if microbatch_size is None else microbatch_size), fn.plans


def _poisson_sizes(steps: int, mean: float, seed: int = 0) -> list[int]:
    """Batch sizes of Poisson sampling (each example in with probability q: a binomial, ~Poisson),
    one of them 0."""
    g = torch.Generator().manual_seed(seed)
    sizes = [int(s) for s in torch.poisson(torch.full((steps - 1,), mean), generator=g)]
    return sizes[:3] + [0] + sizes[3:]


@pytest.mark.slow
def test_poisson_batches_run_on_one_compile_and_match_the_loop(monkeypatch):
    """Poisson sampling: 20 batch sizes around 32 (one 0) run on at most 2 compiles (Dynamo
    graphs plus fxmem chunk graphs), each step equal to the per-example loop, and the step's peak
    is the microbatch's, not the batch's."""
    from torch._dynamo.utils import counters

    import fxmem.per_example.stage
    from fxmem.profiling import step_perf

    model, params, _, _ = models.gpt(vocab=32, d=8, layers=1, heads=2, seq=4, batch=1)
    loss = models.per_example_loss(model)
    chunk_compiles = []
    real = fxmem.per_example.stage.compile_chunk
    monkeypatch.setattr(fxmem.per_example.stage, "compile_chunk",
                        lambda *a, **k: chunk_compiles.append(a[1]) or real(*a, **k))
    C, m = 0.05, 8
    fn = clipped_grad(loss, C, batch_argnums=(1, 2), microbatch_size=m, return_norms=True, options=EAGER)
    graphs_before = counters["stats"]["unique_graphs"]
    g = torch.Generator().manual_seed(1)
    sizes = _poisson_sizes(20, 32.0)
    assert 0 in sizes and len(set(sizes)) > 8  # more sizes than Dynamo's recompile_limit
    for b in sizes:
        ids = torch.randint(0, 32, (b, 4), generator=g)
        grads, norms = fn(params, ids, ids)
        assert norms.shape == (b,)
        if b == 0:
            assert all((v == 0).all() for v in grads.values())
            continue
        want, want_norms, _ = reference(loss, C, (params, ids, ids), (1, 2))
        assert_grads_close(grads, want)
        assert rel_err(norms, want_norms) <= RTOL
    graphs = counters["stats"]["unique_graphs"] - graphs_before
    assert graphs + len(chunk_compiles) <= 2, (graphs, len(chunk_compiles))
    assert len(fxmem.compilations(fn.compiled)) == 1 and fn.chosen_microbatch_size() == m

    # Sensitivity C with padding: dropping the last example of a padded batch moves the sum by <= C.
    ids = torch.randint(0, 32, (13, 4), generator=g)
    full, fewer = fn(params, ids, ids)[0], fn(params, ids[:-1], ids[:-1])[0]
    assert l2({k: full[k] - fewer[k] for k in full}) <= C * (1 + 1e-5)

    def peak(b):
        ids = torch.randint(0, 32, (b, 4), generator=g)
        with step_perf("cpu") as perf:
            out = fn(params, ids, ids)
        del out
        return perf.result.peak_bytes

    # Five chunks peak as one does, up to a param-sized buffer or two (the running sums), far
    # below the 37 examples' per-example gradients that an unchunked step holds.
    one_chunk, five_chunks = peak(m), peak(5 * m - 3)
    param_bytes = sum(v.numel() * v.element_size() for v in params.values())
    assert five_chunks - one_chunk <= 2 * param_bytes < (5 * m - 3) * param_bytes / 10, (one_chunk, five_chunks)


def test_same_sums_as_opake(tiny_gpt):
    """opake's clipped_grad (the semantics fxmem.dpsgd follows) gives the reference's sums."""
    opake_clipping = pytest.importorskip("opake.dpsgd.clipping")
    loss, C, params, ids, labels, (want, _, _) = tiny_gpt
    fn, state = opake_clipping.clipped_grad(loss, clipping_norm=C, batch_argnums=(1, 2), microbatch_size=4)
    out, _ = fn(params, ids, labels, state=state)
    assert_grads_close(out.pytree, want)


def test_nonfinite_gradient_elements_count_as_zero():
    def loss(p, x):
        return (p["w"] * x).sum() + (p["b"] * x.sum()).sum()  # grad wrt w is x: nan/inf pass through

    x = torch.tensor([[1.0, 2.0, 2.0], [float("nan"), 3.0, 4.0], [float("inf"), 0.0, 0.0], [0.1, 0.1, 0.1]])
    p = {"w": torch.ones(3), "b": torch.ones(2)}
    grads, norms = clipped_grad(loss, 1.0, microbatch_size=2, return_norms=True, options=EAGER)(p, x)
    def clean(t):
        return torch.nan_to_num(t, nan=0.0, posinf=0.0, neginf=0.0)

    g_w, g_b = clean(x), clean(x.sum(1))[:, None].expand(4, 2)  # elementwise: each leaf's own
    want_norms = torch.sqrt((g_w ** 2).sum(1) + (g_b ** 2).sum(1))
    factor = (1.0 / want_norms).clamp(max=1.0)
    assert torch.isfinite(grads["w"]).all() and torch.isfinite(grads["b"]).all()
    assert rel_err(norms, want_norms) <= RTOL
    assert rel_err(grads["w"], (g_w * factor[:, None]).sum(0)) <= RTOL
    assert rel_err(grads["b"], (g_b * factor[:, None]).sum(0)) <= RTOL


def test_bfloat16_params_sum_in_float32():
    torch.manual_seed(0)
    p32 = {"w": torch.randn(4, 3), "b": torch.randn(3)}
    x, y = torch.randn(6, 4), torch.randn(6, 3)

    def loss(p, x, y):
        return ((x @ p["w"] + p["b"] - y) ** 2).sum()

    p16 = {k: v.bfloat16() for k, v in p32.items()}
    grads = clipped_grad(loss, 2.0, batch_argnums=(1, 2), microbatch_size=4, options=EAGER)(
        p16, x.bfloat16(), y.bfloat16())
    want, _, _ = reference(loss, 2.0, ({k: v.float() for k, v in p16.items()}, x.bfloat16().float(),
                                       y.bfloat16().float()), (1, 2))
    assert all(g.dtype == torch.bfloat16 for g in grads.values())
    assert_grads_close({k: v.float() for k, v in grads.items()}, want, rtol=2e-2)


@pytest.mark.slow
def test_bf16_autocast_sums_within_2e2_of_fp32_and_every_clipped_norm_within_C(tiny_gpt):
    """Under CPU bf16 autocast the model's matmuls run in bf16, but the per-example gradients of
    the fp32 parameters, their norms, clip factors and sums stay fp32: the sums are within 2e-2
    of the fp32 loop, and each example's clipped gradient (a batch of one: the same compiled
    chunk, padded) has norm <= C."""
    loss, C, params, ids, labels, (want, want_norms, _) = tiny_gpt
    fn = clipped_grad(loss, C, batch_argnums=(1, 2), microbatch_size=4, return_norms=True, options=EAGER)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        grads, norms = fn(params, ids, labels)
        singles = [fn(params, ids[i:i + 1], labels[i:i + 1])[0] for i in range(B_GPT)]
    assert fn.chosen_microbatch_size() == 4 and len(fn.plans) == 1
    assert all(g.dtype == torch.float32 for g in grads.values()) and norms.dtype == torch.float32
    assert_grads_close(grads, want, rtol=2e-2)
    assert rel_err(norms, want_norms) <= 2e-2
    assert 0 < rel_err(norms, want_norms)  # bf16 did run: not the fp32 result
    assert (norms > C).any()  # some examples were clipped
    for one in singles:
        assert l2(one) <= C
    summed = {k: sum(one[k] for one in singles) for k in grads}
    assert_grads_close(grads, summed, rtol=1e-5)  # the batch's sum is the sum of its examples'


def _mlp_task(batch=32):
    torch.manual_seed(0)
    p = {"w1": torch.randn(64, 256) * 0.1, "b1": torch.zeros(256), "w2": torch.randn(256, 64) * 0.1}
    x, y = torch.randn(batch, 64), torch.randn(batch, 64)

    def loss(p, x, y):
        return ((torch.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] - y) ** 2).sum()

    return loss, p, x, y


@pytest.mark.slow
def test_auto_picks_a_fixed_chunk_that_fits_with_at_most_two_compiles_and_keeps_it():
    from torch._dynamo.utils import counters

    from fxmem.profiling import step_perf

    loss, p, x, y = _mlp_task()
    budget = 1_500_000  # per-example gradients: 132 KB each, so the whole batch (4.2 MB) does not fit
    graphs_before = counters["stats"]["unique_graphs"]
    fn = clipped_grad(loss, 1.0, batch_argnums=(1, 2), microbatch_size="auto", memory_budget=budget,
                      options={**EAGER, "ghost_clipping": False})
    grads = fn(p, x, y)
    choice = fn.auto
    assert 1 < choice.chosen < 32 and fn.chosen_microbatch_size() == choice.chosen
    assert 1 <= len(choice.measured) <= 2 and choice.measured[choice.chosen] <= budget
    assert counters["stats"]["unique_graphs"] - graphs_before == len(choice.measured)
    assert_grads_close(grads, reference(loss, 1.0, (p, x, y), (1, 2))[0])
    with step_perf("cpu") as perf:
        out = fn(p, x, y)
    del out
    assert perf.result.peak_bytes <= budget
    for b in (5, 40, 17):  # the choice is kept: other batch sizes, no new compile
        got = fn(p, torch.randn(b, 64), torch.randn(b, 64))
        assert set(got) == set(p)
    assert counters["stats"]["unique_graphs"] - graphs_before == len(choice.measured)
    assert fn.auto is choice

    tiny = clipped_grad(loss, 1.0, batch_argnums=(1, 2), microbatch_size="auto", memory_budget=1000,
                        options=EAGER)
    with pytest.raises(MemoryError, match="memory_budget 1000 bytes is below the peak of one example"):
        tiny(p, x, y)


def test_return_flags_and_empty_batch(tiny_gpt):
    loss, C, params, ids, labels, (want, want_norms, _) = tiny_gpt
    only = clipped_grad(loss, C, batch_argnums=(1, 2), options=EAGER)
    assert isinstance(only(params, ids[:0], labels[:0]), dict)  # empty batch: zeros, no compile
    assert all((v == 0).all() for v in only(params, ids[:0], labels[:0]).values())
    g, n = clipped_grad(loss, C, batch_argnums=(1, 2), return_norms=True, options=EAGER)(
        params, ids[:0], labels[:0])
    assert n.shape == (0,) and set(g) == set(params)


# --- Hugging Face models from configs ---------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("builder", ["hf_gpt2", "hf_llama"])
def test_hf_models_through_functional_call(builder):
    from fxmem.models import build

    w = build(builder, batch=4, seq=6, vocab=48, d=16, layers=1, heads=2)
    model = w.model
    model.set_attn_implementation("eager")  # vmap has batching rules for eager attention's ops
    fn, trainable, frozen = make_functional(model)

    def loss(tr, fr, ids, labels):
        return fn(tr, fr, input_ids=ids[None], labels=labels[None]).loss

    ids, labels = w.batch["input_ids"], w.batch["labels"]
    C = 1.5
    want, want_norms, _ = reference(loss, C, (trainable, frozen, ids, labels), (2, 3))
    clipped = clipped_grad(loss, C, batch_argnums=(2, 3), microbatch_size=2, return_norms=True,
                           options=EAGER)
    grads, norms = clipped(trainable, frozen, ids, labels)
    assert clipped.chosen_microbatch_size() == 2, clipped.plans
    assert_grads_close(grads, want)
    assert rel_err(norms, want_norms) <= RTOL



@pytest.mark.slow
def test_a_chunk_traced_once_equals_aotautograds_trace_bit_for_bit(monkeypatch, recwarn):
    """With the eager inner compiler a per-example chunk is traced in one pass (``inner.trace_flat``)
    where AOTAutograd runs it twice: on an HF GPT-2 with its dropout on, the clipped sums are the
    ones AOTAutograd's graph gives, bit for bit (same seed), with no warning from the trace; a
    graph that writes into an input is left to AOTAutograd (its copy-back)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    import fxmem.inner as inner

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=16,
                                       use_cache=False, eos_token_id=0, bos_token_id=0))
    fn, trainable, frozen = make_functional(model)
    ids = torch.randint(0, 64, (5, 8))

    def loss(p, ids, labels):
        return fn(p, frozen, input_ids=ids[None], labels=labels[None]).loss

    traced = []
    one_pass = inner.trace_flat

    def spy(gm, example_inputs):
        traced.append(one_pass(gm, example_inputs))
        return traced[-1]

    def sums(tracer):
        monkeypatch.setattr(inner, "trace_flat", tracer)
        step = clipped_grad(loss, 1.0, batch_argnums=(1, 2), microbatch_size=2, options=EAGER)
        torch.manual_seed(1)
        return step(trainable, ids, ids)

    once = sums(spy)
    assert traced and all(g is not None for g in traced)
    assert not [w for w in recwarn if "Anomaly" in str(w.message)]  # the trace's anomaly mode stays quiet
    twice = sums(lambda gm, example_inputs: None)
    for k in once:
        assert torch.equal(once[k], twice[k]), k

    def writes_its_input(x):
        x.add_(1)
        return (x * 2,)

    gm = torch.fx.symbolic_trace(writes_its_input)
    assert inner.trace_flat(gm, [torch.zeros(3)]) is None


def test_the_clipping_epilogue_is_one_node_in_dynamos_graph(tiny_gpt, monkeypatch):
    """Dynamo keeps ``clip_and_sum`` as one call (tracing its ~10 ops per parameter was a third of
    a second of the README block's first call): after the vmap region the graph holds that call
    and its outputs, no per-leaf norm or sum; the per-example pass takes every sum as a matvec,
    and the sums and norms are the loop's."""
    import fxmem.per_example.stage as per_example
    from fxmem.per_example.clip import clip_and_sum

    graphs = []
    split = per_example.split_region
    monkeypatch.setattr(per_example, "split_region", lambda gm, region: graphs.append((gm, region)) or
                        split(gm, region))
    loss, C, params, ids, labels, (want, want_norms, _) = tiny_gpt
    step = clipped_grad(loss, C, batch_argnums=(1, 2), microbatch_size=4, return_norms=True, options=EAGER)
    grads, norms = step(params, ids, labels)
    ((gm, region),) = graphs
    nodes = list(gm.graph.nodes)
    after = [n for n in nodes[nodes.index(region.end) + 1:] if n.op == "call_function"]
    assert [n.target for n in after].count(clip_and_sum) == 1
    assert {getattr(n.target, "__name__", n.target) for n in after} <= {"clip_and_sum", "getitem"}
    assert step.plans[-1].chunked and step.plans[-1].fused_sums == len(params)
    assert_grads_close(grads, want)
    assert rel_err(norms, want_norms) <= RTOL


@pytest.mark.slow
def test_the_default_inductor_inner_compiler_gives_the_loops_clipped_sums():
    """Default options (the Inductor inner compiler): chunks of 2 over 5 examples (the last one
    padded), the clipping epilogue compiled by Inductor, sums and norms within 1e-5 of the loop."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    params = {k: v.detach() for k, v in model.named_parameters()}
    x, y = torch.randn(5, 6), torch.randint(0, 3, (5,))

    def loss(p, x, y):
        return torch.nn.functional.cross_entropy(torch.func.functional_call(model, p, (x[None],)), y[None])

    C = 2.0
    want, want_norms, _ = reference(loss, C, (params, x, y), (1, 2))
    assert (want_norms > C).any() and (want_norms < C).any()
    step = clipped_grad(loss, C, batch_argnums=(1, 2), microbatch_size=2, return_norms=True)
    grads, norms = step(params, x, y)
    assert step.chosen_microbatch_size() == 2 and step.options.get("inner") is None
    assert_grads_close(grads, want)
    assert rel_err(norms, want_norms) <= RTOL


_SWAP_MODEL = torch.nn.Sequential(torch.nn.Linear(3, 2))
_swap_fn, _swap_trainable, _swap_frozen = make_functional(_SWAP_MODEL)


def _swap_loss(p, x):  # module level, as in a script: Dynamo reaches the swapped dicts through globals
    return _swap_fn(p, _swap_frozen, x[None]).square().sum()


@contextlib.contextmanager
def _no_listener_on_the_trace_log():
    """The structured-trace logger as a plain process has it: pytest >= 9.2 attaches its capture
    handlers to every non-propagating logger (torch's ``trace_log`` too), and a handler there is
    a listener that fxmem must respect; detached for the block, put back after it."""
    from torch._logging._internal import LazyTraceHandler, trace_log

    captured = [h for h in trace_log.handlers if not isinstance(h, LazyTraceHandler)]
    for handler in captured:
        trace_log.removeHandler(handler)
    try:
        yield
    finally:
        for handler in captured:
            trace_log.addHandler(handler)


def test_side_effect_messages_are_formatted_only_when_someone_listens(monkeypatch):
    """The step's parameter swap mutates a dict per module. Dynamo formats a message with the
    user's stack for each (a tenth of a second on the README model's first call) only when
    ``TORCH_LOGS=side_effects`` (or a trace) would show it; the user's policy is back after the
    call, and the swap's effects are replayed either way (the module keeps its own tensors)."""
    from torch._dynamo.side_effects import SideEffects

    formatted = []
    real = SideEffects._format_side_effect_message
    monkeypatch.setattr(SideEffects, "_format_side_effect_message",
                        lambda self, var: formatted.append(var) or real(self, var))
    own = dict(_SWAP_MODEL.named_parameters())
    x = torch.randn(4, 3)
    with _no_listener_on_the_trace_log():
        clipped_grad(_swap_loss, 1.0, microbatch_size=2, options=EAGER)(_swap_trainable, x)
    assert not formatted and torch._dynamo.config.side_effect_replay_policy == "info"
    assert all(p is own[k] for k, p in _SWAP_MODEL.named_parameters())
    # TORCH_LOGS=side_effects, as fxmem sees it (torch._logging.set_logs would reconfigure every
    # registered logger, fxmem's too, for the rest of the process)
    from torch._logging._internal import log_state

    enabled = log_state.is_artifact_enabled
    monkeypatch.setattr(log_state, "is_artifact_enabled", lambda name: name == "side_effects" or enabled(name))
    clipped_grad(_swap_loss, 1.0, microbatch_size=2, options=EAGER)(_swap_trainable, x)
    assert formatted


@pytest.mark.parametrize("microbatch_size", [None, 2])
def test_a_second_sequence_length_compiles_anew_with_dropout_on(microbatch_size):
    """A new sequence length is a new static compile: with Dynamo's automatic dynamic shapes the
    second length made the sequence dim symbolic, and functorch's dropout under ``vmap`` failed
    on it (``Cannot call numel() on tensor with symbolic sizes``). The sums at the second length
    are the ones a step compiled for that length alone gives (same seed), bit for bit."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=16,
                                       use_cache=False, eos_token_id=0, bos_token_id=0))
    fn, trainable, frozen = make_functional(model)

    def loss(p, ids, labels):
        return fn(p, frozen, input_ids=ids[None], labels=labels[None]).loss

    def step():
        return clipped_grad(loss, 1.0, batch_argnums=(1, 2), microbatch_size=microbatch_size, options=EAGER)

    ids = torch.randint(0, 64, (4, 8))
    reused = step()
    reused(trainable, ids, ids)
    short = ids[:, :6]
    torch.manual_seed(1)
    got = reused(trainable, short, short)
    torch.manual_seed(1)
    want = step()(trainable, short, short)
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_clip_and_sum_on_a_value_that_is_not_per_example_is_not_chunked():
    """``clip_and_sum`` given a tensor without the batch (here a parameter) cannot be split by
    examples: the per-example pass says so and the step runs unchunked, still correct."""
    from torch.func import grad_and_value, vmap

    from fxmem.per_example.clip import clip_and_sum

    def loss(w, x):
        return (w * x).sum() ** 2

    def step(w, x):
        g, _ = vmap(grad_and_value(loss), in_dims=(None, 0))(w, x)
        *sums, norms = clip_and_sum(1.0, False, g, w.expand(x.shape[0], -1))
        return sums[0], norms

    w, x = torch.randn(3), torch.randn(4, 3)
    compiled = torch.compile(step, backend="fxmem", options={**EAGER, "microbatch_size": 2})
    with torch.no_grad(), pytest.warns(UserWarning, match="not chunking this graph: .*clip_and_sum.*not per "
                                                          "example along dim 0"):
        got, norms = compiled(w, x)
    want, want_norms = step(w, x)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(norms, want_norms)


# --- make_functional --------------------------------------------------------------------------


class LoRALinear(torch.nn.Module):
    def __init__(self, d_in, d_out, r=2):
        super().__init__()
        self.base = torch.nn.Linear(d_in, d_out)
        self.base.requires_grad_(False)
        self.a = torch.nn.Parameter(torch.randn(d_in, r) * 0.3)
        self.b = torch.nn.Parameter(torch.randn(r, d_out) * 0.3)
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, x):
        return self.base(x) + self.scale * (x @ self.a @ self.b)


def test_make_functional_partitions_trainable_and_frozen():
    torch.manual_seed(0)
    model = torch.nn.Sequential(LoRALinear(5, 4), torch.nn.Tanh(), LoRALinear(4, 3))
    fn, trainable, frozen = make_functional(model)
    assert set(trainable) == {"0.a", "0.b", "2.a", "2.b"}
    assert set(frozen) == {"0.base.weight", "0.base.bias", "2.base.weight", "2.base.bias",
                           "0.scale", "2.scale"}
    assert trainable["0.a"] is model[0].a  # the module's own tensors, not copies
    x = torch.randn(7, 5)
    torch.testing.assert_close(fn(trainable, frozen, x), model(x))

    _, all_tr, buffers = make_functional(model, partition_trainable=False)
    assert set(all_tr) == {n for n, _ in model.named_parameters()}
    assert set(buffers) == {"0.scale", "2.scale"}

    y = torch.randint(0, 3, (7,))

    def loss(tr, fr, x, y):
        return torch.nn.functional.cross_entropy(fn(tr, fr, x[None]), y[None])

    want, _, _ = reference(loss, 0.2, (trainable, frozen, x, y), (2, 3))
    grads = clipped_grad(loss, 0.2, batch_argnums=(2, 3), microbatch_size=4, options=EAGER)(
        trainable, frozen, x, y)
    assert set(grads) == set(trainable)  # per-example gradients for the adapters only
    assert_grads_close(grads, want)



def test_make_functional_swaps_tied_weights_and_follows_a_replaced_submodule():
    """``fn`` swaps the given tensors into the module itself (a slot list made once, which Dynamo
    traces faster than ``functional_call``'s walk of the module tree), with ``functional_call``'s
    results: a tied weight takes the value given under its first name; the module's own tensors
    are back after the call; a submodule replaced after ``make_functional`` is used (the call
    goes through ``functional_call`` then), which also judges names the module does not have."""
    torch.manual_seed(0)

    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(6, 4)
            self.mid = torch.nn.Linear(4, 4)
            self.head = torch.nn.Linear(4, 6, bias=False)
            self.head.weight = self.emb.weight  # tied: named once, as "emb.weight"

        def forward(self, ids):
            return self.head(torch.tanh(self.mid(self.emb(ids))))

    model = Tied()
    fn, trainable, frozen = make_functional(model)
    assert "head.weight" not in trainable
    ids = torch.tensor([[1, 2, 5]])
    new = {k: torch.randn_like(v) for k, v in trainable.items()}
    own = dict(model.named_parameters())
    torch.testing.assert_close(fn(new, frozen, ids), torch.func.functional_call(model, {**frozen, **new}, (ids,)),
                               rtol=0, atol=0)
    assert all(p is own[n] for n, p in model.named_parameters())  # the module's own tensors are back
    assert model.head.weight is model.emb.weight

    model.mid = torch.nn.Linear(4, 4)  # replaced after make_functional: its own weights now
    new["mid.weight"] = torch.randn(4, 4)
    torch.testing.assert_close(fn(new, frozen, ids), torch.func.functional_call(model, {**frozen, **new}, (ids,)),
                               rtol=0, atol=0)
    assert not torch.equal(fn(new, frozen, ids), fn(trainable, frozen, ids))
    with pytest.raises(AttributeError, match="has no attribute `not`"):  # as functional_call says it
        fn({**new, "not.a.parameter": torch.zeros(1)}, frozen, ids)


class _Recurrent(torch.nn.Module):
    """A plain nn.RNN/GRU/LSTM (2 layers, batch_first) and a linear head on the last step."""

    def __init__(self, cls):
        super().__init__()
        self.rnn = cls(3, 4, num_layers=2, batch_first=True)
        self.head = torch.nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.rnn(x)[0][:, -1])


@pytest.mark.parametrize("cls", [torch.nn.RNN, torch.nn.GRU, torch.nn.LSTM])
def test_make_functional_runs_plain_recurrent_layers_as_cell_loops_in_chunks(cls):
    """Without ``fix()``: the function computes nn.RNN/GRU/LSTM as their cell loops (vmap has no
    batching rule for the fused RNN/GRU kernels; LSTM's breaks the graph), so ``clipped_grad``
    runs in chunks of 3 with no "unchunked" warning and its sums equal a per-example loop
    through the user's own fused module. The module is not changed: same parameters, same
    state_dict keys, still the fused class."""
    torch.manual_seed(0)
    model = _Recurrent(cls)
    keys, own = list(model.state_dict()), dict(model.named_parameters())
    fn, trainable, frozen = make_functional(model)
    assert type(model.rnn) is cls and list(model.state_dict()) == keys
    assert trainable.keys() == own.keys() and all(trainable[k] is p for k, p in own.items())
    x, y = torch.randn(7, 5, 3), torch.randint(0, 2, (7,))
    torch.testing.assert_close(fn(trainable, frozen, x), model(x))

    def loss(tr, fr, x, y):
        return torch.nn.functional.cross_entropy(fn(tr, fr, x[None]), y[None])

    def fused_loss(tr, fr, x, y):  # the reference: the user's nn.RNN/GRU/LSTM itself
        out = torch.func.functional_call(model, {**fr, **tr}, (x[None],))
        return torch.nn.functional.cross_entropy(out, y[None])

    C = round(reference(fused_loss, 1.0, (trainable, frozen, x, y), (2, 3))[1].median().item(), 4)
    want, want_norms, _ = reference(fused_loss, C, (trainable, frozen, x, y), (2, 3))
    assert (want_norms > C).any() and (want_norms < C).any()  # some examples clipped, some not
    step = clipped_grad(loss, C, batch_argnums=(2, 3), microbatch_size=3, options=EAGER)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        grads = step(trainable, frozen, x, y)
    assert not [str(w.message) for w in caught if "unchunked" in str(w.message)]
    assert step.chosen_microbatch_size() == 3
    assert_grads_close(grads, want)
    assert all(p is own[n] for n, p in model.named_parameters())


def test_make_functional_refuses_batchnorm_naming_the_module_and_fix():
    """The validator make_private runs: BatchNorm (batch statistics) is refused with its
    UnsupportedModuleError naming the module and ``fxmem.dpsgd.fix()``, not a Dynamo error at the
    first step; the fixed copy (GroupNorm) trains; ``strict=False`` skips the check."""
    model = torch.nn.Sequential(torch.nn.Conv1d(2, 4, 1, bias=False), torch.nn.BatchNorm1d(4), torch.nn.Flatten(),
                                torch.nn.Linear(12, 2))
    with pytest.raises(UnsupportedModuleError, match=r"(?s)1: BatchNorm1d.*GroupNorm.*fxmem\.dpsgd\.fix\("):
        make_functional(model)
    make_functional(model, strict=False)
    fn, trainable, frozen = make_functional(fix(model))

    def loss(tr, fr, x, y):
        return torch.nn.functional.cross_entropy(fn(tr, fr, x[None]), y[None])

    x, y = torch.randn(5, 2, 3), torch.randint(0, 2, (5,))
    want, _, _ = reference(loss, 0.5, (trainable, frozen, x, y), (2, 3))
    assert_grads_close(clipped_grad(loss, 0.5, batch_argnums=(2, 3), microbatch_size=3, options=EAGER)(
        trainable, frozen, x, y), want)


# --- noise ------------------------------------------------------------------------------------


def test_add_noise_statistics_and_reproducibility():
    grads = {"w": torch.zeros(1000, 1000), "b": torch.full((3,), 2.0)}
    sigma, C = 1.3, 0.7
    noisy = add_noise(grads, sigma, C, generator=torch.Generator().manual_seed(1))
    assert set(noisy) == {"w", "b"} and noisy["w"].shape == (1000, 1000)
    assert (grads["w"] == 0).all()  # not modified in place
    std = noisy["w"].std().item()
    assert abs(std - sigma * C) / (sigma * C) < 0.01
    assert abs(noisy["w"].mean().item()) < 0.01 * sigma * C
    same = add_noise(grads, sigma, C, generator=torch.Generator().manual_seed(1))
    assert all(torch.equal(noisy[k], same[k]) for k in grads)
    other = add_noise(grads, sigma, C, generator=torch.Generator().manual_seed(2))
    assert not torch.equal(noisy["w"], other["w"])
    zero = add_noise(grads, 0.0, C)
    assert all(torch.equal(zero[k], grads[k]) for k in grads)
    half = add_noise({"h": torch.zeros(10_000, dtype=torch.bfloat16)}, 1.0, 1.0)["h"]
    assert half.dtype == torch.bfloat16 and abs(half.float().std().item() - 1.0) < 0.05


# --- accounting -------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:Optimal order is the largest alpha")
def test_accounting_matches_opacus():
    from opacus.accountants import PRVAccountant, RDPAccountant

    sigma, q, steps, delta = 1.1, 0.01, 500, 1e-5
    rdp = RDPAccountant()
    for _ in range(steps):
        rdp.step(noise_multiplier=sigma, sample_rate=q)
    assert epsilon(sigma, q, steps, delta) == pytest.approx(rdp.get_epsilon(delta), rel=1e-12)

    acct = PrivacyAccountant("rdp")
    assert acct.epsilon(delta) == 0.0
    for _ in range(steps):
        acct.step(sigma, q)
    assert acct.steps == steps
    assert acct.epsilon(delta) == pytest.approx(rdp.get_epsilon(delta), rel=1e-12)

    prv = PRVAccountant()
    prv.history = [(sigma, q, steps)]
    assert epsilon(sigma, q, steps, delta, accountant="prv") == pytest.approx(prv.get_epsilon(delta), rel=1e-9)

    eps = [epsilon(s, q, steps, delta) for s in (0.7, 1.0, 1.5, 3.0)]
    assert all(a > b for a, b in zip(eps, eps[1:]))  # more noise, less epsilon

    sigma_for_2 = noise_multiplier_for(2.0, delta, q, steps)
    assert epsilon(sigma_for_2, q, steps, delta) <= 2.0
    assert epsilon(sigma_for_2 * 0.95, q, steps, delta) > 2.0 * 0.98


# --- the sensitivity property -----------------------------------------------------------------


def _mlp_loss(p, x, y, keep):
    """Squared error of an MLP of any depth (from the params); ``keep`` 0 removes the example:
    its gradient is exactly 0, so it adds nothing (add/remove adjacency at a fixed shape)."""
    h = x
    for i in range(len(p) // 2):
        h = h @ p[f"w{i}"] + p[f"b{i}"]
        if i < len(p) // 2 - 1:
            h = torch.tanh(h)
    return ((h - y) ** 2).sum() * keep


_PROPERTY_FN = {}
# Shapes stay fixed per depth: a batch size or width that changes between calls makes Dynamo
# compile a dynamic graph (a symbolic batch size is not chunked). Weights, data, scale and depth
# are random.
B_PROP = 5
WIDTHS = {1: [3, 4], 2: [3, 4, 4]}


@st.composite
def sensitivity_cases(draw):
    widths = WIDTHS[draw(st.sampled_from([1, 2]))]
    scale = draw(st.sampled_from([0.02, 1.0, 30.0]))  # all unclipped, mixed, all clipped
    return widths, scale, draw(st.integers(0, B_PROP - 1)), draw(st.integers(0, 2**31 - 1))


@pytest.mark.slow
@given(sensitivity_cases())
def test_one_example_moves_the_sum_by_at_most_C(case):
    widths, scale, i, seed = case
    C = 1.0
    if "fn" not in _PROPERTY_FN:  # one compiled function for every example
        _PROPERTY_FN["fn"] = clipped_grad(_mlp_loss, C, batch_argnums=(1, 2, 3), microbatch_size=2,
                                          options=EAGER)
    fn = _PROPERTY_FN["fn"]
    g = torch.Generator().manual_seed(seed)
    p = {}
    for k in range(len(widths) - 1):
        p[f"w{k}"] = torch.randn(widths[k], widths[k + 1], generator=g) * scale
        p[f"b{k}"] = torch.randn(widths[k + 1], generator=g) * scale
    x = torch.randn(B_PROP, widths[0], generator=g) * scale
    y = torch.randn(B_PROP, widths[-1], generator=g)
    keep = torch.ones(B_PROP)
    full = fn(p, x, y, keep)
    keep_i = keep.clone()
    keep_i[i] = 0.0
    removed = fn(p, x, y, keep_i)  # add/remove one example: sensitivity C
    diff = l2({k: full[k] - removed[k] for k in full})
    assert diff <= C * (1 + 1e-5), diff
    x2, y2 = x.clone(), y.clone()
    x2[i] = torch.randn(widths[0], generator=g) * scale * 10
    y2[i] = -y[i]
    replaced = fn(p, x2, y2, keep)  # replace one example: at most 2C
    assert l2({k: full[k] - replaced[k] for k in full}) <= 2 * C * (1 + 1e-5)
    assert fn.chosen_microbatch_size() == 2, fn.plans[-1]


# --- argument errors name the argument --------------------------------------------------------


def _loss(p, x):
    return (p["w"] * x).sum()


@pytest.mark.parametrize("kwargs, name", [
    (dict(clipping_norm=0.0), "clipping_norm"),
    (dict(clipping_norm=-1.0), "clipping_norm"),
    (dict(clipping_norm=float("nan")), "clipping_norm"),
    (dict(clipping_norm="1"), "clipping_norm"),
    (dict(microbatch_size=0), "microbatch_size"),
    (dict(microbatch_size=-3), "microbatch_size"),
    (dict(microbatch_size=2.5), "microbatch_size"),
    (dict(microbatch_size=True), "microbatch_size"),
    (dict(microbatch_size="big"), "microbatch_size"),
    (dict(microbatch_size="auto"), "memory_budget"),
    (dict(microbatch_size="auto", memory_budget="lots"), "memory_budget"),
    (dict(microbatch_size="auto", memory_budget=0.5), "memory_budget"),
    (dict(batch_argnums=0), "batch_argnums"),
    (dict(batch_argnums=()), "batch_argnums"),
    (dict(argnums=-1), "argnums"),
    (dict(return_norms=1), "return_norms"),
    (dict(options={"microbatch_size": 2}), "microbatch_size"),
    (dict(options={"bogus": 1}), "bogus"),
    (dict(options={"inner": "tvm"}), "inner"),
])
def test_bad_arguments_raise_naming_them(kwargs, name):
    kwargs = {"clipping_norm": 1.0, **kwargs}
    with pytest.raises(ValueError, match=name):
        clipped_grad(_loss, **kwargs)


def test_bad_call_arguments_raise_naming_them():
    fn = clipped_grad(lambda p, x, y: (p["w"] * x).sum() * y, 1.0, batch_argnums=(1, 2), options=EAGER)
    p = {"w": torch.ones(3)}
    with pytest.raises(ValueError, match="batch_argnums"):
        fn(p, torch.ones(4, 3), torch.ones(5))
    with pytest.raises(ValueError, match="batch_argnums"):
        fn(p, torch.ones(4, 3))
    with pytest.raises(ValueError, match="noise_multiplier"):
        add_noise(p, -1.0, 1.0)
    with pytest.raises(ValueError, match="clipping_norm"):
        add_noise(p, 1.0, 0.0)
    with pytest.raises(ValueError, match="generator"):
        add_noise(p, 1.0, 1.0, generator=1)
    with pytest.raises(ValueError, match="accountant"):
        epsilon(1.0, 0.01, 10, 1e-5, accountant="moments")
    with pytest.raises(ValueError, match="delta"):
        epsilon(1.0, 0.01, 10, 0.0)
    with pytest.raises(ValueError, match="sample_rate"):
        PrivacyAccountant().step(1.0, 1.5)
    with pytest.raises(ValueError, match="noise_multiplier"):
        PrivacyAccountant().step(0.0, 0.1)
    with pytest.raises(ValueError, match="model"):
        make_functional(lambda x: x)


@pytest.mark.parametrize("chunks", [1, 3])
def test_the_running_sums_are_the_first_chunks_own(chunks):
    """Weights dominate (a 4096 x 256 embedding, 8 tokens per example): the chunk's clipped sums
    are the step's largest tensors. The first chunk's sums become the running sums without a
    copy, so the step peaks at about one set of sums plus, from the second chunk on, the
    chunk's own: below 1.2x the weights' bytes for one chunk and 2.2x for three (a copy made
    it 2x and 3x). The sums still equal a per-example loop's."""
    from fxmem.profiling import step_perf

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(4096, 256), torch.nn.Linear(256, 4))
    fn, trainable, _ = make_functional(model)

    def loss(p, ids, y):
        return torch.nn.functional.cross_entropy(fn(p, {}, ids[None]).mean(1), y[None])

    step = clipped_grad(loss, 1.0, batch_argnums=(1, 2), microbatch_size=4, options={"inner": "eager"})
    ids, y = torch.randint(0, 4096, (4 * chunks, 8)), torch.randint(0, 4, (4 * chunks,))
    weights = sum(p.numel() * 4 for p in trainable.values())
    for _ in range(2):
        with step_perf("cpu") as perf:
            sums = step(trainable, ids, y)
    assert perf.result.peak_bytes < (1.2 if chunks == 1 else 2.2) * weights, (perf.result.peak_bytes, weights)
    params = {k: v.detach() for k, v in trainable.items()}
    expected = {k: torch.zeros_like(v) for k, v in params.items()}
    for i in range(len(ids)):
        g = grad(loss)(params, ids[i], y[i])
        norm = torch.sqrt(sum((t ** 2).sum() for t in g.values()))
        for k in expected:
            expected[k] += g[k] * min(1.0, 1.0 / norm.item())
    for k in expected:
        torch.testing.assert_close(sums[k], expected[k], rtol=1e-4, atol=1e-6)
