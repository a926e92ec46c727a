"""options={"fit": N, "optimizer": "adamw"}: weights + AdamW state + the real step's peak within N."""

import copy

import pytest
import torch

import fxmem
from fxmem.fit import peak_budget
from fxmem.options import resolve
from fxmem.profiling import step_perf
from fxmem.remat.settings import PlanSettings
from fxmem.testing.zoo import zoo_build

ENV0: dict = {}


def test_fit_derives_the_step_budget_from_the_device_size():
    opts = resolve({"fit": "1MB", "optimizer": "sgd"}, env=ENV0)
    assert peak_budget(opts, (300_000, 200_000)) == 10**6 - 300_000
    adamw = resolve({"fit": 10**6}, env=ENV0)  # AdamW unless told
    assert peak_budget(adamw, (300_000, 200_000)) == 10**6 - 300_000 - 2 * 200_000
    assert PlanSettings.of(adamw, fit_budget=peak_budget(adamw, (300_000, 200_000))).peak_budget == 10**6 - 700_000
    assert peak_budget(resolve({}, env=ENV0), (1, 1)) is None
    assert PlanSettings.of(resolve({"peak_budget": 5}, env=ENV0), fit_budget=None).peak_budget == 5
    with pytest.warns(RuntimeWarning, match=r"fxmem fit=1,000 bytes: weights and adamw state alone take 1,100; "
                                            r"planning the least peak") as record:
        assert peak_budget(resolve({"fit": 1000}, env=ENV0), (500, 300)) == 0
    assert record[0].filename == __file__  # at the user's line


@pytest.mark.parametrize("options, message", [
    ({"fit": "24GB", "peak_budget": "1GB"}, "options 'fit' and 'peak_budget': give one"),
    ({"fit": "24GB", "memory_budget": 0.5}, "options 'fit' and 'memory_budget': give one"),
    ({"optimizer": "adamw"}, "option 'optimizer' ('adamw') counts only with 'fit'"),
    ({"fit": "24GB", "optimizer": "lion"}, "option 'optimizer': got 'lion'; allowed: None, 'sgd', 'momentum', 'adam', "
                                           "'adamw'"),
    ({"fit": "lots"}, "option 'fit': got 'lots'"),
])
def test_fit_options_are_checked(options, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        resolve(options, env=ENV0)


def _step(w, options):
    """Three AdamW steps of a compiled copy; (resident bytes: weights, buffers, AdamW state as
    allocated; the last step's measured peak; the report)."""
    torch._dynamo.reset()
    model = copy.deepcopy(w.model)
    compiled = torch.compile(model, backend="fxmem", options={"inner": "eager", **options})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for _ in range(3):
        opt.zero_grad(set_to_none=True)
        with step_perf("cpu") as perf:
            w.loss(compiled(**w.batch)).backward()
        opt.step()
    tensors = [*model.parameters(), *model.buffers(),
               *[t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]]
    return sum(t.numel() * t.element_size() for t in tensors), perf.result.peak_bytes, fxmem.report(compiled)


@pytest.mark.slow  # three compiles a model: about 20 s each here
@pytest.mark.parametrize("name", ["gpt2", "llama", "vit"])
def test_fit_is_met_counting_weights_gradients_and_adamw_state(name):
    w = zoo_build(name, batch=4)
    resident, level0, r0 = _step(w, {})
    _, least, rmin = _step(w, {"memory_budget": 0.0})  # the least peak any plan reaches
    assert least < level0
    device = resident + (level0 + least) // 2  # between them: only some plans fit
    _, peak, rfit = _step(w, {"fit": device, "optimizer": "adamw"})
    assert resident + peak <= 1.03 * device
    # the cheapest plan that fits: more recompute than level 0's (which does not fit), less than the least peak's
    costs = [r.graphs[-1].recompute_cost for r in (r0, rfit, rmin)]
    assert costs[0] < costs[1] < costs[2], costs
