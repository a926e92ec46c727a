"""Regenerate every bench/results/*.md and the marked tables of README.md and docs/benchmarks.md
from the results' rows; with ``--check``, change nothing and exit 1 naming each file and table
that differs from what the results generate.

    python bench/render.py            # rewrite what differs
    python bench/render.py --check    # CI: fail on a table edited by hand or a result not rendered

A generated region of a doc is ``<!-- bench:NAME -->`` ... ``<!-- /bench -->``: NAME is
``<study>:<table>`` (a table of that study's spec, e.g. ``planner-final:main``) or a name of
``tables.DOC_TABLES`` (tables drawing on several studies, e.g. ``readme-peaks``).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402
import results_format  # noqa: E402
import tables  # noqa: E402

ROOT = results_format.BENCH.parent
DOCS = ("README.md", "docs/benchmarks.md")
REGION = re.compile(r"(<!-- bench:(?P<name>[^ ]+) -->\n)(?P<body>.*?)(<!-- /bench -->)", re.S)


def doc_table(name: str, results: dict[str, results_format.Results]) -> str:
    """The markdown of the region NAME (see the module docstring)."""
    if name in tables.DOC_TABLES:
        return "\n".join(tables.DOC_TABLES[name](results)) + "\n"
    study, _, table = name.partition(":")
    if study not in results:
        raise KeyError(f"region {name!r}: no bench/results/{study}.json")
    res = results[study]
    spec = tables.spec_for(res.meta.get("spec") or tables.spec_name(study))
    records = {c: {"__case__": c, **r} for c, r in res.records().items()}
    for t in tables.tables_of(spec, records):
        if t.name == table:
            return "\n".join(t.lines(records)) + "\n"
    raise KeyError(f"region {name!r}: spec {spec.name!r} has no table {table!r}")


def render_doc(text: str, results: dict[str, results_format.Results]) -> tuple[str, list[str]]:
    """``text`` with every region regenerated, and the names of the regions that changed."""
    changed: list[str] = []

    def sub(m: re.Match) -> str:
        new = doc_table(m["name"], results)
        if new != m["body"]:
            changed.append(m["name"])
        return m.group(1) + new + m.group(4)

    return REGION.sub(sub, text), changed


def expected(root: Path = ROOT) -> dict[Path, tuple[str, list[str]]]:
    """Every generated file: its path -> (the text the results generate, what differs: table
    names for docs, ``["whole file"]`` for results markdown; empty when it is up to date)."""
    results_dir = root / "bench" / "results"
    results = results_format.read_all(results_dir)
    out: dict[Path, tuple[str, list[str]]] = {}
    for study, res in results.items():
        path = results_dir / f"{study}.md"
        text = harness.render(res)
        out[path] = (text, [] if path.exists() and path.read_text() == text else ["whole file"])
    for doc in DOCS:
        path = root / doc
        out[path] = render_doc(path.read_text(), results)
    stray = sorted(p.name for p in results_dir.glob("*.md") if p.with_suffix(".json").name not in
                   {f"{s}.json" for s in results})
    for name in stray:
        out[results_dir / name] = ("", [f"no {Path(name).stem}.json to generate it"])
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 when a file differs")
    p.add_argument("--root", type=Path, default=ROOT, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    bad = 0
    for path, (text, diff) in expected(a.root).items():
        if not diff:
            continue
        shown = path.relative_to(a.root)
        if a.check:
            bad += 1
            print(f"{shown}: differs from what bench/results generates: {', '.join(diff)}", file=sys.stderr)
        elif text:
            path.write_text(text)
            print(f"wrote {shown} ({', '.join(diff)})")
    if a.check and bad:
        print("run `python bench/render.py` to regenerate", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
