"""The conversion study (issue 40) run with the package's commands: each arm and lever is a set of options of
``headscope convert``, each evaluation ``headscope eval`` on the unseen template family, the anatomy ``headscope rank``
and ``headscope anatomy`` on the converted folder; the study's tables come from its committed records (tables.py).

    python experiments/conversion-generalization/run.py convert --seed 5                  # hydra-7to1, the package's defaults
    python experiments/conversion-generalization/run.py convert --seed 5 --lever s3len8k --reuse-from both  # stage 3 at 8K
    python experiments/conversion-generalization/run.py eval --seed 5                     # unseen cells 1K-4K, the teacher beside
    python experiments/conversion-generalization/run.py all --seed 5 --lever baseline     # convert, eval, generate
    python experiments/conversion-generalization/run.py anatomy --seed 5                  # the student's heads ranked
    python experiments/conversion-generalization/run.py tables --write-to experiments/conversion-generalization
    python experiments/conversion-generalization/run.py keep [--tag T]                    # OUT's rows merged into records/
    python experiments/conversion-generalization/run.py figures                           # figures.py on retention.csv

Every conversion runs with ``headscope convert --deterministic`` (``--nondeterministic``: without). Every step prints
the command it runs (``--dry-run``: prints only); arguments after ``--`` go to each of the step's
package commands as they are (e.g. ``-- --batch-size 4 --device cpu``; anatomy: to its ranking). A step resumes where it stopped when run again
(``headscope convert --resume``, ``headscope eval`` per cell). Folders: OUT/seedS/LABEL_tTOKENS/ (the conversion:
stage1..3/ are model folders), OUT/eval/ (every model's cells, retention.csv, report.md / .html), OUT/anatomy/,
OUT/tables/. LABEL is the arm with each lever away from the study's first setting (``hydra-7to1+s2_retrieval=0.25``),
the names the committed records use.
"""

from __future__ import annotations

import argparse
import importlib.util
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Optional

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def _tables():
    """tables.py beside this file, loaded by path (the name ``tables`` is PyTables' too)."""
    spec = importlib.util.spec_from_file_location("conversion_study_tables", HERE / "tables.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


TABLES = _tables()
MASKS = TABLES.RECORDS / "masks"  # every arm's mask as the study built it (hydra-7to1: the HydraHead 7:1 mask)
#: the levers of the study as ``headscope convert`` options, each with the label part it adds to the arm's name. The
#: package's defaults are the study's winning recipe (``both``); the study's first setting, its ``baseline``, had
#: neither data lever (no stage-2 retrieval rows, three stage-3 wordings).
LEVERS = {
    "both": ("+s2_retrieval=0.25+s3_wordings=6", []),
    "baseline": ("", ["--s2-retrieval", "0", "--s3-wordings", "3"]),
    "s2": ("+s2_retrieval=0.25", ["--s3-wordings", "3"]),
    "s3": ("+s3_wordings=6", ["--s2-retrieval", "0"]),
    "rope": ("+fa_pos=rope", ["--s2-retrieval", "0", "--s3-wordings", "3", "--fa-pos", "rope"]),
    # issue 62's length lever on the package's defaults: stage-3 rows of 4K / 8K at the same tokens per step (16 x 2K)
    "s3len4k": ("+s2_retrieval=0.25+s3_wordings=6+long_len=4096", ["--long-len", "4096", "--batch-long", "8"]),
    "s3len8k": ("+s2_retrieval=0.25+s3_wordings=6+long_len=8192", ["--long-len", "8192", "--batch-long", "4"]),
    # issue 62's stage-3 tokens lever: twice the default's stage-3 budget, stages 1-2 as the default's (--stage-tokens
    # computed by stage_tokens(); with --reuse-from both only stage 3 trains)
    "s3tok2x": ("+s2_retrieval=0.25+s3_wordings=6+s3_tokens=2x", ["--stage-tokens", "S3X2"]),
}
#: the anatomy's ranking: the student's heads (FA and GDN) by receiver IE on single-needle pairs at 4K, as the study's
ANATOMY = ["--task", "niah_single", "--pairs", "6", "--seq-len", "4096"]
PROMPT = ("The harbour master keeps a ledger. The code word of the blue boat is 4172. The nets were mended before dawn "
          "and the gulls followed the last boat in. What is the code word of the blue boat? The code word is")


def label(arm: str, lever: str) -> str:
    return arm + LEVERS[lever][0]


def run_dir(a: argparse.Namespace) -> Path:
    """OUT/seedS/LABEL_tTOKENS: the conversion folder of the arm, lever, seed and budget."""
    return a.out / f"seed{a.seed}" / f"{label(a.name or a.arm, a.lever)}_t{TABLES.parse_tokens(a.tokens)}"


def headscope(*args: str) -> list[str]:
    return [sys.executable, "-m", "headscope.cli", *map(str, args)]


def mask_of(a: argparse.Namespace) -> Path:
    """--mask, else OUT/rank/mask.json for ``--arm ranked`` (the `rank` step's), else the committed mask of the arm."""
    if a.mask:
        return a.mask
    return a.out / "rank" / "mask.json" if a.arm == "ranked" else MASKS / f"{a.arm}.json"


#: options that change only stage 3: a lever made of these trains stages 1-2 as the lever it reuses them from
#: (--stage-tokens: only as the s3tok2x lever sets it, stages 1-2 at the default's budgets)
STAGE3_OPTIONS = {"--long-len", "--batch-long", "--s3-retrieval", "--s3-wordings", "--s3-seen-task", "--stage-tokens"}


def stage_tokens(a: argparse.Namespace, s3_factor: int = 2) -> str:
    """--stage-tokens of the s3tok lever: the default recipe's stage budgets at --tokens (with the row options of
    the extra arguments, e.g. a CPU try's --batch-size), stage 3's times ``s3_factor``: '1867776,6881280,7471104'."""
    from headscope.train.recipe import ConvertRecipe

    names = {"--seq-len": "seq_len", "--long-len": "long_len", "--batch-size": "batch_size", "--batch-long": "batch_long"}
    kw = {names[k]: int(v) for k, v in zip(a.extra, a.extra[1:]) if k in names}
    r = ConvertRecipe(tokens=TABLES.parse_tokens(a.tokens), **kw)
    return ",".join(str(r.stage_budget(k) * (s3_factor if k == 3 else 1)) for k in (1, 2, 3))


def reuse_commands(a: argparse.Namespace, rd: Path) -> list[list[str]]:
    """``--reuse-from LEVER``: copy that lever's finished stages 1-2 and their data (documents, stage-1/2 rows,
    held-out rows) of the same arm, seed and tokens into ``rd``, so that only stage 3 trains (on the same documents).

    Raises:
        SystemExit: the levers differ in more than stage-3 options, or the source has no finished stage 2.
    """
    def opts(lever: str) -> dict[str, str]:
        o = LEVERS[lever][1]
        return dict(zip(o[::2], o[1::2]))

    mine, theirs = opts(a.lever), opts(a.reuse_from)
    diff = {k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k)}
    if diff - STAGE3_OPTIONS:
        raise SystemExit(f"--reuse-from {a.reuse_from}: lever {a.lever} differs from it in {sorted(diff - STAGE3_OPTIONS)}, "
                         "which change stages 1-2; convert it from the start")
    src = a.out / f"seed{a.seed}" / f"{label(a.name or a.arm, a.reuse_from)}_t{TABLES.parse_tokens(a.tokens)}"
    if not (src / "stage2" / "training.json").exists():
        raise SystemExit(f"--reuse-from {a.reuse_from}: {src}/stage2 is not a finished stage; convert --lever "
                         f"{a.reuse_from} first")
    data = [src / "data" / "docs"] + sorted(f for f in (src / "data").glob("*") if f.name.startswith(("stage1_", "stage2_", "heldout")))
    return [["mkdir", "-p", str(rd / "data")], ["cp", "-r", str(src / "stage1"), str(src / "stage2"), str(rd)],
            ["cp", "-r", *map(str, data), str(rd / "data")]]


