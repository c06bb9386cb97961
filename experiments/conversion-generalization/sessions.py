"""State between the lent GPU sessions of issue 62's parts (gpu_parts.sh), and its merge into the study's records.

A part runs in a work folder W (conversions with their weights, ``headscope eval``'s folder with its prompt sets) that
does not survive the session; what must survive comes back in a small folder B (``gpu_parts.sh``'s OUT/bring: files
under 16 MiB, no weights, no prompt sets) and is carried into the next session. Per teacher (``smollm2``, ``gemma3``)
B/KEY mirrors the driver's run folder (run.py --out): ``eval/`` (cells, haystack, tables; no ``prompts/``, no HTML
pages), ``seedS/LABEL_tT/recipe.json`` and ``stageK/training.json`` (every re-conversion of a run kept:
``training.json`` the latest, ``training.N.json`` the earlier ones), ``masks/`` and ``rank/`` (rankings, no ``.pt``);
B/docs/KEY_sS.tar.gz holds seed S's sampled documents (run.py's conversions then train on the same documents in every
session).

    python sessions.py restore B/smollm2 W/smollm2          # eval cells, haystack, masks, rankings back into W
    python sessions.py collect W/smollm2 B/smollm2          # and out again, after every step
    python sessions.py missing W/smollm2/eval NAME SEED TOKENS TASKS LENGTH   # tasks of a cell row still to score
    python sessions.py kv-layers RANKING_DIR 7              # the layer-wise arm's layers at LA:FA = 7:1
    python sessions.py merge B/smollm2 --tag smollm2-62     # rows, cells, stage records into records/ (source cli:TAG)

A student converted again in a later session has other weights files (the eval's fingerprint differs), so its eval
asks only for the cells that are missing (``missing``); the teacher's cells are skipped by ``headscope eval`` itself.
"""

from __future__ import annotations

import argparse
import filecmp
import gzip
import json
import shutil
import sys
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
RECORDS = HERE / "records"
#: what never comes back: the prompt sets (up to ~8 MB a 64K cell, rebuilt from the haystack), HTML pages (the eval's
#: report.html and a ranking's heatmap.html embed plotly.js, ~5 MB each; rebuilt from the CSVs), weights, checkpoints,
#: token tensors
SKIP_DIRS = {"prompts", "checkpoint"}
SKIP_SUFFIXES = (".html", ".safetensors", ".pt", ".bin")
#: retention.csv / cell keys: a row of the same key from a later merge replaces the earlier one
ROW_KEY = ["source", "model", "seed", "tokens", "task", "formats", "length"]


def _kept(rel: Path) -> bool:
    """Whether a file comes back: not in SKIP_DIRS, not of SKIP_SUFFIXES, and not a write in flight (``.NAME.PID.tmp``,
    :func:`headscope.runtime.atomic_write_bytes`' and :func:`_copy`'s: a collector running beside ``headscope eval``
    would carry it, and it would stay in B after the rename)."""
    in_flight = rel.name.startswith(".") and rel.name.endswith(".tmp")
    return not (set(rel.parts[:-1]) & SKIP_DIRS or rel.name.endswith(SKIP_SUFFIXES) or in_flight)


def _copy_tree(src: Path, dst: Path, clobber: bool) -> int:
    """Files of ``src`` (but those :func:`_kept` refuses) into ``dst``; ``clobber``: replace files that differ."""
    n = 0
    for f in sorted(p for p in src.rglob("*") if p.is_file()):
        rel = f.relative_to(src)
        if not _kept(rel):
            continue
        t = dst / rel
        if t.exists() and (not clobber or filecmp.cmp(f, t, shallow=False)):
            continue
        _copy(f, t)
        n += 1
    return n


def _copy(src: Path, dst: Path) -> None:
    """``src`` to ``dst`` through a temporary file and a rename: a part collecting beside another never leaves half a
    file in B."""
    import os

    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
    shutil.copyfile(src, tmp)
    os.replace(tmp, dst)


def _records(run: Path) -> list[Path]:
    """A run folder's conversion records: ``seedS/LABEL_tT/recipe.json`` and ``stageK/training*.json``."""
    return sorted(run.glob("seed*/*/recipe.json")) + sorted(run.glob("seed*/*/stage[123]/training*.json"))


