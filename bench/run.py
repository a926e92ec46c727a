"""Run the benchmark: every (model, configuration) in a fresh subprocess; write JSON and markdown.

    python bench/run.py --name foundation
    python bench/run.py --name foundation --quick             # small shapes: writes foundation-quick.*
    python bench/run.py --name lvl --models hf_llama --configs 'eager,fxmem-eager,fxmem-eager:{"level":1}'
    python bench/run.py --name amp --models hf_gpt2 --configs eager,fxmem-eager --autocast off,bf16

Writes ``<out-dir>/<name>.json`` (every measurement; the run's settings under ``run``; commit,
machine, versions and the command under ``meta``) and ``<out-dir>/<name>.md`` (a table; see
bench/README.md for the columns) with ``harness.write``; ``--out-dir`` defaults to
bench/results. Both are rewritten after every measurement, so an interrupted run keeps what it
measured.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import common  # noqa: E402
import configs  # noqa: E402
import harness  # noqa: E402
import results_format  # noqa: E402
from worker import AUTOCAST, OPTIMIZERS, RESULT_PREFIX  # noqa: E402

LOSS_RTOL = 1e-5  # first-step loss vs eager
GRAD_RTOL = 1e-4  # first-step gradient norm vs eager
# Under autocast, vs eager under the same autocast: a fused kernel that rounds once where eager's
# ops round each step (fxmem's lowering) is a few 16-bit roundings away (tests/integration/test_autocast.py
# measures gradient entries within 6.3e-3 x the largest); the bound is one bf16 rounding (2**-8).
AMP_LOSS_RTOL, AMP_GRAD_RTOL = 1e-4, 2 ** -8
# With --optimizer: the norm of the first update vs eager's. Adam's first update is lr x sign(g)
# per entry, so this mostly catches a parameter not updated (or updated twice).
UPDATE_RTOL = 1e-3
MIB = 2**20


# --- progress ------------------------------------------------------------------------------


class _Progress:
    """tqdm if installed, else one plain line per run."""

    def __init__(self, total: int):
        try:
            from tqdm import tqdm
        except ImportError:
            tqdm = None
        self._bar = tqdm(total=total, unit="run", dynamic_ncols=True) if tqdm else None
        self.total, self.done = total, 0

    def start(self, label: str) -> None:
        if self._bar is not None:
            self._bar.set_description(label)
        else:
            print(f"[{self.done + 1}/{self.total}] {label} ...", flush=True)

    def finish(self, line: str) -> None:
        self.done += 1
        if self._bar is not None:
            self._bar.write(line)
            self._bar.update(1)
        else:
            print(f"[{self.done}/{self.total}] {line}", flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


# --- one run -------------------------------------------------------------------------------


def run_one(model: str, spec: str, a: argparse.Namespace, autocast: str = "off") -> dict:
    cmd = [sys.executable, str(HERE / "worker.py"), "--model", model, "--config", spec,
           "--steps", str(a.steps), "--warmup", str(a.warmup), "--mem-steps", str(a.mem_steps),
           "--device", a.device, "--autocast", autocast]
    if a.quick:
        cmd.append("--quick")
    if a.optimizer:
        cmd += ["--optimizer", a.optimizer]
    env = dict(os.environ)
    if a.threads > 0:
        cmd += ["--threads", str(a.threads)]
        env["OMP_NUM_THREADS"] = str(a.threads)
    cache = None
    if a.cache == "worker":
        # A cold compile cache per run: compile times are comparable and no configuration
        # reuses kernels another one compiled.
        cache = tempfile.mkdtemp(prefix="fxmem-bench-cache-")
    elif a.cache == "run":
        cache = a.run_cache_dir
    if cache:
        env["TORCHINDUCTOR_CACHE_DIR"] = cache
        env["TRITON_CACHE_DIR"] = os.path.join(cache, "triton")
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout, env=env)
        out, err, rc = proc.stdout, proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        rc = None
    finally:
        if a.cache == "worker":
            shutil.rmtree(cache, ignore_errors=True)
    wall = time.perf_counter() - t0
    result = None
    for line in reversed(out.splitlines()):
        if line.startswith(RESULT_PREFIX):
            result = json.loads(line[len(RESULT_PREFIX):])
            break
    if result is None:
        why = f"timed out after {a.timeout} s" if rc is None else f"worker exited with {rc} and no result"
        result = {"model": model, "config": spec, "autocast": autocast, "status": "error", "reason": why}
    if result["status"] == "error":
        result["stderr_tail"] = err[-4000:]
    result["wall_s"] = wall
    return result


# --- report --------------------------------------------------------------------------------


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def _own_masks(r: dict) -> bool:
    """Dropout masks from Inductor's seeded random ops, not eager's generator: other masks, so
    the loss and gradients are compared with plain Inductor's (same seeds, same masks)."""
    if not r.get("model_kwargs", {}).get("dropout"):
        return False
    cfg = configs.parse(r["config"])
    return cfg.kind == "inductor" or (cfg.kind == "fxmem" and cfg.options.get("inner") == "inductor")


