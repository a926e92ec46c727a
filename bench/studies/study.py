"""The command line shared by the budget studies (``budget_bound.py``, ``budget_floor.py``): bench's
common flags plus ``--fractions``; ``run(model, fractions, quick)`` per model, then
``<out-dir>/<name>.{json,md}`` through ``harness.write`` (the study's table spec renders them)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable

BENCH = Path(__file__).resolve().parents[1]
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import common  # noqa: E402
import configs  # noqa: E402
import harness  # noqa: E402


def main(doc: str, script: str, name: str, fractions: str, run: Callable[[str, list[float], bool], dict],
         argv: list[str] | None = None) -> None:
    """Parse the arguments, ``run(model, fractions, quick)`` per model, write and print the results.

    ``script``: the study's file (``__file__``), named in the recorded command."""
    p = common.parser(doc, name=name, models="hf_gpt2,hf_llama", known_models=tuple(configs.MODELS), script=script)
    p.add_argument("--fractions", default=fractions, help=f"comma-separated budget fractions (default {fractions})")
    a = common.parse(p, argv)
    common.set_threads(a.threads)
    meta = common.metadata(a.command)
    fracs = [float(f) for f in common.split(a.fractions)]
    results = [run(m, fracs, a.quick) for m in a.models]
    _, mp = harness.write(a.name, results, a.out_dir, meta=meta, spec=name,
                          run={"models": a.models, "fractions": fracs, "quick": a.quick, "threads": a.threads})
    print(mp.read_text())
