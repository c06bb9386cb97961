"""No module-level behaviour switch in headscope/hybrid: the fast paths' choices live in InferenceConfig.

The checkable rule (issue 39): in every module of ``headscope/hybrid``

1. no module-level UPPERCASE name (``NAME`` or ``_NAME``) is bound to a bool or None literal, or annotated
   ``Optional`` — the shape of an on/off/auto switch; a str literal only under a name ending in ``_KEY`` or
   ``_ATTR`` (the name of a key or an attribute, not a choice of behaviour); int / float / tuple constants
   (kernel tile sizes, thresholds) stay;
2. no function rebinds a module-level name (no ``global`` statement);
3. no test sets an UPPERCASE attribute of a ``headscope.hybrid`` module (``monkeypatch.setattr(mod, "NAME", ...)``
   or ``mod.NAME = ...``): a variant is ``dataclasses.replace(InferenceConfig(), ...)`` passed to the model.
"""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
HYBRID = ROOT / "headscope" / "hybrid"
UPPER = re.compile(r"^_?[A-Z][A-Z0-9_]*$")
# owned by the reference layer's rewrite (issue 39 item 1): its in-place low-memory stages' switch and block size
EXEMPT = {("layer.py", "BLOCK")}


def _modules():
    return sorted(p for p in HYBRID.rglob("*.py"))


def _switches(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    rel = str(path.relative_to(HYBRID)) if path.is_relative_to(HYBRID) else path.name
    found = []
    for node in tree.body:
        targets, value, ann = [], None, None
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign):
            targets, value, ann = [node.target], node.value, node.annotation
        for t in targets:
            if not (isinstance(t, ast.Name) and UPPER.match(t.id)) or (rel, t.id) in EXEMPT:
                continue
            const = value.value if isinstance(value, ast.Constant) else ...
            if const is None or isinstance(const, bool):
                found.append(f"{rel}:{node.lineno} {t.id} = {const!r}")
            elif isinstance(const, str) and not t.id.endswith(("_KEY", "_ATTR")):
                found.append(f"{rel}:{node.lineno} {t.id} = {const!r}")
            elif ann is not None and "Optional" in ast.unparse(ann):
                found.append(f"{rel}:{node.lineno} {t.id}: {ast.unparse(ann)}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            found.append(f"{rel}:{node.lineno} global {', '.join(node.names)}")
    return found


def test_no_module_level_switch_in_hybrid():
    found = [s for p in _modules() for s in _switches(p)]
    assert not found, "module-level switches (move them into InferenceConfig):\n" + "\n".join(found)


def _hybrid_aliases(tree: ast.Module) -> set[str]:
    """Names a test module binds to headscope.hybrid modules (import ... as x, from headscope.hybrid import x)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("headscope.hybrid.") and a.asname:
                    names.add(a.asname)
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("headscope.hybrid"):
            for a in node.names:
                if (HYBRID / f"{a.name}.py").exists() or (HYBRID / a.name).is_dir() or node.module.count(".") > 1 and (
                        HYBRID.joinpath(*node.module.split(".")[2:]) / f"{a.name}.py").exists():
                    names.add(a.asname or a.name)
    return names


def _switch_sets(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    mods = _hybrid_aliases(tree)
    found = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "setattr"
                and len(node.args) >= 2 and isinstance(node.args[0], ast.Name) and node.args[0].id in mods
                and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
                and UPPER.match(node.args[1].value)):
            found.append(f"{path.name}:{node.lineno} setattr({node.args[0].id}, {node.args[1].value!r})")
        if isinstance(node, (ast.Assign, ast.AugAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if (isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id in mods
                        and UPPER.match(t.attr)):
                    found.append(f"{path.name}:{node.lineno} {t.value.id}.{t.attr} = ...")
    return [f for f in found if not any(f" {n!r}" in f or f".{n} " in f for _, n in EXEMPT)]


def test_tests_choose_variants_by_config_not_by_module_attributes():
    found = [s for p in sorted((ROOT / "tests").glob("*.py")) for s in _switch_sets(p)]
    assert not found, "tests that set module switches (use InferenceConfig + use_inference):\n" + "\n".join(found)


@pytest.mark.parametrize("src,bad", [
    ("ENABLE = None\n", True), ("FLAG: Optional[int] = 3\n", True), ("MODE = 'fast'\n", True),
    ("_ON = True\n", True), ("MAX_ROWS = 16\n", False), ("CONFIG_KEY = 'x'\n", False), ("KINDS = ('a',)\n", False),
    ("def f():\n    global X\n    X = 1\n", True), ("name = None\n", False)])
def test_the_rule_catches_switches(tmp_path, src, bad):
    """The scanner itself on hand-written modules: switch shapes found, constants left alone."""
    p = tmp_path / "probe.py"
    p.write_text(src)
    assert bool(_switches(p)) == bad
