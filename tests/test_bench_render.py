"""bench/render.py, bench/harness.py and bench/results_format.py: every committed result is in the
one format, its markdown and the marked tables of README.md and docs/benchmarks.md are what the rows
generate, and a table edited by hand fails ``--check`` with the file and the table named."""

import json
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import render  # noqa: E402
import results_format  # noqa: E402


def test_the_committed_results_and_docs_pass_the_check(capsys):
    assert render.main(["--check"]) == 0, capsys.readouterr().err
    for path in (ROOT / "bench" / "results").glob("*.json"):
        doc = json.loads(path.read_text())
        assert set(doc) == {"study", "meta", "rows"} and doc["study"] == path.stem, path


def _copy(tmp_path: Path) -> Path:
    (tmp_path / "docs").mkdir()
    for doc in render.DOCS:
        shutil.copy(ROOT / doc, tmp_path / doc)
    shutil.copytree(ROOT / "bench" / "results", tmp_path / "bench" / "results")
    return tmp_path


def test_a_tampered_readme_table_fails_the_check_and_render_restores_it(tmp_path, capsys):
    root = _copy(tmp_path)
    readme = root / "README.md"
    good = readme.read_text()
    line = "| `fxmem-eager` | fxmem level 0, eager graphs | 272.1 |"
    assert line in good
    readme.write_text(good.replace(line, line.replace("272.1", "262.1")))
    assert render.main(["--check", "--root", str(root)]) == 1
    assert "README.md: differs from what bench/results generates: readme-peaks" in capsys.readouterr().err
    assert render.main(["--root", str(root)]) == 0 and readme.read_text() == good
    assert render.main(["--check", "--root", str(root)]) == 0


def test_a_changed_result_fails_the_check_in_its_markdown_and_the_docs(tmp_path, capsys):
    root = _copy(tmp_path)
    path = root / "bench" / "results" / "planner-final.json"
    doc = json.loads(path.read_text())
    (row,) = [r for r in doc["rows"] if r["case"] == "hf_llama/fxmem-eager" and r["metric"] == "peak_bytes"]
    row["value"] += 2**20
    path.write_text(json.dumps(doc))
    assert render.main(["--check", "--root", str(root)]) == 1
    err = capsys.readouterr().err
    assert "bench/results/planner-final.md: differs" in err
    assert "docs/benchmarks.md: differs from what bench/results generates: planner-final:main" in err
    assert "README.md: differs from what bench/results generates: readme-peaks" in err


def test_records_become_long_rows_and_back():
    case = results_format.Case("gpt2_small", "fxmem-L1", "b8xs256", "realistic")
    assert results_format.Measurement(case.name, "peak_bytes", 5, "bytes").row("realistic", "c", "t") == {
        "study": "realistic", "case": "gpt2_small/fxmem-L1/b8xs256", "metric": "peak_bytes", "unit": "bytes",
        "value": 5, "commit": "c", "time": "t"}
    recs = [{"model": "m", "config": "a", "peak_bytes": 10, "times": [0.5, 0.25], "plan": {"level": 1}, "x": None},
            {"model": "m", "config": "b", "peak_bytes": 7}]
    rows = results_format.records_to_rows("s", recs, ("model", "config"), "c0ffee", "2026-01-01 00:00:00")
    assert rows[2] == {"study": "s", "case": "m/a", "metric": "peak_bytes", "unit": "bytes", "value": 10,
                       "commit": "c0ffee", "time": "2026-01-01 00:00:00"}
    assert results_format.pivot(rows) == {"m/a": {"model": "m", "config": "a", "peak_bytes": 10, "times[0]": 0.5,
                                           "times[1]": 0.25, "plan.level": 1},
                                   "m/b": {"model": "m", "config": "b", "peak_bytes": 7}}
    assert [r["unit"] for r in rows if r["metric"].startswith("times")] == ["s", "s"]
    back = results_format.unflatten(results_format.pivot(rows)["m/a"])
    assert back == {k: v for k, v in recs[0].items() if v is not None}
    with pytest.raises(ValueError, match=r"two records have the case 'm/b'"):
        results_format.records_to_rows("s", recs + recs[1:], ("model", "config"), None, None)


@pytest.mark.parametrize("doc, message", [
    ({"name": "x", "results": []}, "expected an object with keys study, meta, rows"),
    ({"study": "x", "meta": {}, "rows": [{"study": "x", "case": "c", "metric": "m", "value": 1}]},
     "row 0 must have the keys study, case, metric, unit, value, commit, time"),
    ({"study": "x", "meta": {}, "rows": [dict(zip(results_format.ROW_KEYS, ("y", "c", "m", "", 1, None, None)))]},
     "row 0 is of study 'y', the file's is 'x'"),
    ({"study": "x", "meta": {}, "rows": [dict(zip(results_format.ROW_KEYS, ("x", "c", "m", "", [1], None, None)))]},
     "value must be a number, string or bool"),
])
def test_a_file_not_in_the_format_is_refused_naming_what_is_wrong(doc, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        results_format.check(doc, "f.json")
