"""Every module of ``headscope`` has a file name of its own (issue 64, item 3: a name says its role and appears once).

``__init__.py`` and ``base.py`` (a sub-package's shared base) may repeat; any other repeated name fails.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "headscope"
ALLOWED = {"__init__.py", "base.py"}


def repeated_names(root: Path) -> dict[str, set[str]]:
    """File name -> the paths (relative to ``root``) of the modules that share it, for every shared name."""
    where: dict[str, set[str]] = defaultdict(set)
    for path in root.rglob("*.py"):
        where[path.name].add(path.relative_to(root).as_posix())
    return {name: paths for name, paths in where.items() if len(paths) > 1}


def test_the_finder_sees_a_repeat(tmp_path):
    for rel in ("a/config.py", "b/config.py", "a/base.py", "b/base.py", "c/own.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    assert repeated_names(tmp_path) == {"config.py": {"a/config.py", "b/config.py"},
                                        "base.py": {"a/base.py", "b/base.py"}}


def test_no_two_modules_share_a_name():
    found = {n: p for n, p in repeated_names(PACKAGE).items() if n not in ALLOWED}
    assert not found, f"modules sharing a file name (rename one so its name says its role): {found}"
