"""Measure one (model, configuration) in this process and print one result line.

    python bench/worker.py --model hf_gpt2 --config inductor [--steps 5 --warmup 2] [--quick] [--autocast bf16]

``bench/run.py`` starts one of these per pair, so compiled code, caches and allocator state never
leak from one measurement into the next. The last stdout line starting with ``RESULT_PREFIX`` is
the result, a JSON object (``status``: ``ok``, ``skipped``, ``error``, or ``infeasible``: an fxmem
``memory_budget`` below its feasible floor, which fxmem rejects at compile time).

One step: ``zero_grad(set_to_none=True)`` (outside the measured block), then forward, loss and
backward; with ``--autocast bf16``/``fp16`` the forward and the loss run under
``torch.autocast(device, dtype)`` and the backward outside it, as mixed-precision training loops
do (parameters stay fp32). Steps, in order:

1. the first step, timed alone (compilation happens here); its loss and gradient norm are the
   numbers the report compares across configurations;
2. ``warmup - 1`` more unmeasured steps;
3. ``mem_steps`` steps under ``fxmem.profiling.step_perf`` with the memory profiler: peak bytes
   allocated during the step over those live at its entry (parameters, the batch), so gradients
   and everything forward and backward allocate count, parameters do not;
4. ``steps`` steps timed with ``step_perf(memory=False)`` (no profiler overhead): median time.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import re
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import configs  # noqa: E402

RESULT_PREFIX = "BENCH_RESULT "
AUTOCAST = {"off": None, "bf16": "bfloat16", "fp16": "float16"}  # --autocast -> torch dtype name


def _emit(result: dict) -> None:
    print(RESULT_PREFIX + json.dumps(result), flush=True)


def _grad_norm(model) -> float:
    import torch

    total = torch.zeros((), dtype=torch.float64)
    for p in model.parameters():
        if p.grad is not None:
            total += p.grad.detach().double().pow(2).sum()
    return math.sqrt(total.item())


def workload(model_name: str, kwargs: dict, seed: int, device: str):
    """(the model's workload, its batch on ``device``)."""
    from fxmem.models import build

    wl = build(configs.BUILDER.get(model_name, model_name), seed=seed, **kwargs)
    if getattr(wl.model, "loss_type", "") is None and hasattr(wl.model, "loss_function"):
        # GPT2LMHeadModel has no loss_type: HF then logs a warning_once inside forward, which is a
        # Dynamo graph break between the model and its loss. Name the loss HF would use anyway.
        wl.model.loss_type = "ForCausalLM"
    wl.model.to(device)
    return wl, {k: v.to(device) for k, v in wl.batch.items()}


def measure(model_name: str, spec: str, steps: int, warmup: int, mem_steps: int, quick: bool,
            device: str, seed: int, threads: int | None = None, autocast: str = "off",
            optimizer: str | None = None) -> dict:
    import contextlib
    import statistics

    import torch

    if threads:
        torch.set_num_threads(threads)
    from torch._dynamo.utils import counters

    from fxmem.profiling import step_perf

    kwargs = configs.model_kwargs(model_name, quick)
    cfg = configs.parse(spec)
    result: dict = {
        "model": model_name, "config": spec, "kind": cfg.kind, "options": dict(cfg.options),
        "model_kwargs": kwargs, "device": device, "threads": torch.get_num_threads(),
        "steps": steps, "warmup": warmup, "mem_steps": mem_steps, "autocast": autocast, "optimizer": optimizer,
    }
    amp_dtype = AUTOCAST[autocast]

    def forward():  # forward and loss, under autocast when asked for
        amp = torch.autocast(device.split(":")[0], dtype=getattr(torch, amp_dtype)) if amp_dtype \
            else contextlib.nullcontext()
        with amp:
            return wl.loss(fn(**batch))
    wl, batch = workload(model_name, kwargs, seed, device)
    model = wl.model
    params = list(model.parameters())
    result["param_bytes"] = sum(p.numel() * p.element_size() for p in params)
    result["batch_size"] = batch_size = next(iter(batch.values())).shape[0]

    if cfg.kind == "floor":
        if amp_dtype:
            return {**result, "status": "skipped", "reason": "the floor is measured without autocast"}
        from floor import physical_floor

        terms = physical_floor(model, wl.loss, batch, device)
        return {**result, "status": "ok", "floor": terms, "peak_bytes": terms["total"],
                "peak_bytes_all": [terms["total"]], "fwd_live_bytes": None, "step_time_median_s": None,
                "step_times_s": [], "first_step_s": None, "compile_s": None, "graphs": 0, "recompiles": 0,
                "graph_breaks": 0}
    opt = OPTIMIZERS[optimizer](params) if optimizer else None
    try:
        fn = configs.build(model, cfg, optimizer=opt)
    except configs.Skip as e:
        return {**result, "status": "skipped", "reason": str(e)}
    in_backward = cfg.options.get("step_in_backward", False)

    def backward(loss, perf=None):  # the backward, and the optimizer's step where it does not run inside it
        loss.backward()
        if opt is not None and not in_backward:
            if perf is not None:
                perf.mark("backward")  # what fxmem compiled ends here: its prediction's peak
            opt.step()

    def step():
        loss = forward()
        backward(loss)
        return loss

    def zero():
        if opt is not None:
            opt.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)

    # 1. first step: compilation + one step
    zero()
    before = [p.detach().clone() for p in params] if opt is not None else None
    t0 = time.perf_counter()
    loss = step()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    first_s = time.perf_counter() - t0
    result["loss"] = loss.item()
    if opt is None:
        result["grad_norm"] = _grad_norm(model)
    else:  # the first update's norm (a step in the backward leaves no gradient to compare)
        result["update_norm"] = math.sqrt(sum(float((p.detach().double() - b.double()).square().sum())
                                              for p, b in zip(params, before)))
        del before
    graphs_after_first = counters["stats"].get("unique_graphs", 0)
    del loss
    if cfg.kind == "fxmem":
        result.update(_lowering(fn))
        result["predicted_peak_bytes"] = _predicted(fn, batch)

    # 2. remaining warm-up
    for _ in range(warmup - 1):
        zero()
        step()

    # 3. peak memory, on separately profiled steps
    peaks, fwd_live, compiled_peaks = [], [], []
    for _ in range(mem_steps):
        zero()
        gc.collect()
        with step_perf(device, batch_size=batch_size) as perf:
            loss = forward()
            perf.mark("forward")
            backward(loss, perf)
        del loss
        peaks.append(perf.result.peak_bytes)
        fwd_live.append(perf.result.marks[0].live_bytes if perf.result.marks else None)
        # forward + backward alone (an optimizer step after the backward is outside the compile)
        compiled_peaks.append(perf.result.marks[1].peak_bytes if len(perf.result.marks) > 1 else peaks[-1])

    # 4. time, without the profiler
    times = []
    for _ in range(steps):
        zero()
        with step_perf(device, batch_size=batch_size, memory=False) as perf:
            step()
        times.append(perf.result.time_s)

    median = statistics.median(times) if times else None
    result.update({
        "status": "ok",
        "peak_bytes": max(peaks) if peaks else None,
        "peak_bytes_all": peaks,
        "compiled_peak_bytes": max(compiled_peaks) if compiled_peaks else None,
        "fwd_live_bytes": fwd_live[-1] if fwd_live else None,
        "step_time_median_s": median,
        "step_times_s": times,
        "first_step_s": first_s,
        "compile_s": None if median is None else max(0.0, first_s - median),
        "graphs": counters["stats"].get("unique_graphs", 0),
        "recompiles": counters["stats"].get("unique_graphs", 0) - graphs_after_first,
        "graph_breaks": sum(counters["graph_break"].values()),
    })
    return result


