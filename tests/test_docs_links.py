"""The README stays a newcomer's page (at most 300 lines) and no relative link in README.md, docs/*.md or the pages
that cite committed results (:func:`markdown_files`) points at a missing file or heading (fast: reads the Markdown
files only, no model)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 300

_FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.S | re.M)
_CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.S)
# [text](target "title") and ![alt](target); the text may hold one level of brackets
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def markdown_files() -> list[Path]:
    """README.md, docs/*.md and the pages that cite the committed results: benchmarks/README.md, experiments/README.md
    and the conversion study's README and LOG."""
    study = ROOT / "experiments" / "conversion-generalization"
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md",
            ROOT / "experiments" / "README.md", study / "README.md", study / "LOG.md"]


def _strip_code(text: str) -> str:
    text = _FENCE.sub("", text)
    return _CODE_SPAN.sub(lambda m: m.group(1) + "x" * len(m.group(2)) + m.group(1), text)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped (letters of any script, digits, ``-`` and
    ``_`` kept), spaces to hyphens."""
    h = re.sub(r"[^\w\- ]", "", heading.replace("`", "").strip().lower())
    return h.replace(" ", "-")


def anchors(md: Path) -> set[str]:
    text = _FENCE.sub("", md.read_text(encoding="utf-8"))
    return {slug(h) for h in re.findall(r"^#{1,6}\s+(.*?)\s*#*\s*$", text, re.M)}


def relative_links(text: str) -> list[str]:
    """Link targets of a Markdown text that point into the repository: fenced code blocks and code spans
    are skipped (a link inside code is an example, not a link), as are URLs with a scheme (http:, mailto:)
    and links to an anchor of the same page; ``#anchor`` and ``?query`` parts are dropped."""
    out = []
    for target in _LINK.findall(_strip_code(text)):
        if _SCHEME.match(target) or target.startswith("#"):
            continue
        path = target.split("#", 1)[0].split("?", 1)[0]
        if path:
            out.append(path)
    return out


def test_link_parser_on_a_hand_written_page():
    page = (
        "See [the engine](docs/engine.md#self-check) and ![fig](../a/b.png \"t\").\n"
        "A [`file.json`](results/file.json), a [web page](https://example.org/x.md), [top](#top),\n"
        "`[not a link](nowhere.md)` and\n```\n[inside a fence](fenced.md)\n```\n[two [brackets]](c.md)\n"
    )
    assert relative_links(page) == ["docs/engine.md", "../a/b.png", "results/file.json", "c.md"]


def test_slug_on_hand_written_headings():
    assert slug("Full HydraHead selection: senders, κ, capability fusion") == \
        "full-hydrahead-selection-senders-κ-capability-fusion"
    assert slug("Other head selectors (`headscope.selectors`)") == "other-head-selectors-headscopeselectors"
    assert slug("Measured on 2 × H200") == "measured-on-2--h200"


def test_readme_is_at_most_300_lines():
    n = len((ROOT / "README.md").read_text(encoding="utf-8").splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines; move reference material to docs/"


def test_docs_pages_exist():
    names = {p.name for p in (ROOT / "docs").glob("*.md")}
    for page in ("SPEC.md", "api.md", "engine.md", "anatomy-and-knockout.md", "selectors.md", "hybrid.md",
                 "conversion.md", "performance.md", "scaling.md", "extending.md", "architecture.md",
                 "known-issues.md"):
        assert page in names, f"docs/{page} is missing"


@pytest.mark.parametrize("md", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_at_existing_files(md: Path):
    links = relative_links(md.read_text(encoding="utf-8"))
    missing = []
    for link in links:
        target = (md.parent / link).resolve()
        if not target.exists() or ROOT not in (target, *target.parents):
            missing.append(link)
    assert not missing, f"{md.relative_to(ROOT)}: links to missing files: {missing}"


def test_every_docs_page_is_linked_from_the_readme():
    linked = {Path(link).name for link in relative_links((ROOT / "README.md").read_text(encoding="utf-8"))
              if link.startswith("docs/")}
    unlinked = sorted(p.name for p in (ROOT / "docs").glob("*.md") if p.name not in linked)
    assert not unlinked, f"docs pages missing from the README's index: {unlinked}"


@pytest.mark.parametrize("md", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_anchors_of_links_to_markdown_pages_exist(md: Path):
    bad = []
    for target in _LINK.findall(_strip_code(md.read_text(encoding="utf-8"))):
        if "#" not in target or _SCHEME.match(target):
            continue
        page, anchor = target.split("#", 1)
        dest = md if not page else (md.parent / page)
        if dest.suffix == ".md" and dest.exists() and anchor not in anchors(dest):
            bad.append(target)
    assert not bad, f"{md.relative_to(ROOT)}: links to missing headings: {bad}"
