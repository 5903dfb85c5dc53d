"""The documentation's links resolve (files and their headings), user pages name no work items, and the
page that says which setting to use lists every setting the library has."""

from __future__ import annotations

import re
from pathlib import Path

from decentadam import SETTINGS

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted(
    [ROOT / "README.md"]
    + [
        p
        for folder in ("docs", "recipes", "benchmarks", "eval", "examples")
        for p in (ROOT / folder).rglob("*.md")
    ]
)
USER_PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]  # not the results log's records
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.replace("`", "").strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found: set[str] = set()
    seen: dict[str, int] = {}
    for line in FENCE.sub("", page.read_text()).splitlines():
        match = re.match(r"^#{1,6}\s+(.*)$", line)
        if match:
            base = slug(match.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def broken_links(page: Path) -> list[str]:
    """Relative links of ``page`` whose file is missing, or whose ``#anchor`` is no heading of it."""
    broken = []
    for target in LINK.findall(FENCE.sub("", page.read_text())):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        destination = (page.parent / path).resolve() if path else page
        if not destination.exists() or (
            anchor and destination.suffix == ".md" and anchor not in anchors(destination)
        ):
            broken.append(target)
    return broken


def test_the_checks_find_a_broken_link_and_a_missing_anchor(tmp_path: Path) -> None:
    (tmp_path / "a.md").write_text("# Title `x`\n\n## Two words\n")
    page = tmp_path / "b.md"
    page.write_text(
        "[ok](a.md#two-words) [ok](a.md#title-x) [no](c.md) [no](a.md#three) [web](https://x.y)\n"
    )
    assert broken_links(page) == ["c.md", "a.md#three"]


def test_every_relative_link_resolves() -> None:
    assert ROOT / "docs" / "choosing.md" in PAGES and len(PAGES) > 20
    found = {str(p.relative_to(ROOT)): links for p in PAGES if (links := broken_links(p))}
    assert found == {}


def test_user_pages_name_no_work_items_nor_notebook_sections() -> None:
    pattern = re.compile(r"\bissues? \d+|\bsection \d+ of|parity\.md,? section", re.I)
    found = {str(p.relative_to(ROOT)): pattern.findall(p.read_text()) for p in USER_PAGES}
    assert {page: hits for page, hits in found.items() if hits} == {}


def test_the_choosing_page_has_every_setting_and_the_readme_stays_short() -> None:
    choosing = (ROOT / "docs" / "choosing.md").read_text()
    assert [name for name in SETTINGS if f"| `{name}` |" not in choosing] == []
    assert len(choosing.splitlines()) <= 150
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200 and "](docs/demo.png)" in readme
    assert "make demo" in readme and "make test" in readme