def _predicted(compiled, batch: dict) -> int | None:
    """fxmem's predicted step peak at this batch: the sum over the compile's graphs of each
    graph's ``predict_peak`` where there is one graph, else None (graph breaks: each graph's
    peak is its own)."""
    import fxmem

    graphs = fxmem.report(compiled).graphs
    if len(graphs) != 1:
        return None
    return graphs[0].predict_peak(**{k: tuple(v.shape) for k, v in batch.items()})


# --optimizer: what the step's optimizer is (its step runs after the backward, or inside it for a
# configuration with fxmem's ``step_in_backward``); lr as fine-tuning uses.
OPTIMIZERS = {
    "adamw": lambda params: __import__("torch").optim.AdamW(params, lr=1e-5),
    "sgd": lambda params: __import__("torch").optim.SGD(params, lr=1e-3, momentum=0.9),
}


def _lowering(compiled) -> dict:
    """What fxmem lowered (pattern -> count over the compile's graphs) and the first reason each
    pattern it found was left alone."""
    import fxmem

    lowered, left = {}, {}
    for g in fxmem.report(compiled).graphs:
        for r in g.lowerings:
            lowered[r.pattern] = lowered.get(r.pattern, 0) + r.count
        for note in g.lowering_notes:  # "left alone: <pattern> at <node>: <why>"
            pattern, _, why = note.removeprefix("left alone: ").partition(" at ")
            left.setdefault(pattern, why.partition(": ")[2])
    return {"lowered": lowered, "left_alone": left}


