"""Step time of several configurations of one model, measured interleaved in one process.

    python bench/studies/interleaved.py --name budget-time --model hf_gpt2 --rounds 15 \
        --configs 'inductor+budget0.9,fxmem-inductor+budget0.9'

``bench/run.py`` measures each configuration in its own process, one after another, so a slow
phase of this shared machine (5-25%) lands on whichever configuration runs then. Here every
configuration is compiled and warmed up first; then each round runs one step of each, in an order
that rotates from round to round, and the medians compare steps taken side by side. Memory is
not measured here (run.py does that exactly, one process per configuration).

Writes ``<out-dir>/<name>.{json,md}`` (default bench/results) through ``harness.write``: per
configuration the median and fastest step and their ratios to the first configuration (table spec
``interleaved``; the model and rounds in ``meta["run"]``).
"""

from __future__ import annotations

import copy
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: configs, worker, common

import common  # noqa: E402
import configs  # noqa: E402
import harness  # noqa: E402
from worker import workload  # noqa: E402


def _compiled(model, spec: str, step):
    """Build and warm up one configuration (each compiles its own graphs: see configs._inductor)."""
    fn = configs.build(model, configs.parse(spec))
    for _ in range(2):
        step(model, fn)
    return fn


def measure(model_name: str, specs: list[str], rounds: int, quick: bool, threads: int) -> list[dict]:
    common.set_threads(threads)
    wl, batch = workload(model_name, configs.model_kwargs(model_name, quick), 0, "cpu")

    def step(model, fn):
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        wl.loss(fn(**batch)).backward()
        return time.perf_counter() - t0

    models = {s: copy.deepcopy(wl.model) for s in specs}
    fns, failed = {}, []
    for s in specs:
        print(f"compiling {s} ...", flush=True)
        try:
            fns[s] = _compiled(models[s], s, step)
        except Exception as e:  # e.g. an fxmem budget below its floor: left out, with the reason
            if s == specs[0]:
                raise
            failed.append({"config": s, "error": str(e).strip().splitlines()[0][:300]})
            print(f"  left out: {failed[-1]['error']}", flush=True)
    specs = [s for s in specs if s in fns]
    times: dict[str, list[float]] = {s: [] for s in specs}
    for r in range(rounds):
        k = r % len(specs)
        for s in specs[k:] + specs[:k]:
            times[s].append(step(models[s], fns[s]))
        print(f"round {r + 1}/{rounds}: " + ", ".join(f"{s} {times[s][-1] * 1e3:.0f} ms" for s in specs), flush=True)
    base = statistics.median(times[specs[0]]), min(times[specs[0]])
    return [{"config": s, "median_s": statistics.median(t), "min_s": min(t), "step_times_s": t,
             "median_ratio": statistics.median(t) / base[0], "min_ratio": min(t) / base[1]}
            for s, t in times.items()], failed


def main(argv: list[str] | None = None) -> int:
    p = common.parser(__doc__, models=common.REQUIRED, known_models=sorted(configs.MODELS))
    p.add_argument("--configs", required=True, help="comma-separated; ratios are to the first")
    p.add_argument("--rounds", type=int, default=15)
    a = common.parse(p, argv)
    specs = configs.split_specs(a.configs)
    if len(specs) < 2 or a.rounds < 1:
        p.error("give at least two configurations and one round")
    if len(a.models) != 1:
        p.error("--model: one model (its configurations are stepped side by side)")
    model = a.models[0]
    meta = common.metadata(a.command)
    rows, failed = measure(model, specs, a.rounds, a.quick, a.threads)
    records = [{"model": model, **r} for r in rows] + [{"model": model, "config": f["config"], "left_out": f["error"]}
                                                        for f in failed]
    _, mp = harness.write(a.name, records, a.out_dir, meta=meta, spec="interleaved",
                          run={"model": model, "rounds": a.rounds, "configs": specs, "threads": a.threads,
                               "quick": a.quick})
    print(mp.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
