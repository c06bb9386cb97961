"""The notebooks' slow tests run each notebook top to bottom on the real default model at small settings
(tests/test_notebook.py: notebooks/head_anatomy.ipynb; tests/test_quickstart_notebook.py: notebooks/quickstart.ipynb).
The ``notebook_runs`` fixture (tests/conftest.py) starts every notebook whose test is selected at once, when the first
of those tests asks for it, each kernel on its share of torch's intra-op threads (one each of two cores when both
run): most of a run is single-threaded (the kernel's start, its imports, the figures through kaleido), so the two
together take about as long as the longer one alone. Each test then waits for its own notebook and asserts on what
it wrote."""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


@dataclass(frozen=True)
class NotebookRun:
    notebook: str  # in notebooks/
    test: str  # the test that asserts on its outputs
    out_var: str  # the environment variable naming its output folder
    settings: dict[str, str] = field(default_factory=dict)  # more environment: the notebook's small settings


RUNS = {
    # 3 pairs of 58-59 tokens: the needle and the question without filler (a+ - a- 4.6-5.5 logits)
    "head_anatomy": NotebookRun("head_anatomy.ipynb", "test_notebook_runs_and_exports_png", "HEADSCOPE_NB_OUT",
                                {"HEADSCOPE_NB_BOOT": "50", "HEADSCOPE_NB_SEQ_LEN": "64"}),
    "quickstart": NotebookRun("quickstart.ipynb", "test_quickstart_runs", "HEADSCOPE_QS_OUT",
                              {"HEADSCOPE_QS_PAIRS": "2", "HEADSCOPE_QS_SEQ_LEN": "64", "HEADSCOPE_QS_EVAL": "4",
                               "HEADSCOPE_QS_K": "3"}),
}


def execute(run: NotebookRun, folder: Path, env: dict[str, str]) -> Path:
    """Execute ``run``'s notebook in a fresh kernel working in ``folder`` with the environment ``env`` -> its output
    folder (``env[run.out_var]``). Raises nbclient's CellExecutionError naming the cell that failed."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(NOTEBOOKS / run.notebook, as_version=4)
    client = NotebookClient(nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(folder)}})
    client.execute(env=env)
    return Path(env[run.out_var])


def start(names: list[str], folder: Path, cores: int) -> tuple[ThreadPoolExecutor, dict[str, Future]]:
    """Start the notebooks ``names`` (keys of :data:`RUNS`) at once, each in ``folder / name`` on ``cores`` intra-op
    threads shared out between them -> (the pool, {name: a future of its output folder})."""
    pool = ThreadPoolExecutor(max(1, len(names)), thread_name_prefix="notebook")
    threads = max(1, cores // max(1, len(names)))
    runs = {}
    for name in names:
        run, work = RUNS[name], folder / name
        work.mkdir(parents=True)
        env = {**os.environ, **run.settings, run.out_var: str(work / "out"), "OMP_NUM_THREADS": str(threads)}
        runs[name] = pool.submit(execute, run, work, env)
    return pool, runs