def restore(state: Path, work: Path, records_to: Optional[Path] = None) -> int:
    """STATE/KEY's eval folder, masks and rankings into the work folder W/KEY, never replacing a file W already has (a
    second part of the same session keeps what the first wrote). The conversions' records go to ``records_to`` (B/KEY,
    no file replaced) and not into W: a ``recipe.json`` without its weights would make ``headscope convert`` resume a
    folder that is not there; in B they let :func:`collect` keep an earlier session's ``training.json`` beside a new
    one. Returns the number of files copied."""
    n = sum(_copy_tree(state / d, work / d, clobber=False) for d in ("eval", "masks", "rank") if (state / d).is_dir())
    for f in _records(state) if records_to is not None else []:
        t = records_to / f.relative_to(state)
        if not t.exists():
            _copy(f, t)
            n += 1
    return n


def collect(work: Path, bring: Path, eval_only: bool = False) -> int:
    """W/KEY's results into B/KEY (:func:`restore`'s layout): the eval folder (newer files replace older ones), the
    masks and rankings, and each conversion's ``recipe.json`` and ``stageK/training.json``; a ``training.json`` that
    differs from the one B holds (the run converted again in this session) becomes ``training.json`` and the one B
    held ``training.N.json`` (N = 1, 2, ...: the earlier conversions, for the run-to-run comparison). ``eval_only``: the
    eval folder alone (what a teacher's evaluation beside a conversion collects; the conversion's records are the
    converting process's). Returns the number of files written."""
    n = sum(_copy_tree(work / d, bring / d, clobber=True) for d in ("eval", "masks", "rank")
            if (work / d).is_dir() and (d == "eval" or not eval_only))
    for f in [] if eval_only else _records(work):
        t = bring / f.relative_to(work)
        if t.exists() and filecmp.cmp(f, t, shallow=False):
            continue
        if t.exists() and t.name == "training.json":
            k = 1
            while (t.parent / f"training.{k}.json").exists():
                k += 1
            t.rename(t.parent / f"training.{k}.json")
        _copy(f, t)
        n += 1
    return n


def missing(eval_dir: Path, name: str, seed: int, tokens: int, tasks: Sequence[str], length: int,
            formats: str = "unseen") -> list[str]:
    """The tasks of ``tasks`` whose (task, formats, length) cell of the model ``name`` (seed, tokens) has no file in
    ``eval_dir``/cells (gzip or plain JSON, any settings), in the order given. The folder is
    :func:`headscope.evaluation.retention.cell_dir`'s NAME__sSEED__tTOKENS, named here without importing the package
    (the recipe asks this for every length of every student: no torch import each time)."""
    d = eval_dir / "cells" / f"{name}__s{int(seed)}__t{int(tokens)}"
    return [t for t in tasks if not any((d / f"{t}.{formats}.{int(length)}.json{z}").exists() for z in ("", ".gz"))]


def kv_layers(ranking: Path, ratio: float) -> int:
    """Whole FA layers of the layer-wise arm at LA:FA = ``ratio``:1: round(layers / (ratio + 1)), at least 1 (SmolLM2's
    30 layers: 8, 4, 2, 1 at 3:1, 7:1, 15:1, 31:1; the study's ``layer-3to1`` / ``layer-7to1`` kept 8 and 4)."""
    n = int(json.loads((ranking / "ranking.json").read_text())["geometry"]["n_layers"])  # Ranking.save's file
    return max(1, int(round(n / (float(ratio) + 1))))