def _key(r: dict) -> tuple[str, str]:
    """Results compare with eager of the same model under the same autocast."""
    return r["model"], r.get("autocast", "off")


def annotate(results: list[dict]) -> None:
    """Add ratios to eager and the loss / gradient check to every ok result, in place."""
    ok = [r for r in results if r["status"] == "ok"]
    base = {_key(r): r for r in ok if r["config"] == configs.BASELINE}
    ckpt = {_key(r): r for r in ok if r["config"] == "eager+hf_ckpt"}
    for r in ok:
        measured = r.get("compiled_peak_bytes") or r.get("peak_bytes")  # (without a step after the backward)
        if r.get("predicted_peak_bytes") and measured:
            r["predicted_vs_measured"] = r["predicted_peak_bytes"] / measured
        if _key(r) in ckpt and ckpt[_key(r)]["peak_bytes"] and r.get("peak_bytes"):
            r["peak_vs_hf_ckpt"] = r["peak_bytes"] / ckpt[_key(r)]["peak_bytes"]
    inductor = {_key(r): r for r in ok if r["config"] == "inductor"}
    for r in ok:
        b = base.get(_key(r))
        if "floor" in r:
            r["check"] = _floor_terms(r["floor"])
        if b is None:
            r.setdefault("check", "no eager baseline")
            continue
        if b["peak_bytes"]:
            r["peak_vs_eager"] = r["peak_bytes"] / b["peak_bytes"]
        if b["step_time_median_s"] and r["step_time_median_s"] is not None:
            r["time_vs_eager"] = r["step_time_median_s"] / b["step_time_median_s"]
        if "floor" in r:
            continue
        ref, against = b, ""
        if _own_masks(r):
            if r["config"] == "inductor" or _key(r) not in inductor:
                r["check"] = "Inductor's dropout masks (no reference)"
                continue
            ref, against = inductor[_key(r)], " vs inductor"
        r["loss_rel_diff"] = _rel(r["loss"], ref["loss"])
        amp = r.get("autocast", "off") != "off"
        bad = []
        if not r["loss_rel_diff"] <= (AMP_LOSS_RTOL if amp else LOSS_RTOL):
            bad.append(f"loss {r['loss_rel_diff']:.1e}")
        if r.get("optimizer"):  # the first update's norm (no gradient outlives a step in the backward)
            r["update_norm_rel_diff"] = _rel(r["update_norm"], ref["update_norm"])
            if not r["update_norm_rel_diff"] <= UPDATE_RTOL:
                bad.append(f"update {r['update_norm_rel_diff']:.1e}")
        else:
            r["grad_norm_rel_diff"] = _rel(r["grad_norm"], ref["grad_norm"])
            if not r["grad_norm_rel_diff"] <= (AMP_GRAD_RTOL if amp else GRAD_RTOL):
                bad.append(f"grad {r['grad_norm_rel_diff']:.1e}")
        r["check"] = ("ok" if not bad else "MISMATCH " + ", ".join(bad)) + against


def _floor_terms(f: dict) -> str:
    mib = {k: f"{v / MIB:.1f}" for k, v in f.items()}
    return (f"floor: max(grads {mib['grads']}, boundaries {mib['boundaries']} + max(layer "
            f"{mib['layer_working_set']}, loss {mib['loss_working_set']})) MiB")


def first_line(r: dict) -> str:
    """The first line of a failed run's reason (the worker's ``reason_first_line`` if it has one)."""
    if r.get("reason_first_line"):
        return r["reason_first_line"]
    return (r.get("reason", "").strip().splitlines() or [""])[0]


def write(doc: dict, out_dir: Path, name: str) -> tuple[Path, Path]:
    """``<out_dir>/<name>.json`` and ``.md`` through the harness (table spec ``run``)."""
    annotate(doc["results"])
    return harness.write(name, doc["results"], out_dir, meta=doc["meta"], run=doc["run"],
                         spec="release" if doc["run"].get("optimizer") else "run")


def _kept(path: Path, measuring: set[tuple[str, str, str]]) -> list[dict]:
    """The records of ``path`` (an earlier run's results) whose (model, config, autocast) is not
    in ``measuring``: ``--keep``."""
    if not path.exists():
        return []
    records = [results_format.unflatten(r) for r in results_format.pivot(results_format.read(path).rows).values()]
    return [r for r in records if (r["model"], r["config"], r.get("autocast", "off")) not in measuring]


