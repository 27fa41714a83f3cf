"""The pages keep their limits (issue 72): the README stays a user's page and docs/performance.md the current
state, both within their line counts; the docs speak of the project, its dates and its findings, never of who
worked or in what sitting; every relative link in them reaches a file, and a heading where it names one; and
every benchmark left is cited by its path in a page, in rooms of at most 12 files."""
from __future__ import annotations

import re
import unicodedata
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LIMITS = {"README.md": 120, "docs/performance.md": 400}
LINK = re.compile(r"\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = heading.strip().lower()
    kept = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LNM")
    return kept.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading's anchor in a Markdown page (fenced code skipped), repeats numbered as GitHub does."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    fenced = False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        m = None if fenced else re.match(r"#{1,6} (.+)", line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def name(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


@pytest.mark.parametrize("page", list(LIMITS))
def test_page_within_its_line_limit(page):
    lines = len((ROOT / page).read_text().splitlines())
    assert lines <= LIMITS[page], f"{page} has {lines} lines, its limit is {LIMITS[page]}"


@pytest.mark.parametrize("page", PAGES, ids=name)
def test_no_page_speaks_of_sessions(page):
    hits = [f"{name(page)}:{i}" for i, line in enumerate(page.read_text().splitlines(), 1)
            if "session" in line.lower()]
    assert not hits, f"say the date and the finding, not the sitting: {hits}"


@pytest.mark.parametrize("page", PAGES, ids=name)
def test_every_relative_link_resolves(page):
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target} (no such heading)")
    assert not broken, f"{name(page)}: {broken}"


def test_every_benchmark_is_cited_and_no_room_is_crowded():
    files = [p for p in (ROOT / "benchmarks").rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    pages = "\n".join(p.read_text() for p in PAGES)
    uncited = [name(p) for p in files if p.suffix in (".py", ".sh") and p.parent.name != "common"
               and name(p) not in pages]
    assert not uncited, f"benchmarks no page cites by path (cite it, or record it in the journal and git rm it): {uncited}"
    crowded = {name(room): n for room, n in Counter(p.parent for p in files).items() if n > 12}
    assert not crowded, f"rooms of more than 12 files: {crowded}"
