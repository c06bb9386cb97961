"""docs/ is reference, not a work log: no page gives an account of a numbered session ("session 4", "sessions
8 and 9") or dates what it says (2026-12-03); a study's history goes to its own log under experiments/, git keeps
the rest. Fast: reads the Markdown files only."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

_SESSION = re.compile(r"\bsessions?\s+\d+", re.I)
_DATE = re.compile(r"\b(?:19|20)\d\d-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12]\d|3[01])\b")


def history_marks(text: str) -> list[str]:
    """The work-log marks in a page's text: every "session N" / "sessions N" and every ISO date (YYYY-MM-DD)."""
    return [m.group(0) for m in _SESSION.finditer(text)] + [m.group(0) for m in _DATE.finditer(text)]


def test_history_marks_on_a_hand_written_page():
    page = ("Measured in the fourth session (2026-12-03). Sessions 8 and 9 scored no cell; session 10 did.\n"
            "The session's state (`--piece pack`), 30 minutes per session, version 2026.1, 2026-13-40 are fine.\n")
    assert history_marks(page) == ["Sessions 8", "session 10", "2026-12-03"]


@pytest.mark.parametrize("md", sorted((ROOT / "docs").glob("*.md")), ids=lambda p: p.name)
def test_docs_page_is_reference_not_a_log(md: Path):
    marks = history_marks(md.read_text(encoding="utf-8"))
    assert not marks, (f"docs/{md.name} reads as a work log ({marks[:5]}): say how it works and what was measured, "
                       "with the file and command; a study's history goes to its own log (e.g. "
                       "experiments/conversion-generalization/LOG.md)")