def commands(step: str, a: argparse.Namespace) -> list[list[str]]:
    """The package's commands of one step, in order."""
    rd, extra = run_dir(a), list(a.extra)
    if step == "rank":  # a new HydraHead-style mask from the teacher's ranking (the committed one: --arm hydra-7to1)
        return [headscope("rank", "--model", a.model, "--budget", a.budget, "--out", a.out / "rank", *extra)]
    if step == "convert":
        copy = reuse_commands(a, rd) if a.reuse_from and not (rd / "recipe.json").exists() else []
        resume = ["--resume"] if (rd / "recipe.json").exists() or copy else []
        det = [] if a.nondeterministic else ["--deterministic"]  # the study's default: evidence that holds still
        opts = [stage_tokens(a) if o == "S3X2" else o for o in LEVERS[a.lever][1]]
        return copy + [headscope("convert", "--model", a.model, "--mask", mask_of(a), "--out", rd, "--seed", a.seed,
                                 "--tokens", a.tokens, *opts, *det, *resume, *extra)]
    if step == "eval":
        corpus = ["--corpus", a.corpus] if a.corpus else []
        return [headscope("eval", rd / "stage3", "--teacher", a.model, "--formats", "unseen", "--lengths", a.lengths,
                          "--name", label(a.name or a.arm, a.lever),
                          "--out", a.out / "eval", *corpus, *extra)]
    if step == "generate":
        return [headscope("generate", rd / "stage3", PROMPT, "--max-new-tokens", "8", *extra)]
    if step == "anatomy":
        d = a.out / "anatomy" / f"{rd.name}_s{a.seed}"  # extra arguments go to the ranking; the summary gets --device
        dev = extra[extra.index("--device"):extra.index("--device") + 2] if "--device" in extra else []
        return [headscope("rank", "--model", rd / "stage3", *ANATOMY, "--out", d, *extra),
                headscope("anatomy", d, "--format", "html", *dev)]
    raise ValueError(step)


def run(cmds: list[list[str]], dry_run: bool) -> None:
    for c in cmds:
        shown = ["headscope"] + c[3:] if c[1:3] == ["-m", "headscope.cli"] else c
        print("$ " + shlex.join(shown), flush=True)
        if not dry_run:
            r = subprocess.run(c, cwd=ROOT)
            if r.returncode:
                raise SystemExit(r.returncode)


