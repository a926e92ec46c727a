"""Every Python block of README.md and docs/*.md runs as printed (small models: seconds to a
minute). A block whose first line names ``torchrun`` runs under torchrun with 2 CPU processes."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")))
BLOCKS = {doc: re.findall(r"```python\n(.*?)```", (ROOT / doc).read_text(), flags=re.S) for doc in DOCS}
CASES = [(doc, i) for doc in DOCS for i in range(len(BLOCKS[doc]))]


@pytest.mark.parametrize("doc", ["README.md", "docs/testing.md", "docs/integrations.md", "docs/reports.md"])
def test_the_docs_have_python_blocks(doc):
    assert BLOCKS[doc], f"{doc} has no ```python block to check"


def test_ci_runs_the_readmes_test_command_in_a_fresh_venv():
    """.ci/run is what a new user does: the README's test command, as printed, inside a virtual
    environment it creates (so CI sees today's releases, not the machine's packages), and the
    quick loop on the newest torch the README says is tested."""
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    command = re.search(r"Run the tests.*?\n\n    (.+?)\n", readme, flags=re.S).group(1)
    assert command.startswith("pip install torch==") and command.endswith("python -m pytest -q"), command
    ci_line = next(line for line in ci.splitlines() if line.rstrip().endswith("python -m pytest -q"))
    as_printed = " && ".join(step.strip().replace("pip install -q ", "pip install ")
                             for step in ci_line.split("&&") if step.strip() != "versions")
    assert as_printed == command, (ci_line, command)
    assert "python -m venv" in ci and "source" in ci
    newest = re.search(r"NEWEST_TORCH=(\S+)", ci).group(1)
    tested = re.search(r"Tested with (.+?)\.(?:\s|$)", readme.replace("\n", " ")).group(1)
    assert "torch 2.13.0" in tested and newest in tested, tested


def test_torchrun_blocks_say_so_on_their_first_line():
    """A block that initializes a process group cannot run as `python block.py`: its first line says how."""
    for doc, i in CASES:
        block = BLOCKS[doc][i]
        if "init_process_group" in block:
            assert "torchrun" in block.splitlines()[0], f"{doc} block {i} needs torchrun and does not say so first"


@pytest.mark.slow
@pytest.mark.parametrize("doc, index", CASES, ids=[f"{d}-{i}" for d, i in CASES])
def test_doc_block_runs_as_printed(doc, index, tmp_path):
    block = BLOCKS[doc][index]
    script = tmp_path / f"block_{index}.py"
    script.write_text(block)
    launcher = [sys.executable]
    if "torchrun" in block.splitlines()[0]:
        launcher += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    run = subprocess.run([*launcher, str(script)], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert run.returncode == 0, f"{doc} block {index} failed:\n{block}\n{run.stderr[-3000:]}"