def _tables() -> Any:
    """tables.py beside this file, loaded by path (the name ``tables`` is PyTables' too; run.py does the same)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("conversion_study_tables", HERE / "tables.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _jsonl_gz(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def _write_jsonl_gz(path: Path, records: Iterable[dict[str, Any]]) -> None:
    lines = "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records)
    with open(path, "wb") as fh, gzip.GzipFile(filename="", mode="wb", fileobj=fh, mtime=0) as g:
        g.write(lines.encode())


def source_of(tag: Optional[str]) -> str:
    """retention.csv's ``source`` of rows merged from an eval folder: ``cli`` (run.py keep), ``cli:TAG`` with a tag
    (one eval folder = one haystack and one teacher: rows of different tags are not compared prompt for prompt)."""
    return "cli" if not tag else f"cli:{tag}"


def merge(run_out: Path, records: Path = RECORDS, tag: Optional[str] = None) -> str:
    """A run folder's results (run.py's OUT or B/KEY: ``eval/`` and ``seedS/LABEL_tT/stageK/training.json``) merged
    into the records, as run.py keep does but without dropping what the records already hold: the eval's
    retention.csv rows into ``cli_retention.csv``, its per-prompt cells into ``cli_cells.jsonl.gz`` (each with
    ``source``), the stage records into ``cli_training.jsonl.gz`` (each with ``run`` and ``source``). Rows and cells are
    keyed by :data:`ROW_KEY` (source included: another eval folder's teacher is another row), stage records by
    (source, run, stage, seconds); the merged record replaces an older one of the same key. Returns a summary line.

    Raises:
        SystemExit: no ``eval/retention.csv`` in ``run_out``.
    """
    import pandas as pd

    from headscope.evaluation.retention import EVAL_COLUMNS

    src = source_of(tag)
    ev = run_out / "eval"
    if not (ev / "retention.csv").exists():
        raise SystemExit(f"{ev}/retention.csv is not there: bring the part's folder back first (or run its eval)")
    new = pd.read_csv(ev / "retention.csv").assign(source=src)
    f = records / "cli_retention.csv"
    old = pd.read_csv(f) if f.exists() else pd.DataFrame(columns=list(EVAL_COLUMNS))
    rows = pd.concat([old, new], ignore_index=True).drop_duplicates(ROW_KEY, keep="last")
    rows[list(EVAL_COLUMNS)].to_csv(f, index=False)

    def key(c: dict) -> tuple:
        return tuple(c.get(k, "cli") if k == "source" else c[k] for k in ROW_KEY)

    cells = {key(c): c for c in _jsonl_gz(records / "cli_cells.jsonl.gz")}
    added = [{**json.loads(gzip.decompress(p.read_bytes()) if p.suffix == ".gz" else p.read_text()), "source": src}
             for p in sorted((ev / "cells").glob("*__s*__t*/*.json*"))]
    cells.update({key(c): c for c in added})
    _write_jsonl_gz(records / "cli_cells.jsonl.gz", sorted(cells.values(), key=lambda c: tuple(map(str, key(c)))))
    stages = {}
    for r in _jsonl_gz(records / "cli_training.jsonl.gz"):
        stages[(r.get("source", "cli"), r["run"], r.get("stage"), r.get("seconds"))] = r
    found = sorted(run_out.glob("seed*/*/stage[123]/training*.json"))
    for p in found:
        r = {"run": f"{p.parents[2].name}/{p.parents[1].name}", **json.loads(p.read_text()), "source": src}
        stages[(src, r["run"], r.get("stage"), r.get("seconds"))] = r
    if stages:
        _write_jsonl_gz(records / "cli_training.jsonl.gz", list(stages.values()))
    return (f"merged {len(new)} rows, {len(added)} cells and {len(found)} stage records of {run_out} as source {src!r} "
            f"into {records} ({len(rows)} rows, {len(cells)} cells in all)")


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("restore", "collect"):
        s = sub.add_parser(name)
        s.add_argument("src", type=Path)
        s.add_argument("dst", type=Path)
        if name == "restore":
            s.add_argument("--records-to", type=Path, default=None, help="B/KEY: where the stage records go")
        else:
            s.add_argument("--eval-only", action="store_true", help="the eval folder alone")
    s = sub.add_parser("missing")
    s.add_argument("eval_dir", type=Path)
    s.add_argument("name")
    s.add_argument("seed", type=int)
    s.add_argument("tokens")
    s.add_argument("tasks", help="comma-separated")
    s.add_argument("length", help="tokens, or with a K suffix")
    s = sub.add_parser("kv-layers")
    s.add_argument("ranking", type=Path)
    s.add_argument("ratio", type=float)
    s = sub.add_parser("merge")
    s.add_argument("run_out", type=Path)
    s.add_argument("--records", type=Path, default=RECORDS)
    s.add_argument("--tag", default=None, help="source = cli:TAG (the eval folder's name in retention.csv)")
    a = p.parse_args(argv)
    if a.cmd == "restore":
        print(f"restored {restore(a.src, a.dst, a.records_to)} file(s) from {a.src} into {a.dst}", flush=True)
    elif a.cmd == "collect":
        print(f"collected {collect(a.src, a.dst, a.eval_only)} file(s) from {a.src} into {a.dst}", flush=True)
    elif a.cmd == "missing":
        L = int(a.length[:-1]) * 1024 if a.length[-1:] in "kK" else int(a.length)  # headscope eval's --lengths
        print(",".join(missing(a.eval_dir, a.name, a.seed, _tables().parse_tokens(a.tokens), a.tasks.split(","), L)))
    elif a.cmd == "kv-layers":
        print(kv_layers(a.ranking, a.ratio))
    else:
        print(merge(a.run_out, a.records, a.tag), flush=True)


if __name__ == "__main__":
    main()
