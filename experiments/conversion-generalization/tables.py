"""The conversion study's tables from its results (issue 40; the study's README, "Results").

The results are the committed records (``records/``: every scored cell with its per-prompt outcomes, the anatomy,
the masks, the arms' records) plus any cells a later run stored in the run folder OUT (a file already in OUT wins).
:func:`report` restores the records into OUT and writes every table there: ``retention.csv`` (the columns of
``headscope eval``'s, ``source`` = study), ``retention_summary.csv``, ``retention_seeds.csv``, ``retention_depth.csv``,
``retention_distance.csv`` (the package's :mod:`headscope.evaluation.retention`), ``mask_coverage.csv``, ``levers.csv``
/ ``levers.md`` / ``levers_paired.csv`` (McNemar's exact p: :func:`headscope.evaluation.accuracy.paired_exact_test`),
``token_curve.csv`` / ``.html``, ``anatomy.csv`` / ``anatomy_knockout.csv`` and ``comparison.md``. From the committed
records alone they are the committed tables, byte for byte (tests/test_study_tables.py):

    python experiments/conversion-generalization/tables.py --out runs/gen [--write-to experiments/conversion-generalization]

Names: a trained arm's model label is ARM[+lever=value...] (e.g. ``hydra-7to1+s2_retrieval=0.25``), its cells
``cells/LABEL__sSEED__tTOKENS/`` (SEED: the training seed; the teacher: ``teacher__s0__t0``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
# headscope's modules are imported where used: the driver (run.py) loads this file to name things, without torch


#: the study's arms in table order: the main comparison's masks, the budget lever's (5:1) and the selection lever's
ARMS = ("hydra-7to1", "layer-3to1", "layer-7to1", "random-7to1", "teacher")
BUDGET_ARMS = ("hydra-5to1", "layer-5to1", "random-5to1")
SELECTION_ARMS = ("ie-7to1",)
ARM_BUDGETS = {"hydra-7to1": "7:1", "layer-7to1": "7:1", "random-7to1": "7:1", "layer-3to1": "3:1",
               "hydra-5to1": "5:1", "layer-5to1": "5:1", "random-5to1": "5:1", "ie-7to1": "7:1"}
#: the token budget a lever row at other tokens is measured against (the study's first budget)
BASE_TOKENS = "50M"
#: the lever and comparison tables show the suite's lengths up to this many tokens (1K, 2K, 4K in the study)
TABLE_MAX_LEN = 4096


def parse_tokens(s: str) -> int:
    """'50M' / '200M' / '1.5e6' / '12000' -> tokens."""
    s = str(s).strip()
    mult = {"K": 10**3, "M": 10**6, "G": 10**9}.get(s[-1:].upper())
    return int(round(float(s[:-1]) * mult)) if mult else int(float(s))




def parse_label(label: str) -> tuple[str, dict[str, str]]:
    """(arm, {lever: value as written}) of a model name made by :func:`arm_label`."""
    arm, *parts = label.split("+")
    return arm, dict(p.split("=", 1) for p in parts)




def mask_coverage(out: Path) -> list[dict[str, Any]]:
    """OUT/mask_coverage.csv: how much of the teacher's causal effect each arm's FA heads hold, per teacher ranking
    of the anatomy (OUT/anatomy/KEY/teacher/ranking: receiver IE on that key's pairs, e.g. unseen single-needle
    prompts at 4K): the share of the positive scores on the arm's FA heads and how many of the ranking's top 10 /
    top-N (N = the arm's FA heads) they hold. Arms: the stored OUT/masks/*.json. Returns the rows."""
    import pandas as pd

    from headscope.masks import HeadMask
    from headscope.scores import Ranking

    arms = {f.stem: HeadMask.from_json(f) for f in sorted((out / "masks").glob("*.json"))}
    rows = []
    for rdir in sorted((out / "anatomy").glob("*/teacher/ranking")):
        m = Ranking.load(rdir).matrix("score")
        flat = sorted(((float(m[l, h]), (l, h)) for l in range(m.shape[0]) for h in range(m.shape[1])), reverse=True)
        order = [k for _, k in flat]
        pos = sum(max(v, 0.0) for v, _ in flat)
        for arm, mk in arms.items():
            fa = {(l, h) for l, hs in enumerate(mk.fa_heads) for h in hs}
            n = len(fa)
            rows.append({"ranking": rdir.parent.parent.name, "arm": arm, "fa_heads": n,
                         "positive_share": sum(max(float(m[k]), 0.0) for k in fa) / pos if pos > 0 else float("nan"),
                         "top10_held": sum(k in fa for k in order[:10]), "topN_held": sum(k in fa for k in order[:n])})
    pd.DataFrame(rows, columns=["ranking", "arm", "fa_heads", "positive_share", "top10_held", "topN_held"]).to_csv(
        out / "mask_coverage.csv", index=False)
    return rows


#: the study's committed results (every scored cell, the anatomy, the masks, the arms' records and loss curves)
RECORDS = Path(__file__).resolve().parent / "records"
#: retention.csv's ``source`` of the rows of the study's cells (its pieces scored them; the rows ``headscope eval``
#: makes are ``cli``), with ``agreement``: the columns of ``headscope eval``'s retention.csv
STUDY_SOURCE = "study"


def read_jsonl_gz(f: Path) -> list[dict[str, Any]]:
    """The JSON lines of a gzipped file (the records' ``cells.jsonl.gz``, ``arms.jsonl.gz``)."""
    import gzip

    with gzip.open(f, "rt", encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def restore_records(out: Path, records: Path = RECORDS) -> int:
    """The committed records into the run folder ``out`` as the study's former pieces wrote them: each cell of ``cells.jsonl.gz`` as
    OUT/cells/MODEL__sS__tT/TASK.FORMATS.LENGTH.json, each file of ``arms.jsonl.gz`` at its path, ``settings.json``,
    ``manifest.json.gz`` (as manifest.json), ``masks/`` and ``anatomy/``. A file already in OUT is kept (a session's
    newer results win). Returns the number of files written."""
    import gzip

    from headscope.evaluation.retention import cell_dir
    from headscope.runtime import atomic_write_text

    written = 0

    def put(rel: str, text: str) -> None:
        nonlocal written
        f = out / rel
        if not f.exists():
            f.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(f, text)
            written += 1

    for c in read_jsonl_gz(records / "cells.jsonl.gz"):
        d = cell_dir(out / "cells", c["model"], c["seed"], c["tokens"])
        put(f"cells/{d.name}/{c['task']}.{c['formats']}.{c['length']}.json", json.dumps(c))
    for r in read_jsonl_gz(records / "arms.jsonl.gz"):
        put(r["path"], json.dumps(r["json"], indent=2))
    put("manifest.json", gzip.decompress((records / "manifest.json.gz").read_bytes()).decode())
    for f in sorted(records.rglob("*")):
        rel = f.relative_to(records).as_posix()
        if f.is_file() and (rel == "settings.json" or rel.startswith(("masks/", "anatomy/"))):
            put(rel, f.read_text())
    return written




#: the main comparison's arms, in table order (issue 40, item 5), and the goal's thresholds
COMPARISON_ARMS = ("teacher", "hydra-7to1", "layer-3to1", "layer-7to1", "random-7to1")
GOAL_RETENTION, GOAL_SEEDS = 0.9, 2


def comparison_table(out: Path, lengths: Sequence[int] = (1024, 2048, 4096)) -> int:
    """OUT/comparison.md: the main comparison on the unseen formats — one row per arm of :data:`COMPARISON_ARMS` and
    training tokens (no levers), one column per task and length of ``lengths``, each cell the accuracy's mean over
    seeds (min–max when several), from OUT/retention_seeds.csv; then the goal per tokens of ``hydra-7to1``: its
    retention on unseen single-needle cells (mean and the lowest seed) against :data:`GOAL_RETENTION` with at least
    :data:`GOAL_SEEDS` seeds — "met" when every seed reaches it, "met on the mean of seeds, not on every seed" when
    only the means over seeds do —, and the unseen cells where its mean accuracy is below ``layer-3to1``'s
    at the same tokens (every unseen length stored, not only ``lengths``). Returns the number of arm rows (0 without
    retention_seeds.csv)."""
    import pandas as pd

    from headscope.tasks.formats import FORMAT_TASKS

    f = out / "retention_seeds.csv"
    if not f.exists():
        return 0
    every = pd.read_csv(f)
    every = every[(every.formats == "unseen") & every.model.isin(COMPARISON_ARMS)]  # every length: the layer-wise check
    df = every[every.length.isin(list(lengths))]
    tasks = [t for t in FORMAT_TASKS if t in set(df.task)]
    cols = [(t, L) for t in tasks for L in lengths]
    short = {"niah_single": "single", "niah_multikey": "multi-key", "niah_multivalue": "multi-value",
             "variable_tracking": "variables"}
    lines = ["Unseen formats, accuracy (mean over seeds; min–max when several), n = 100 prompts per cell and seed.", "",
             "| arm | tokens | seeds | " + " | ".join(f"{short[t]} {L // 1024}K" for t, L in cols) + " |",
             "|---|---|---|" + "---|" * len(cols)]
    rows = 0
    for arm in COMPARISON_ARMS:
        for tokens in sorted(set(df[df.model == arm].tokens)):
            g = df[(df.model == arm) & (df.tokens == tokens)].set_index(["task", "length"])
            cells = []
            for t, L in cols:
                if (t, L) not in g.index:
                    cells.append("–")
                    continue
                r = g.loc[(t, L)]
                txt = f"{r.accuracy_mean:.2f}"
                if r.n_seeds > 1:
                    txt += f" ({r.accuracy_min:.2f}–{r.accuracy_max:.2f})"
                cells.append(txt)
            lo, hi = int(g.n_seeds.min()), int(g.n_seeds.max())
            seeds = f"{hi}" if lo == hi else f"{lo}–{hi}"  # cells of one row may have different numbers of seeds
            lines.append(f"| {arm} | {tokens_text(int(tokens)) if tokens else '–'} | {seeds} | " + " | ".join(cells) + " |")
            rows += 1
    lines += ["", f"Goal (issue 40): `hydra-7to1` keeps >= {GOAL_RETENTION} x the teacher's accuracy on unseen single-needle "
              f"cells at {', '.join(f'{L // 1024}K' for L in lengths)} with >= {GOAL_SEEDS} seeds, and is >= `layer-3to1` "
              "on every unseen cell.", ""]
    for tokens in sorted(set(df[df.model == "hydra-7to1"].tokens)):
        hall = every[(every.model == "hydra-7to1") & (every.tokens == tokens)].set_index(["task", "length"])
        single = [hall.loc[("niah_single", L)] for L in lengths if ("niah_single", L) in hall.index]
        if len(single) < len(lengths):
            verdict = f"not yet measured at every length ({len(single)} of {len(lengths)})"
        else:
            worst = min(r.retention_min for r in single)
            seeds = min(int(r.n_seeds) for r in single)
            on_mean = min(r.retention_mean for r in single) >= GOAL_RETENTION and seeds >= GOAL_SEEDS
            status = ("met" if on_mean and worst >= GOAL_RETENTION
                      else "met on the mean of seeds, not on every seed" if on_mean else "not met")
            verdict = (f"retention {', '.join(f'{r.retention_mean:.2f}' for r in single)} (lowest seed {worst:.2f}), "
                       f"{seeds} seed(s): {status}")
        lay = every[(every.model == "layer-3to1") & (every.tokens == tokens)].set_index(["task", "length"])
        if len(lay):
            below = [f"{short[t]} {L // 1024}K" for t, L in sorted(set(hall.index) & set(lay.index), key=lambda c: (c[1], c[0]))
                     if hall.loc[(t, L)].accuracy_mean < lay.loc[(t, L)].accuracy_mean]
            vs = "below `layer-3to1` on " + ", ".join(below) if below else "not below `layer-3to1` on any shared cell"
        else:
            vs = "`layer-3to1` not measured at these tokens"
        lines.append(f"- {tokens_text(int(tokens))} tokens: single-needle {verdict}; {vs}.")
    lines += depth_lines(out, lengths) + distance_lines(out, lengths) + curve_lines(out) + coverage_lines(out) + anatomy_lines(out)
    (out / "comparison.md").write_text("\n".join(lines) + "\n")
    return rows


#: anatomy.csv's knockout columns: (model, method, condition) of the anatomy piece's knockout.csv
ANATOMY_KNOCKOUTS = {"acc_student": ("student", "zero", "none"), "acc_student_fa_zero": ("student", "zero", "fa"),
                     "acc_student_fa_mean": ("student", "mean", "fa"),
                     "acc_student_top_mean": ("student", "mean", "student_top"),
                     "acc_student_gdn_mean": ("student", "mean", "gdn"),
                     "acc_teacher": ("teacher", "zero", "none"), "acc_teacher_fa_mean": ("teacher", "mean", "fa"),
                     "acc_teacher_gdn_mean": ("teacher", "mean", "gdn")}


def anatomy_table(out: Path) -> int:
    """OUT/anatomy.csv and OUT/anatomy_knockout.csv from the anatomy piece's results
    (OUT/anatomy/KEY/seedS_ARM_tTOKENS/{anatomy.json, knockout.csv}; issue 40, item 4), one row per student and key:
    where its receiver IE sits (``fa_positive_share``: its FA heads' share of its positive IE; ``fa_in_top10``: FA
    heads among its 10 best), how its ranking agrees with the teacher's on the same pairs (``top10_overlap``,
    ``spearman``; ``teacher_top10_fa``: the teacher's 10 best heads the student kept as FA), its top 3 heads, and
    the knockout accuracies of :data:`ANATOMY_KNOCKOUTS` plus ``acc_student_gdn_random_mean`` / ``_min`` / ``_max``
    (over the random GDN draws, mean ablation) and ``student_single_heads_out`` ('L18H6=0.12 L16H1=0.40': one head
    at a time, mean ablation). The knockout CSVs are concatenated as they are, with the key, arm, seed and
    tokens. Returns the number of student rows (both files are written only when there is one)."""
    import pandas as pd

    rows, kos = [], []
    for f in sorted((out / "anatomy").glob("*/seed*_*_t*/anatomy.json")):
        res = json.loads(f.read_text())
        if "student" not in res or "error" in res["student"]:
            continue
        kinds = res["student"]["kinds"]
        cmp10 = res.get("comparison", {}).get("top10", {})
        row = {"key": f.parent.parent.name, "model": res["arm"], "seed": res["seed"], "tokens": res["tokens"],
               "done": bool(res.get("done")), "fa_heads": kinds["fa"]["n_heads"],
               "fa_positive_share": kinds["fa"]["positive_mass_share"], "fa_in_top10": kinds["fa"].get("top10"),
               "top10_overlap": cmp10.get("overlap"), "spearman": cmp10.get("spearman"),
               "teacher_top10_fa": cmp10.get("teacher_top_kept_fa"),
               "student_top3": " ".join(res["student"]["top10"][:3]), "knockout_n": None}
        ko = res.get("knockout", {})
        for col, (model, method, cond) in ANATOMY_KNOCKOUTS.items():
            v = ko.get(f"{model}/{method}/{cond}")
            row[col] = v["accuracy"] if v else None
            if v:
                row["knockout_n"] = v["n"]
        draws = [v["accuracy"] for k, v in ko.items() if k.startswith("student/mean/gdn_random")]
        row["acc_student_gdn_random_mean"] = sum(draws) / len(draws) if draws else None
        row["student_single_heads_out"] = " ".join(f"{k.rsplit('_', 1)[1]}={v['accuracy']:.2f}" for k, v in ko.items()
                                                   if k.startswith("student/mean/single_")) or None
        row["acc_student_gdn_random_min"] = min(draws) if draws else None
        row["acc_student_gdn_random_max"] = max(draws) if draws else None
        rows.append(row)
        kf = f.parent / "knockout.csv"
        if kf.exists():
            kos.append(pd.read_csv(kf).assign(key=row["key"], arm=res["arm"], seed=res["seed"], tokens=res["tokens"]))
    if rows:
        pd.DataFrame(rows).to_csv(out / "anatomy.csv", index=False)
        if kos:
            k = pd.concat(kos, ignore_index=True)
            k[["key", "arm", "seed", "tokens"] + [c for c in k.columns if c not in ("key", "arm", "seed", "tokens")]].to_csv(
                out / "anatomy_knockout.csv", index=False)
    return len(rows)


def anatomy_lines(out: Path) -> list[str]:
    """comparison.md's section on the anatomy after conversion, from OUT/anatomy.csv (:func:`anatomy_table`)."""
    import pandas as pd

    f = out / "anatomy.csv"
    if not f.exists():
        return []
    d = pd.read_csv(f)

    def v(x: Any, fmt: str = ".2f") -> str:
        return "–" if pd.isna(x) else format(x, fmt)

    def spread(r: Any) -> str:  # the random draws' range beside their mean
        lo, hi = r.acc_student_gdn_random_min, r.acc_student_gdn_random_max
        return "" if pd.isna(lo) or lo == hi else f" ({lo:.2f}–{hi:.2f})"

    lines = []
    for key, g in d.groupby("key", sort=True):
        n = g.knockout_n.dropna()
        lines += ["", f"Anatomy after conversion on `{key}` (the student's heads ranked by receiver IE on the teacher's "
                  f"pairs, exact fp32; accuracy on {int(n.iloc[0]) if len(n) else '–'} prompts of the suite's cell, "
                  "heads knocked out by mean ablation unless named):", "",
                  "| student | seed | tokens | FA share of IE | FA in top 10 | top-10 overlap with the teacher | ρ | "
                  "top 3 | accuracy | FA out (mean / zero) | random GDN out (draws) | own top out | all GDN out | "
                  "teacher | teacher, same heads out | teacher, GDN heads out |", "|---" * 16 + "|"]
        for r in g.sort_values(["model", "seed", "tokens"]).itertuples():
            lines.append(f"| {r.model} | {r.seed} | {tokens_text(int(r.tokens))} | {v(r.fa_positive_share)} | "
                         f"{v(r.fa_in_top10, '.0f')} | {v(r.top10_overlap)} | {v(r.spearman)} | {r.student_top3} | "
                         f"{v(r.acc_student)} | {v(r.acc_student_fa_mean)} / {v(r.acc_student_fa_zero)} | "
                         f"{v(r.acc_student_gdn_random_mean)}{spread(r)} | {v(r.acc_student_top_mean)} | "
                         f"{v(r.acc_student_gdn_mean)} | {v(r.acc_teacher)} | {v(r.acc_teacher_fa_mean)} | "
                         f"{v(r.acc_teacher_gdn_mean)} |" + ("" if r.done else " (partial)"))
        singles = [f"{r.model} seed {r.seed}: {r.student_single_heads_out}" for r in g.itertuples()
                   if isinstance(r.student_single_heads_out, str)]
        if singles:
            lines += ["", "One head knocked out (mean ablation), accuracy: " + "; ".join(singles) + "."]
    return lines


def coverage_lines(out: Path) -> list[str]:
    """comparison.md's coverage section from OUT/mask_coverage.csv (:func:`mask_coverage`): per teacher ranking, each
    arm's FA heads' share of the positive scores and the ranking's top heads they hold."""
    import pandas as pd

    f = out / "mask_coverage.csv"
    if not f.exists():
        return []
    d = pd.read_csv(f)
    lines = []
    for key, g in d.groupby("ranking", sort=True):
        lines += ["", f"The teacher's heads on the anatomy pairs `{key}` (receiver IE, exact fp32): how much of it each "
                  "mask keeps as FA heads.", "",
                  "| arm | FA heads | share of positive IE | top 10 held | top N held (N = FA heads) |", "|---|---|---|---|---|"]
        lines += [f"| {r.arm} | {r.fa_heads} | {r.positive_share:.2f} | {r.top10_held} | {r.topN_held} |" for r in g.itertuples()]
    return lines


def _single_needle_bins(out: Path, csv_name: str, lengths: Sequence[int], lo: str, hi: str,
                        intro: Callable[[Any], str], label: Callable[[Any, Any], str]) -> list[str]:
    """A comparison.md table of unseen single-needle hits per bin (columns ``lo`` / ``hi`` of OUT/``csv_name``), one
    row per arm (:data:`COMPARISON_ARMS`, then the lever arms), tokens and length of ``lengths``, each entry
    'hits/n' summed over seeds; ``intro(frame)`` the sentence above it, ``label(lo, hi)`` a column's header."""
    import pandas as pd

    f = out / csv_name
    if not f.exists():
        return []
    d = pd.read_csv(f)
    d = d[(d.task == "niah_single") & (d.formats == "unseen") & d.length.isin(list(lengths))]
    if not len(d):
        return []
    arms = [m for m in COMPARISON_ARMS if m in set(d.model)] + sorted(set(d.model) - set(COMPARISON_ARMS))  # levers last
    bins = sorted(set(zip(d[lo], d[hi])))
    lines = ["", intro(d), "", "| arm | tokens | length | " + " | ".join(label(a, b) for a, b in bins) + " |",
             "|---|---|---|" + "---|" * len(bins)]
    for arm in arms:
        for tokens in sorted(set(d[d.model == arm].tokens)):
            for L in sorted(set(d[(d.model == arm) & (d.tokens == tokens)].length)):
                g = d[(d.model == arm) & (d.tokens == tokens) & (d.length == L)].groupby([lo, hi])[["hits", "n"]].sum()
                cells = [f"{int(g.loc[x].hits)}/{int(g.loc[x].n)}" if x in g.index else "–" for x in bins]
                lines.append(f"| {arm} | {tokens_text(int(tokens)) if tokens else '–'} | {L // 1024}K | " + " | ".join(cells) + " |")
    return lines


def depth_lines(out: Path, lengths: Sequence[int]) -> list[str]:
    """comparison.md's depth section: unseen single-needle accuracy per needle-depth fifth (OUT/retention_depth.csv,
    :func:`headscope.evaluation.retention.depth_table`; :func:`_single_needle_bins`), the approximate distance from the
    needle to the question in the header."""
    return _single_needle_bins(
        out, "retention_depth.csv", lengths, "depth_lo", "depth_hi",
        lambda d: "Unseen single-needle hits by needle depth (0 = the haystack's start, farthest from the question; "
                  "distance ≈ (1 − depth) × prompt length), summed over seeds:",
        lambda a, b: f"depth {a:.1f}–{b:.1f}")


def distance_lines(out: Path, lengths: Sequence[int]) -> list[str]:
    """comparison.md's distance section: unseen single-needle hits per exact distance from the needle to the end of
    the prompt (OUT/retention_distance.csv, :func:`headscope.evaluation.retention.distance_table`;
    :func:`_single_needle_bins`); the same distance column across lengths tells distance from relative depth."""
    return _single_needle_bins(
        out, "retention_distance.csv", lengths, "distance_lo", "distance_hi",
        lambda d: "Unseen single-needle hits by the needle's distance from the end of the prompt (tokens, exact per "
                  f"prompt; distances stored by {', '.join(sorted(set(d.distance_from)))}'s cells, the same prompts for "
                  "every model), summed over seeds:",
        lambda a, b: f"{a}–{b}")


LEVER_CELLS = ("niah_single", "unseen", 4096)  # the lever table's cells: task, formats, lengths up to


def tokens_text(tokens: int) -> str:
    """50000000 -> '50M', 12500000 -> '12.5M' (the --tokens spelling: :func:`parse_tokens` reads it back exactly)."""
    for unit, m in (("G", 10**9), ("M", 10**6), ("K", 10**3)):
        if tokens >= m and tokens % (m // 10) == 0:
            return f"{tokens / m:g}{unit}"
    return str(tokens)


def lever_of(model: str, tokens: int) -> tuple[str, str]:
    """(lever, arm command) of a retention.csv row: which levers the arm moved away from the study's
    arm of its mask, and the options that train it (``--piece train``/``eval``)."""
    arm, levers = parse_label(model)
    moved = [f"budget {ARM_BUDGETS[arm]}"] if arm in BUDGET_ARMS else []
    moved += ["selection: IE alone (κ = 1)"] if arm in SELECTION_ARMS else []
    moved += [f"{k}={v}" for k, v in levers.items()]
    if tokens != parse_tokens(BASE_TOKENS):
        moved.append(f"tokens {tokens_text(tokens)}")
    cmd = f"--arm {arm} --tokens {tokens_text(tokens)}" + "".join(f" --{k.replace('_', '-')} {v}" for k, v in levers.items())
    return (" + ".join(moved) or "baseline"), cmd


def lever_table(out: Path, lengths: Sequence[int] = (1024, 2048, 4096)) -> int:
    """OUT/levers.csv and OUT/levers.md: per trained arm (model label and tokens) of retention.csv, the
    retention on the unseen-format single-needle cells at ``lengths`` (:data:`LEVER_CELLS`): per seed the
    accuracy ÷ the teacher's on the same prompts, then the mean over seeds and its min and max; with
    the lever (what the arm changes against the study's arm of its mask), the arm's options and the
    number of seeds. Returns the number of rows (0 without retention.csv)."""
    import pandas as pd

    from headscope.runtime import atomic_write_text

    f = out / "retention.csv"
    if not f.exists():
        return 0
    task, fmt, _ = LEVER_CELLS
    df = pd.read_csv(f)
    df = df[(df.task == task) & (df.formats == fmt) & df.length.isin(lengths) & (df.model != "teacher")].copy()
    df["retention"] = df.accuracy / df.teacher_accuracy.where(df.teacher_accuracy > 0)
    order = {k: i for i, k in enumerate([*ARMS, *BUDGET_ARMS, *SELECTION_ARMS])}
    rows = []
    for (model, tokens), g in df.groupby(["model", "tokens"]):
        lever, cmd = lever_of(model, int(tokens))
        rec: dict[str, Any] = {"lever": lever, "model": model, "command": cmd, "tokens": int(tokens), "seeds": int(g.seed.nunique())}
        for L in lengths:
            r = g[g.length == L].retention
            rec.update({f"retention_{L}": r.mean(), f"retention_{L}_min": r.min(), f"retention_{L}_max": r.max()})
        rows.append(rec)
    rows.sort(key=lambda r: (order.get(parse_label(r["model"])[0], 99), r["lever"] != "baseline", r["tokens"], r["lever"]))
    cols = ["lever", "model", "command", "tokens", "seeds", *[f"retention_{L}{x}" for L in lengths for x in ("", "_min", "_max")]]
    table = pd.DataFrame(rows, columns=cols)
    table.to_csv(out / "levers.csv", index=False)

    def cell(r: dict, L: int) -> str:
        m, lo, hi = r[f"retention_{L}"], r[f"retention_{L}_min"], r[f"retention_{L}_max"]
        if pd.isna(m):
            return "—"
        return f"{m:.2f}" + (f" ({lo:.2f}–{hi:.2f})" if r["seeds"] > 1 else "")

    lines = ["| lever | arm command | tokens | " + " | ".join(f"unseen single {L // 1024}K" if L % 1024 == 0 else f"unseen single {L}" for L in lengths)
             + " | seeds |",
             "|---|---|---|" + "---|" * len(lengths) + "---|"]
    lines += [f"| {r['lever']} | `{r['command']}` | {tokens_text(r['tokens'])} | " + " | ".join(cell(r, L) for L in lengths)
              + f" | {r['seeds']} |" for r in rows]
    atomic_write_text(out / "levers.md", "\n".join(lines) + "\n")
    return len(rows)


def lever_reference(model: str, tokens: int) -> Optional[tuple[str, int]]:
    """The arm a lever row is measured against (same data, one lever back): an arm with lever options
    (``+name=value``) against the same arm without them at the same tokens; a budget or selection arm
    against ``hydra-7to1`` at the same tokens; the study's arm at other tokens against itself at
    :data:`BASE_TOKENS`; None for the study's arm at BASE_TOKENS (the baseline)."""
    arm, levers = parse_label(model)
    if levers:
        return arm, tokens
    if arm in BUDGET_ARMS or arm in SELECTION_ARMS:
        return "hydra-7to1", tokens
    if tokens != parse_tokens(BASE_TOKENS):
        return arm, parse_tokens(BASE_TOKENS)
    return None


def lever_pairs(out: Path, lengths: Sequence[int] = (1024, 2048, 4096)) -> int:
    """OUT/levers_paired.csv and a second table in OUT/levers.md: each lever row of levers.csv beside its
    reference (:func:`lever_reference`) on the seeds both were trained on (same documents) and the same prompts
    of the unseen single-needle cells: hits of each summed over the shared seeds, the prompts only one of them gets
    right, and McNemar's exact two-sided p (:func:`~headscope.evaluation.accuracy.paired_exact_test`) per length.
    The lever table's means pool other seeds; this table is the like-for-like comparison. Returns the rows
    written (0 without levers.csv or shared cells)."""
    from headscope.evaluation.accuracy import paired_exact_test
    from headscope.evaluation.retention import load_cells
    import pandas as pd

    from headscope.runtime import atomic_write_text

    f = out / "levers.csv"
    if not f.exists():
        return 0
    task, fmt, _ = LEVER_CELLS
    correct = {(c["model"], int(c["seed"]), int(c["tokens"]), int(c["length"])): c["correct"]
               for c in load_cells(out / "cells") if c["task"] == task and c["formats"] == fmt}
    rows = []
    for r in pd.read_csv(f).itertuples():
        ref = lever_reference(r.model, int(r.tokens))
        if ref is None:
            continue
        for L in lengths:
            seeds = sorted(s for (m, s, t, n) in correct if (m, t, n) == (r.model, int(r.tokens), L)
                           and (ref[0], s, ref[1], L) in correct)
            if not seeds:
                continue
            a = [x for s in seeds for x in correct[(r.model, s, int(r.tokens), L)]]
            b = [x for s in seeds for x in correct[(ref[0], s, ref[1], L)]]
            t = paired_exact_test(a, b)
            rows.append({"lever": r.lever, "model": r.model, "tokens": int(r.tokens), "reference": ref[0],
                         "reference_tokens": ref[1], "length": L, "seeds": " ".join(map(str, seeds)), "n": t["n"],
                         "hits": t["hits_a"], "reference_hits": t["hits_b"], "only_lever": t["only_a"],
                         "only_reference": t["only_b"], "p_value": t["p_value"]})
    cols = ["lever", "model", "tokens", "reference", "reference_tokens", "length", "seeds", "n", "hits",
            "reference_hits", "only_lever", "only_reference", "p_value"]
    pd.DataFrame(rows, columns=cols).to_csv(out / "levers_paired.csv", index=False)
    if rows and (out / "levers.md").exists():
        lines = ["", "Each lever beside its reference on the same seeds (documents) and prompts: hits of the lever's arm / "
                 "the reference's, summed over the shared seeds, and McNemar's exact p (`levers_paired.csv`):", "",
                 "| lever | arm | reference | seeds | " + " | ".join(f"single {L // 1024}K" if L % 1024 == 0 else f"single {L}"
                                                           for L in lengths) + " |",
                 "|---|---|---|---|" + "---|" * len(lengths)]
        by = {}
        for x in rows:
            by.setdefault((x["lever"], x["model"], x["tokens"], x["reference"], x["reference_tokens"]), {})[x["length"]] = x
        for (lever, model, tok, ref, ref_tok), cells in by.items():
            seeds = sorted({s for x in cells.values() for s in x["seeds"].split()}, key=int)
            lines.append(f"| {lever} | {model} {tokens_text(tok)} | {ref} {tokens_text(ref_tok)} | {', '.join(seeds)} | "
                         + " | ".join(f"{cells[L]['hits']} / {cells[L]['reference_hits']} of {cells[L]['n']} "
                                      f"(p = {cells[L]['p_value']:.2g})" if L in cells else "—" for L in lengths) + " |")
        atomic_write_text(out / "levers.md", (out / "levers.md").read_text() + "\n".join(lines) + "\n")
    return len(rows)


def token_curve(out: Path, lengths: Sequence[int] = (1024, 2048, 4096)) -> int:
    """OUT/token_curve.csv and OUT/token_curve.html: retention on the unseen single-needle cells against training
    tokens (the acceptance's curve for when the goal is out of reach at one budget), from OUT/levers.csv: for every
    arm label trained at two or more token budgets, one row per (tokens, length) with the mean retention over seeds,
    its min and max, and the seeds. The figure: one line per arm and length, tokens on a log axis, the goal's
    retention as a dashed line. Returns the number of arms with a curve (nothing is written without one)."""
    import pandas as pd

    f = out / "levers.csv"
    if not f.exists():
        return 0
    lev = pd.read_csv(f)
    rows = []
    for model, g in lev.groupby("model", sort=True):
        if g.tokens.nunique() < 2:
            continue
        for r in g.sort_values("tokens").itertuples():
            for L in lengths:
                rows.append({"model": model, "tokens": int(r.tokens), "seeds": int(r.seeds), "length": int(L),
                             "retention": getattr(r, f"retention_{L}"), "retention_min": getattr(r, f"retention_{L}_min"),
                             "retention_max": getattr(r, f"retention_{L}_max")})
    if not rows:
        return 0
    d = pd.DataFrame(rows)
    d.to_csv(out / "token_curve.csv", index=False)
    import plotly.graph_objects as go

    from headscope.plots import save_figure

    fig = go.Figure()
    for (model, L), g in d.groupby(["model", "length"], sort=True):
        fig.add_trace(go.Scatter(x=g.tokens, y=g.retention, mode="lines+markers", name=f"{model}, {L // 1024}K",
                                 error_y={"type": "data", "symmetric": False, "array": g.retention_max - g.retention,
                                          "arrayminus": g.retention - g.retention_min}))
    fig.add_hline(y=GOAL_RETENTION, line_dash="dash", annotation_text=f"goal {GOAL_RETENTION}")
    fig.update_layout(title="Unseen single-needle retention against training tokens (mean over seeds, min–max)",
                      xaxis={"type": "log", "title": "training tokens"}, yaxis={"title": "retention (student ÷ teacher)"},
                      width=760, height=480)
    save_figure(fig, out / "token_curve", formats=("html",))
    return int(d.model.nunique())


def curve_lines(out: Path) -> list[str]:
    """comparison.md's section on retention against tokens, from OUT/token_curve.csv (:func:`token_curve`)."""
    import pandas as pd

    f = out / "token_curve.csv"
    if not f.exists():
        return []
    d = pd.read_csv(f)
    toks = sorted(set(d.tokens))
    lines = ["", "Unseen single-needle retention against training tokens (mean over seeds; `token_curve.csv`, "
             "`token_curve.html`):", "", "| arm | length | " + " | ".join(tokens_text(int(t)) for t in toks) + " |",
             "|---|---|" + "---|" * len(toks)]
    for (model, L), g in d.groupby(["model", "length"], sort=True):
        by = dict(zip(g.tokens, g.retention))
        lines.append(f"| {model} | {L // 1024}K | " + " | ".join("–" if t not in by or pd.isna(by[t]) else f"{by[t]:.2f}"
                                                               for t in toks) + " |")
    return lines


def table_lengths(out: Path) -> list[int]:
    """The lengths of the lever and comparison tables: the suite's lengths (OUT/settings.json; without it, the lengths
    of the stored cells) up to :data:`TABLE_MAX_LEN`."""
    from headscope.evaluation.retention import load_cells

    f = out / "settings.json"
    every = json.loads(f.read_text())["suite"]["lengths"] if f.exists() else [c["length"] for c in load_cells(out / "cells")]
    return sorted({int(L) for L in every if int(L) <= TABLE_MAX_LEN})


def add_cli_rows(out: Path, sources: Sequence[Path]) -> int:
    """Append to OUT/retention.csv the rows ``headscope eval`` made (its retention.csv: the same columns, ``source`` =
    cli, or cli:TAG for an eval folder merged by run.py keep --tag) from each of ``sources`` that exists (a later
    source's row replaces an earlier one's with the same source, model, seed, tokens, task, formats and length: two eval
    folders' teachers on one cell are two rows). The study's rows stay as they were written. Returns the rows appended."""
    import pandas as pd

    from headscope.evaluation.retention import EVAL_COLUMNS

    frames = [pd.read_csv(f) for f in sources if Path(f).exists()]
    if not frames:
        return 0
    key = ["model", "seed", "tokens", "task", "formats", "length"]
    cli = pd.concat(frames, ignore_index=True).drop_duplicates(["source", *key], keep="last").sort_values([*key, "source"])
    with open(out / "retention.csv", "a", encoding="utf-8") as fh:
        fh.write(cli[list(EVAL_COLUMNS)].to_csv(index=False, header=False))
    return len(cli)


def report(out: Path, records: Optional[Path] = RECORDS, cli: Optional[Path] = None) -> str:
    """Every table of the study into ``out`` from ``records`` (restored into ``out`` first; None: ``out`` as it is)
    and the cells already in ``out``; then retention.csv gets the rows of ``headscope eval`` kept in the records
    (``cli_retention.csv``) and those of the eval folder ``cli`` (its retention.csv), source = cli. The other tables
    come from the study's cells alone (the package's evaluation writes its own report beside its rows). Returns a
    one-line summary."""
    from headscope.evaluation.retention import depth_table, distance_table, retention_table

    out = Path(out)
    if records is not None:
        restore_records(out, records)
    r = retention_table(out / "cells", out, source=STUDY_SOURCE)  # headscope eval's columns
    lengths = table_lengths(out)
    n_depth = depth_table(out / "cells", out)
    n_dist = distance_table(out / "cells", out)
    n_cov = len(mask_coverage(out))
    n_lev = lever_table(out, lengths)
    n_pairs = lever_pairs(out, lengths)
    n_curve = token_curve(out, lengths)
    n_ana = anatomy_table(out)  # before comparison.md, which has their sections
    n_cmp = comparison_table(out, lengths)
    n_cli = add_cli_rows(out, [p for p in ((records / "cli_retention.csv") if records else None,
                                           (Path(cli) / "retention.csv") if cli else None) if p is not None])

    def count(n: int, what: str) -> str:
        return f"{n} {what}{'' if n == 1 else 's'}"

    return (f"{count(r['rows'], 'row')} in retention.csv ({r['missing_teacher']} without a teacher cell; "
            f"{count(n_cli, 'row')} of headscope eval beside them), "
            f"{count(n_depth, 'row')} in retention_depth.csv, {count(n_dist, 'row')} in retention_distance.csv, "
            f"{count(n_cov, 'row')} in mask_coverage.csv, "
            f"{count(n_lev, 'row')} in levers.csv, {count(n_pairs, 'row')} in levers_paired.csv, {count(n_curve, 'arm')} in token_curve.csv, "
            f"{count(n_ana, 'student')} in anatomy.csv, "
            f"{count(n_cmp, 'arm row')} in comparison.md")


#: the tables :func:`report` writes, as the study folder keeps them
TABLES = ("retention.csv", "retention_summary.csv", "retention_seeds.csv", "retention_depth.csv", "retention_distance.csv",
          "mask_coverage.csv", "levers.csv", "levers.md", "levers_paired.csv", "token_curve.csv", "token_curve.html",
          "anatomy.csv", "anatomy_knockout.csv", "comparison.md")


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("runs/gen"), help="the run folder (the records are restored into it)")
    p.add_argument("--records", type=Path, default=RECORDS, help="the committed records")
    p.add_argument("--cli", type=Path, default=None, help="a `headscope eval` folder whose retention.csv rows to add")
    p.add_argument("--write-to", type=Path, default=None, help="also copy the tables into this folder (the study's)")
    a = p.parse_args(argv)
    print(report(a.out, a.records, a.cli), flush=True)
    if a.write_to:
        for t in TABLES:
            if (a.out / t).exists():
                shutil.copyfile(a.out / t, a.write_to / t)
        print(f"tables copied to {a.write_to}", flush=True)


if __name__ == "__main__":
    main()
