"""Every Python block of README.md runs as printed (small models: seconds)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BLOCKS = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)


def test_the_readme_has_python_blocks():
    assert BLOCKS, "README.md has no ```python block to check"


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_block_runs_as_printed(index, tmp_path):
    script = tmp_path / f"readme_{index}.py"
    script.write_text(BLOCKS[index])
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert run.returncode == 0, f"README block {index} failed:\n{BLOCKS[index]}\n{run.stderr[-3000:]}"
