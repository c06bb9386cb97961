"""The help of every command as a user reads it piped (``headscope convert --help | cat``): option names and defaults
whole, never cut with an ellipsis at rich's 80 columns; no developer markup (Sphinx roles) in the text."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import typer.main
import typer.rich_utils
from typer.testing import CliRunner

from headscope.cli import HELP_WIDTH, app, help_width

ROOT = Path(__file__).resolve().parent.parent
COMMANDS = sorted(typer.main.get_command(app).commands)


def _help(argv: list[str], monkeypatch) -> str:
    monkeypatch.setattr(typer.rich_utils, "MAX_WIDTH", help_width(False, {}))  # what a piped run gets
    res = CliRunner().invoke(app, [*argv, "--help"])
    assert res.exit_code == 0, res.output
    return res.output


def _option_names(command: str) -> list[str]:
    cmd = typer.main.get_command(app).commands[command]
    return [o for p in cmd.params for o in (*p.opts, *p.secondary_opts) if o.startswith("--")]


def _whole(name: str, text: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", text) is not None


def test_help_width_off_a_terminal_only():
    assert help_width(False, {}) == HELP_WIDTH == 120
    assert help_width(True, {}) is None  # a terminal: its own width
    assert help_width(False, {"COLUMNS": "60"}) is None and help_width(False, {"TERMINAL_WIDTH": "90"}) is None


def test_convert_help_names_every_option_whole(monkeypatch):
    text = _help(["convert"], monkeypatch)
    names = _option_names("convert")
    assert {"--activation-checkpointing", "--deterministic", "--teacher-dtype"} <= set(names)
    assert [n for n in names if not _whole(n, text)] == []
    assert "…" not in text and "CUBLAS_WORKSPACE_CONFIG" in text


@pytest.mark.parametrize("command", COMMANDS)
def test_no_help_is_cut(command, monkeypatch):
    text = _help([command], monkeypatch)
    assert "…" not in text, text
    assert [n for n in _option_names(command) if not _whole(n, text)] == []


def test_eval_help_shows_the_tasks_default_whole(monkeypatch):
    text = re.sub(r"\s+", "", _help(["eval"], monkeypatch).replace("│", ""))
    assert "[default:niah_single,niah_multikey,niah_multivalue,variable_tracking]" in text


def test_piped_help_of_the_real_process_is_not_cut():
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "TERMINAL_WIDTH", "LINES")}
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run([sys.executable, "-m", "headscope.cli", "convert", "--help"], capture_output=True, text=True,
                         env=env, cwd=ROOT, timeout=60, check=True).stdout
    assert "…" not in out and max(len(ln) for ln in out.splitlines()) == HELP_WIDTH
    assert [n for n in _option_names("convert") if not _whole(n, out)] == []


ROLES = re.compile(r":(class|func|mod|attr|meth|data|exc|obj):`?")  # rendered markdown drops the backticks


@pytest.mark.parametrize("command", [[]] + [[c] for c in COMMANDS], ids=["headscope"] + COMMANDS)
def test_help_has_no_developer_markup(command, monkeypatch):
    text = _help(command, monkeypatch)
    assert not ROLES.search(text), ROLES.findall(text)


def test_anatomy_help_lists_every_figure_format(monkeypatch):
    from headscope.analysis.anatomy import FIGURE_FORMATS

    text = re.sub(r"[\s│]+", " ", _help(["anatomy"], monkeypatch))
    assert f"figure formats (repeatable): {', '.join(FIGURE_FORMATS)} " in text and FIGURE_FORMATS[-1] == "pdf"


def test_setup_descriptions_match_setup_sh():
    """setup.sh installs torch as pip resolves it (no CPU index): its header and the README's layout line must not
    promise the CPU build."""
    setup = (ROOT / "setup.sh").read_text()
    code = [ln for ln in setup.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    torch_line = next(ln for ln in code if "pip install" in ln and "torch==" in ln)
    assert "download.pytorch.org/whl/cpu" not in torch_line
    header = "\n".join(ln for ln in setup.splitlines()[1:8] if ln.startswith("#"))
    layout = next(ln for ln in (ROOT / "README.md").read_text().splitlines() if ln.strip().startswith("setup.sh "))
    for text in (header, layout):
        assert "CPU build of PyTorch" not in text and "PyTorch" in text, text


def test_commands_listed_in_the_workflow_order_in_three_panels(monkeypatch):
    """`headscope --help` lists rank, anatomy, mask | plan-memory, convert | eval, generate under their panels."""
    text = _help([], monkeypatch)
    want = ["Find the heads", "rank", "anatomy", "mask", "Convert the model", "plan-memory", "convert",
            "Evaluate and generate", "eval", "generate"]
    where = [re.search(rf"[│╭─] {re.escape(w)} ", text) for w in want]
    assert all(where), [w for w, m in zip(want, where) if m is None]
    assert [m.start() for m in where] == sorted(m.start() for m in where)
    assert set(COMMANDS) == {"rank", "anatomy", "mask", "plan-memory", "convert", "eval", "generate"}
