"""The documentation a newcomer reads: every link in the README and docs/ names a file of this repository that
exists (none leaves it), and docs/README.md indexes every page of docs/ (issue 26)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def pages() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def local_links(page: Path) -> list[str]:
    return [t.split("#", 1)[0] for t in LINK.findall(page.read_text())
            if not re.match(r"[a-z][a-z0-9+.-]*:", t) and not t.startswith("#")]


def test_every_link_names_a_file_inside_the_repository():
    broken = []
    for page in pages():
        for target in local_links(page):
            resolved = (page.parent / target).resolve()
            if not resolved.is_relative_to(REPO) or not resolved.exists():
                broken.append(f"{page.relative_to(REPO)} -> {target}")
        if "../shared/" in page.read_text():   # the workplace's reference files, which a clone does not have
            broken.append(f"{page.relative_to(REPO)} names ../shared/")
    assert not broken, broken


def test_the_docs_index_names_every_page():
    indexed = set(local_links(REPO / "docs" / "README.md"))
    missing = [p.name for p in (REPO / "docs").glob("*.md") if p.name != "README.md" and p.name not in indexed]
    assert not missing, f"docs/README.md does not index {missing}"


def test_the_link_finder_sees_a_link_that_leaves_the_repository(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("see [the facts](../shared/reference/facts.md), [a site](https://example.com), [here](#top)")
    assert local_links(page) == ["../shared/reference/facts.md"]
