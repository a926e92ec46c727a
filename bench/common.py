"""What every benchmark and study shares: one command line and the record of a run.

    import common                                   # bench/ is on sys.path (see below)

    p = common.parser(__doc__, name="dpsgd")        # --name --quick --threads --out-dir (+ --models, --device)
    p.add_argument("--steps", type=int, default=5)  # the script's own flags
    a = common.parse(p)                             # a.name has -quick appended under --quick
    common.set_threads(a.threads)
    ...
    harness.write(a.name, records, a.out_dir, meta=common.metadata(a.command), run={...})

``metadata()`` is the run's record that every results file carries as ``meta``: git commit
(``-dirty`` if the checkout has uncommitted changes outside bench/results), the machine, torch,
Python and the benchmark packages' versions, the date, the exact command line. The results
themselves are written by ``harness.write`` (bench/harness.py: the one format and renderer).

Imports: scripts import their bench siblings by name (``import configs``, ``import common``)
with bench/ on ``sys.path``: ``python bench/x.py`` puts it there; a study in bench/studies/
inserts it. bench/ holds no ``fxmem``, so a ``PYTHONPATH`` snapshot of fxmem still decides which
fxmem runs. Importing this module appends the checkout's root to the *end* of ``sys.path``: the
checkout's fxmem is the fallback when none is installed, never ahead of one.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any, Sequence

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
RESULTS = BENCH / "results"
STUDIES = BENCH / "studies"

if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))

# Environment variables that change what a run measures: recorded in front of the command.
ENV_IN_COMMAND = ("PYTHONPATH", "FXMEM_BENCH_MODEL_KWARGS")
# Versions recorded when installed (read from package metadata: nothing is imported).
PACKAGES = ("transformers", "opacus", "opake", "triton", "numpy")
REQUIRED = object()  # parser(name=REQUIRED / models=REQUIRED): the flag must be given


# --- metadata ------------------------------------------------------------------------------


def _git(*args: str) -> str | None:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def git_commit() -> str | None:
    """``git rev-parse HEAD``, with ``-dirty`` when the checkout has uncommitted changes (bench/results
    excluded: results being written must not mark their own run dirty); None outside a checkout."""
    head = _git("rev-parse", "HEAD")
    if head is None:
        return None
    status = _git("status", "--porcelain", "--", ".", ":(exclude)bench/results")
    return head + ("-dirty" if status else "")


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def machine() -> dict:
    """The machine: platform, CPU model and count (and affinity), CUDA device, and this process's torch
    threads (run.py's workers record their own in each result)."""
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:
        affinity = None
    info: dict[str, Any] = {"platform": platform.platform(), "arch": platform.machine(), "cpu": _cpu_model(),
                            "cpu_count": os.cpu_count(), "cpu_affinity": affinity}
    try:
        import torch

        info["torch_threads"] = torch.get_num_threads()
        info["cuda"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    except ImportError:
        pass
    return info


def versions() -> dict:
    """Installed versions of the benchmark packages (those not installed are left out)."""
    from importlib import metadata as md

    out = {}
    for name in PACKAGES:
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            pass
    return out


def command_line(argv: Sequence[str] | None = None, script: str | os.PathLike | None = None) -> str:
    """The command that reproduces this run, from the checkout's root: ``[ENV=...] python bench/x.py ARGS``."""
    script = Path(script or sys.argv[0]).resolve()
    try:
        shown = str(script.relative_to(ROOT))
    except ValueError:
        shown = str(script)
    args = list(sys.argv[1:] if argv is None else argv)
    env = "".join(f"{k}={shlex.quote(os.environ[k])} " for k in ENV_IN_COMMAND if os.environ.get(k))
    return env + shlex.join(["python", shown, *args])


def metadata(command: str | None = None) -> dict:
    """The record of a run: commit, machine, versions, date, command line."""
    try:
        import torch

        torch_version = torch.__version__
    except ImportError:
        torch_version = None
    try:
        from importlib.util import find_spec

        spec = find_spec("fxmem")
        src = Path(spec.origin).resolve().parent if spec and spec.origin else None
        fxmem_source = None if src is None else (str(src.relative_to(ROOT)) if src.is_relative_to(ROOT) else str(src))
    except (ImportError, ValueError):
        fxmem_source = None
    return {
        "commit": git_commit(),
        "date_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S"),
        "command": command if command is not None else command_line(),
        "cwd": os.getcwd(),
        "python": platform.python_version(),
        "torch": torch_version,
        "packages": versions(),
        "machine": machine(),
        "fxmem_source": fxmem_source,  # "fxmem" = this checkout's package; else e.g. a PYTHONPATH snapshot
    }


# --- the command line ----------------------------------------------------------------------


def parser(description: str | None, *, name: Any = REQUIRED, models: Any = None,
           known_models: Sequence[str] | None = None, quick: bool = True, threads: int | None = 1,
           device: str | None = None, out_dir: bool = True,
           script: str | os.PathLike | None = None) -> argparse.ArgumentParser:
    """An argument parser with the flags the bench scripts share; add a script's own flags to it.

    - ``--name`` (default ``name``; required when ``REQUIRED``): results go to ``<out-dir>/<name>.*``
    - ``--models`` / ``--model`` (when ``models`` is not None: the default, a comma-separated
      string, or ``REQUIRED``); ``parse`` splits it into a list, checked against ``known_models``
    - ``--quick`` (when ``quick``): small shapes, fewer steps; ``parse`` appends ``-quick`` to the name
    - ``--threads`` (when ``threads`` is not None: the default; 0 = torch's default)
    - ``--device`` (when ``device`` is not None: the default)
    - ``--out-dir`` (when ``out_dir``; default bench/results)

    ``description``: the script's docstring, shown as written. ``script``: the file the recorded
    command names (default: the caller's file).
    """
    if script is None:
        script = sys._getframe(1).f_globals.get("__file__")
    p = argparse.ArgumentParser(description=(description or "").strip() or None,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.set_defaults(_script=script, _quick_suffix=quick, _known_models=tuple(known_models or ()))
    if name is REQUIRED:
        p.add_argument("--name", required=True, help="results go to <out-dir>/<name>.json and .md")
    else:
        p.add_argument("--name", default=name, help=f"results go to <out-dir>/<name>.json and .md (default {name})")
    if models is not None:
        known = f"; known: {', '.join(known_models)}" if known_models else ""
        if models is REQUIRED:
            p.add_argument("--models", "--model", dest="models", required=True, help=f"comma-separated{known}")
        else:
            p.add_argument("--models", "--model", dest="models", default=models,
                           help=f"comma-separated (default {models}){known}")
    if quick:
        p.add_argument("--quick", action="store_true", help="small shapes, fewer steps; writes <name>-quick.*")
    if threads is not None:
        p.add_argument("--threads", type=int, default=threads,
                       help=f"torch.set_num_threads (default {threads}: steady times on a shared machine; "
                            "0: torch's default)")
    if device is not None:
        p.add_argument("--device", default=device, help=f"cpu or cuda (default {device})")
    if out_dir:
        p.add_argument("--out-dir", type=Path, default=RESULTS, help="where results go (default bench/results)")
    return p


def split(text: str) -> list[str]:
    return [s.strip() for s in text.split(",") if s.strip()]


def parse(p: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> argparse.Namespace:
    """``p.parse_args(argv)``, then: ``models`` as a list (checked), ``name`` with ``-quick`` under
    ``--quick``, and ``command``: the command line that reproduces the run."""
    a = p.parse_args(argv)
    if isinstance(getattr(a, "models", None), str):
        a.models = split(a.models)
        unknown = [m for m in a.models if a._known_models and m not in a._known_models]
        if unknown or not a.models:
            p.error(f"unknown models {unknown}; known: {', '.join(a._known_models)}" if unknown else "no models given")
    if a._quick_suffix and getattr(a, "quick", False) and not a.name.endswith("-quick"):
        a.name += "-quick"
    a.command = command_line(argv, a._script)
    return a


def set_threads(threads: int | None) -> None:
    """``torch.set_num_threads(threads)`` unless it is 0 or None (torch's default)."""
    if threads:
        import torch

        torch.set_num_threads(threads)


# --- scripts whose results end in a table of targets -------------------------------------------


def run_with_targets(ap: argparse.ArgumentParser, run, argv: Sequence[str] | None = None,
                     spec: str | None = None) -> int:
    """Parse ``ap``, run ``run(args) -> (records, info)`` (``info["targets"]``: ``{target, value,
    limit, met}``), write ``<name>.json``/``.md`` through ``harness.write`` (``info`` with ``name``
    and ``wall_s`` as the run's settings), print the targets; exit status 0 when every one is met."""
    import time

    import harness

    args = parse(ap, argv)
    set_threads(args.threads)
    meta = metadata(args.command)
    t0 = time.perf_counter()
    records, info = run(args)
    targets = info.pop("targets")
    info.update(name=args.name, wall_s=round(time.perf_counter() - t0, 1))
    jp, _ = harness.write(args.name, records, args.out_dir, meta=meta, run=info, targets=targets, spec=spec)
    for t in targets:
        print(f"    {t['target']}: {'met' if t['met'] else 'MISSED'}", flush=True)
    print(f"wrote {jp} and .md ({info['wall_s']:.0f} s)", flush=True)
    return 0 if all(t["met"] for t in targets) else 1


def zoo_steps(w, options: dict, steps: int = 3):
    """``steps`` training steps of a fresh fxmem compile (eager inner compiler unless ``options``
    say otherwise) of a copy of the zoo workload ``w``: (compiled, the model copy, the measured
    peak of the last step, the warnings caught). The last step is measured: HF's classification
    heads set ``config.problem_type`` on the first call, so the second compiles again."""
    import copy
    import warnings

    import torch

    from fxmem.profiling import step_perf

    torch._dynamo.reset()
    model = copy.deepcopy(w.model)
    fn = torch.compile(model, backend="fxmem", options={"inner": "eager", **options})
    with warnings.catch_warnings(record=True) as caught, torch._dynamo.config.patch(allow_rnn=True):
        warnings.simplefilter("always")
        for _ in range(steps):
            model.zero_grad(set_to_none=True)
            torch.manual_seed(1)
            with step_perf("cpu") as perf:
                w.loss(fn(**w.batch)).backward()
    return fn, model, perf.result.peak_bytes, [str(c.message) for c in caught]
