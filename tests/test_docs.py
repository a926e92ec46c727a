"""The API reference names everything fxmem exports; docs link to pages that exist."""

import re
from pathlib import Path

import fxmem

ROOT = Path(__file__).resolve().parents[1]


def test_api_reference_covers_fxmem_all():
    text = (ROOT / "docs" / "api.md").read_text()
    headings = " ".join(line for line in text.splitlines() if line.startswith("### "))
    missing = [name for name in fxmem.__all__ if f"`{name}" not in headings]
    assert not missing, f"docs/api.md has no entry for {missing}"


def test_docs_link_to_pages_and_files_that_exist():
    for page in [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" in target:
                continue
            assert (page.parent / target).exists(), f"{page.name} links to {target}, which does not exist"
