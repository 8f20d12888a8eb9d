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


#: What a clone does not have: the workplace's research notes, by any of the names they were cited by.
OUTSIDE_NOTES = re.compile(r"shared/reference|serving-scaling-facts|reference (?:corrections|upstream-facts)")
FACT_LABEL = re.compile(r"upstream-facts(?:\.md)? §?([A-Z]?[0-9]+(?:\.[0-9]+)?|[A-Z])\b")
TEXT_FILES = ("*.md", "*.py", "*.json", "*.toml", "Dockerfile", "*.sh", "*.yml")


def repository_texts() -> list[Path]:
    skip = {".git", ".venv", "out", "node_modules"}
    return [p for pattern in TEXT_FILES for p in REPO.rglob(pattern)
            if not skip & set(p.relative_to(REPO).parts) and p != Path(__file__)]


def fact_sections() -> set[str]:
    text = (REPO / "docs" / "upstream-facts.md").read_text()
    return set(re.findall(r"^#{2,3} ([A-Z]?[0-9]*(?:\.[0-9]+)?)\.? ", text, re.M)) - {""}


def test_no_file_sends_a_reader_to_notes_outside_the_repository():
    named = [f"{p.relative_to(REPO)}: {m.group(0)}" for p in repository_texts()
             for m in OUTSIDE_NOTES.finditer(p.read_text(errors="replace"))]
    assert not named, named


def test_every_cited_upstream_facts_section_exists():
    sections = fact_sections()
    assert {"0", "A1", "B2", "S1", "S2", "S3", "S4"} <= sections
    missing = sorted({f"{p.relative_to(REPO)}: §{label}" for p in repository_texts()
                      for label in FACT_LABEL.findall(p.read_text(errors="replace")) if label not in sections})
    assert not missing, missing


def test_the_fact_label_finder_reads_each_way_a_section_is_cited():
    text = "upstream-facts A4, docs/upstream-facts.md §S2 and upstream-facts.md K; reference/upstream-facts.md §A1"
    assert FACT_LABEL.findall(text) == ["A4", "S2", "K", "A1"]
    assert OUTSIDE_NOTES.search("see ../shared/reference/corrections.md")
