"""Every Python block of README.md and docs/testing.md runs as printed (small models: seconds)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "docs/testing.md")
BLOCKS = {doc: re.findall(r"```python\n(.*?)```", (ROOT / doc).read_text(), flags=re.S) for doc in DOCS}


@pytest.mark.parametrize("doc", DOCS)
def test_the_docs_have_python_blocks(doc):
    assert BLOCKS[doc], f"{doc} has no ```python block to check"


@pytest.mark.slow
@pytest.mark.parametrize("doc, index", [(doc, i) for doc in DOCS for i in range(len(BLOCKS[doc]))])
def test_doc_block_runs_as_printed(doc, index, tmp_path):
    block = BLOCKS[doc][index]
    script = tmp_path / f"block_{index}.py"
    script.write_text(block)
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert run.returncode == 0, f"{doc} block {index} failed:\n{block}\n{run.stderr[-3000:]}"