def _summary(r: dict) -> str:
    amp = r.get("autocast", "off")
    head = f"{r['model']:<10} {'' if amp == 'off' else amp + ' '}{r['config']:<22}"
    if r["status"] != "ok":
        return f"{head} {r['status']}: {first_line(r)[:300]}"
    if "floor" in r:
        return f"{head} {_floor_terms(r['floor'])}, total {r['peak_bytes'] / MIB:.1f} MiB"
    return (f"{head} peak {r['peak_bytes'] / MIB:8.1f} MiB  step {r['step_time_median_s'] * 1e3:7.0f} ms  "
            f"compile {r['compile_s']:5.1f} s  loss {r['loss']:.6f}")


# --- main ----------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = common.parser(__doc__, models=",".join(configs.DEFAULT_MODELS), known_models=tuple(configs.MODELS),
                      device="cpu")
    p.add_argument("--configs", default=",".join(configs.DEFAULT_CONFIGS),
                   help="comma-separated names or 'name:{json options}'; known: " + ", ".join(configs.REGISTRY))
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 5, --quick 2)")
    p.add_argument("--warmup", type=int, default=None,
                   help="warm-up steps incl. the compiling one (default 2, --quick 1)")
    p.add_argument("--mem-steps", type=int, default=1, help="profiled steps for the peak (default 1)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per run (default 1800)")
    p.add_argument("--autocast", default="off",
                   help="comma-separated, each of " + "/".join(AUTOCAST) + ": run every (model, config) with forward "
                        "and loss under torch.autocast in that dtype (off: without); default off")
    p.add_argument("--optimizer", choices=tuple(OPTIMIZERS), default=None,
                   help="an optimizer step in every step, after the backward (inside it for a configuration with "
                        "fxmem's step_in_backward); default none: forward and backward only")
    p.add_argument("--keep", action="store_true",
                   help="keep the results <out-dir>/<name>.json already has for the (model, config, autocast) this "
                        "run does not measure: re-measure some rows of a long run")
    p.add_argument("--cache", choices=("worker", "run", "global"), default=None,
                   help="Inductor cache: a cold one per worker (default), one per run.py run, or the global "
                        "one that persists across runs (default with --quick)")
    a = common.parse(p, argv)
    a.steps = a.steps if a.steps is not None else (2 if a.quick else 5)
    a.warmup = a.warmup if a.warmup is not None else (1 if a.quick else 2)
    if a.warmup < 1 or a.steps < 1 or a.mem_steps < 1:
        p.error("--warmup, --steps and --mem-steps must be >= 1")
    a.cache = a.cache or ("global" if a.quick else "worker")
    name = a.name
    autocasts = common.split(a.autocast)
    if not autocasts or any(x not in AUTOCAST for x in autocasts):
        p.error(f"--autocast takes a comma-separated list of {', '.join(AUTOCAST)}, got {a.autocast!r}")

    models = a.models
    specs = configs.split_specs(a.configs)
    try:  # fail on a typo now, not after an hour
        for m in models:
            configs.model_kwargs(m, a.quick)
        for s in specs:
            configs.parse(s)
    except ValueError as e:
        p.error(str(e))
    if configs.BASELINE not in specs:
        print(f"note: '{configs.BASELINE}' is not among the configs: no ratios or loss checks", file=sys.stderr)
    else:  # measure the baseline first
        specs = [configs.BASELINE] + [s for s in specs if s != configs.BASELINE]

    doc = {
        "meta": common.metadata(a.command),
        "run": {
            "name": name,
            "models": models, "configs": specs, "steps": a.steps, "warmup": a.warmup,
            "mem_steps": a.mem_steps, "quick": a.quick, "threads": a.threads or None, "device": a.device,
            "cache": a.cache, "autocast": autocasts, "optimizer": a.optimizer,
            "model_kwargs": {m: configs.model_kwargs(m, a.quick) for m in models},
            "loss_rtol": LOSS_RTOL, "grad_rtol": GRAD_RTOL,
        },
        "results": [],
    }
    out_dir = Path(a.out_dir)
    runs = [(m, x, s) for m in models for x in autocasts for s in specs]
    if a.keep:
        doc["results"] = _kept(out_dir / f"{name}.json", {(m, s, x) for m, x, s in runs})
    bar = _Progress(len(runs))
    t0 = time.perf_counter()
    a.run_cache_dir = tempfile.mkdtemp(prefix="fxmem-bench-cache-") if a.cache == "run" else None
    try:
        for m, x, s in runs:
            bar.start(f"{m} / {s}" + ("" if x == "off" else f" / autocast {x}"))
            r = run_one(m, s, a, x)
            doc["results"].append(r)
            write(doc, out_dir, name)
            bar.finish(_summary(r))
    finally:
        bar.close()
        if a.run_cache_dir:
            shutil.rmtree(a.run_cache_dir, ignore_errors=True)
    doc["run"]["total_s"] = time.perf_counter() - t0
    jp, mp = write(doc, out_dir, name)
    print(mp.read_text())
    print(f"wrote {jp} and {mp} in {doc['run']['total_s']:.0f} s")
    failed = [r for r in doc["results"] if r["status"] == "error"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
