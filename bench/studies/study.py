"""The command line shared by the budget studies (``budget_bound.py``, ``budget_floor.py``): models
and fractions in, ``<out-dir>/<name>.{json,md}`` out."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Callable

HERE = Path(__file__).resolve().parent


def main(doc: str, script: str, name: str, fractions: str, run: Callable[[str, list[float], bool], dict],
         markdown: Callable[[str, str, list[dict]], str], argv: list[str] | None = None) -> None:
    """Parse the arguments, ``run(model, fractions, quick)`` per model, write and print the results."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--name", default=name)
    p.add_argument("--models", default="hf_gpt2,hf_llama")
    p.add_argument("--fractions", default=fractions)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out-dir", default=str(HERE / "results"))
    a = p.parse_args(argv)
    import torch

    torch.set_num_threads(a.threads)
    results = [run(m, [float(f) for f in a.fractions.split(",")], a.quick) for m in a.models.split(",")]
    cmd = f"python bench/{script} " + " ".join(sys.argv[1:] if argv is None else argv)
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{a.name}.json").write_text(json.dumps({"command": cmd, "results": results}, indent=1))
    (out / f"{a.name}.md").write_text(markdown(a.name, cmd, results))
    print((out / f"{a.name}.md").read_text())
