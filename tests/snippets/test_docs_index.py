"""The docs can be found from the top (issue 58): docs/README.md links every page with a line on each, the README
links that index and the pages it once left out, and its first Python block comes within ~400 words."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_index_links_every_page():
    index = (ROOT / "docs" / "README.md").read_text(encoding="utf-8")
    pages = sorted(p.name for p in (ROOT / "docs").glob("*.md") if p.name != "README.md")
    linked = set(re.findall(r"\]\(([\w.]+\.md)\)", index))
    assert set(pages) <= linked, sorted(set(pages) - linked)
    assert all((ROOT / "docs" / name).exists() for name in linked), sorted(linked)


def test_the_readme_links_the_index_and_reads_from_the_top():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for page in ("docs/README.md", "docs/design.md", "docs/adapters.md"):
        assert f"]({page})" in readme, page
    before = readme[: readme.index("```python")]
    words = len(re.sub(r"```.*?```", "", before, flags=re.S).split())
    assert words <= 400, f"{words} words before the first Python block"
    assert before.index("## Quickstart") < len(before)