def _beside(name: str):
    """A module of this folder loaded by path (sessions.py: the state between GPU sessions; figures.py)."""
    spec = importlib.util.spec_from_file_location(f"conversion_study_{name}", HERE / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def keep(out: Path, records: Path = TABLES.RECORDS, tag: Optional[str] = None) -> str:
    """OUT's results merged into the records (sessions.py ``merge``): OUT/eval's retention.csv rows into
    ``cli_retention.csv`` (source ``cli``, or ``cli:TAG``), its per-prompt cells into ``cli_cells.jsonl.gz``, every
    conversion's stage records (OUT/seedS/LABEL_tT/stage{k}/training*.json, ``run`` = seedS/LABEL_tT) into
    ``cli_training.jsonl.gz``; what the records held stays unless a merged row of the same key replaces it."""
    return _beside("sessions").merge(out, records, tag)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("step", choices=["rank", "convert", "eval", "generate", "anatomy", "all", "tables", "keep",
                                         "figures", "dir"],
                   help="all: convert, eval and generate in turn; figures: figures.py on OUT/tables/retention.csv (else "
                        "the study's); dir: print the conversion folder and the model label")
    p.add_argument("--out", type=Path, default=Path("runs/gen"), help="the study's run folder")
    p.add_argument("--model", default="smollm2-135m", help="the teacher")
    p.add_argument("--arm", default="hydra-7to1", choices=[*sorted(f.stem for f in MASKS.glob("*.json")), "ranked"],
                   help="the mask: a committed arm's, or 'ranked' (OUT/rank/mask.json of the rank step)")
    p.add_argument("--mask", type=Path, default=None, help="any mask.json instead (the label still names --arm, or --name)")
    p.add_argument("--name", default=None, help="the arm's name in the labels instead of --arm (e.g. gemma3-headwise-L3 "
                   "for a `headscope mask` arm of another teacher)")
    p.add_argument("--lever", default="both", choices=list(LEVERS),
                   help="both: the package's defaults (both data levers); baseline: the study's first setting")
    p.add_argument("--seed", type=int, default=0, help="the conversion's seed (documents, rows, initialization)")
    p.add_argument("--tokens", default="12.5M", help="the conversion's token budget")
    p.add_argument("--budget", default="7:1", help="rank: the FA budget of OUT/rank/mask.json")
    p.add_argument("--reuse-from", default=None, choices=list(LEVERS),
                   help="convert: start from this lever's finished stages 1-2 (same arm, seed, tokens, documents) when "
                        "--lever changes only stage 3 (s3len4k / s3len8k from both)")
    p.add_argument("--nondeterministic", action="store_true",
                   help="convert without --deterministic (the study passes it: PyTorch's deterministic kernels)")
    p.add_argument("--lengths", default="1K,2K,4K", help="eval: prompt lengths of the unseen cells (the goal's 1K-4K)")
    p.add_argument("--corpus", default=None, help="eval: haystack text file or 'builtin' (default: sampled from the teacher)")
    p.add_argument("--write-to", type=Path, default=None, help="tables: also copy them here (the study's folder)")
    p.add_argument("--tag", default=None, help="keep: source = cli:TAG for the merged rows (one eval folder's name)")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    return p


def main(argv: Optional[list[str]] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    a = parser().parse_args(argv[:len(argv) - len(extra) - (1 if "--" in argv else 0)])
    a.extra = extra
    # paths as the caller means them: the commands run from the repository root (tools/device/chain.sh: from a copy)
    a.out = a.out.resolve()
    a.mask = a.mask.resolve() if a.mask else None
    a.corpus = str(Path(a.corpus).resolve()) if a.corpus and a.corpus != "builtin" else a.corpus
    try:
        TABLES.parse_tokens(a.tokens)
    except ValueError:
        raise SystemExit(f"--tokens {a.tokens!r}: give a token count such as 12.5M, 200K or 50000000") from None
    if a.step == "tables":
        print(TABLES.report(a.out / "tables", TABLES.RECORDS, cli=a.out / "eval"), flush=True)
        if a.write_to:
            for t in TABLES.TABLES:
                if (a.out / "tables" / t).exists():
                    shutil.copyfile(a.out / "tables" / t, a.write_to / t)
        return
    if a.step == "keep":
        print(keep(a.out, tag=a.tag), flush=True)
        return
    if a.step == "dir":
        print(f"{run_dir(a)}\t{label(a.name or a.arm, a.lever)}", flush=True)
        return
    if a.step == "figures":
        t = a.out / "tables" / "retention.csv"
        _beside("figures").main(["--retention", str(t if t.exists() else HERE / "retention.csv"),
                                 "--cells", str(TABLES.RECORDS / "cli_cells.jsonl.gz"),
                                 "--out", str(a.write_to or a.out / "figures")])
        return
    for step in (("convert", "eval", "generate") if a.step == "all" else (a.step,)):
        run(commands(step, a), a.dry_run)


if __name__ == "__main__":
    main()