# fxmem's compile-time error for a memory budget below its feasible floor (fxmem/remat/plan.py).
_INFEASIBLE = re.compile(r"is infeasible; the smallest feasible budget is (\d+) bytes "
                         r"\(([0-9.]+) of level (\d+)'s (\d+)\)")


def error_result(model: str, spec: str, e: BaseException) -> dict:
    """The result of a run that raised: ``error``, or ``infeasible`` for a budget below fxmem's floor.

    ``reason_first_line`` is the first line of the innermost matching error's message (Dynamo
    appends its own advice after a blank line), with the exception type in front.
    """
    chain, c = [], e
    while c is not None and len(chain) < 20:
        chain.append(c)
        c = c.__cause__ or c.__context__
    for c in chain:
        m = _INFEASIBLE.search(str(c))
        if m:
            first = (str(c).strip().splitlines() or [""])[0]
            return {"model": model, "config": spec, "status": "infeasible",
                    "reason": f"{type(c).__name__}: {c}"[:2000], "reason_first_line": f"{type(c).__name__}: {first}",
                    "floor_bytes": int(m.group(1)), "floor_fraction": float(m.group(2)),
                    "floor_level": int(m.group(3)), "level_saved_bytes": int(m.group(4))}
    first = (str(e).strip().splitlines() or [""])[0]
    return {"model": model, "config": spec, "status": "error", "reason": f"{type(e).__name__}: {e}"[:2000],
            "reason_first_line": f"{type(e).__name__}: {first}"[:500]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--config", required=True, help="a config name or 'name:{json options}'")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--mem-steps", type=int, default=1)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--autocast", choices=tuple(AUTOCAST), default="off",
                   help="run forward and loss under torch.autocast in this dtype (default off)")
    p.add_argument("--optimizer", choices=tuple(OPTIMIZERS), default=None,
                   help="an optimizer step in each step (default none: forward and backward only)")
    a = p.parse_args(argv)
    if a.warmup < 1:
        p.error("--warmup must be >= 1 (the first step compiles and is never measured)")
    try:
        result = measure(a.model, a.config, a.steps, a.warmup, a.mem_steps, a.quick, a.device, a.seed, a.threads,
                         a.autocast, a.optimizer)
    except Exception as e:  # report, don't crash silently: the parent records the error
        traceback.print_exc()
        _emit(error_result(a.model, a.config, e))
        return 1
    _emit(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
