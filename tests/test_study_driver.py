"""experiments/conversion-generalization/run.py, the study as a driver of the package's commands: each lever is the
`headscope convert` options the study used, under the labels of its committed records; `keep` and the tables add
the rows `headscope eval` made (source = cli) to retention.csv without touching the study's rows; end to end on a
tiny random model (slow): convert, eval, generate and the tables through the package's commands."""
import gzip
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from headscope.evaluation.retention import EVAL_COLUMNS

ROOT = Path(__file__).resolve().parents[1]
STUDY = ROOT / "experiments" / "conversion-generalization"


def _driver():
    spec = importlib.util.spec_from_file_location("gen_driver", STUDY / "run.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _commands(step: str, *args: str) -> list[list[str]]:
    run = _driver()
    a = run.parser().parse_args([step, *args])
    a.extra = []
    return [c[3:] for c in run.commands(step, a)]  # without "python -m headscope.cli"


def test_levers_are_the_studys_options_under_its_labels(tmp_path):
    run = _driver()
    assert len((STUDY / "run.py").read_text().splitlines()) <= 300
    with gzip.open(STUDY / "records" / "cells.jsonl.gz", "rt") as fh:
        models = {json.loads(line)["model"] for line in fh}
    # every lever the study measured on seed 4 is named as its committed cells are
    assert {run.label("hydra-7to1", lev) for lev in ("baseline", "s2", "s3", "both")} <= models
    assert run.label("hydra-7to1", "rope") in models and run.label("hydra-5to1", "baseline") in models
    out = str(tmp_path)
    conv = _commands("convert", "--seed", "5", "--lever", "baseline", "--out", out)[0]
    rd = tmp_path / "seed5" / "hydra-7to1_t12500000"
    assert conv == ["convert", "--model", "smollm2-135m", "--mask", str(STUDY / "records" / "masks" / "hydra-7to1.json"),
                    "--out", str(rd), "--seed", "5", "--tokens", "12.5M", "--s2-retrieval", "0", "--s3-wordings", "3",
                    "--deterministic"]  # the study converts deterministically (issue 62 item 5)
    assert "--deterministic" not in _commands("convert", "--seed", "5", "--out", out, "--nondeterministic")[0]
    # the stage-3 length lever: 8K rows at the same tokens per step, under its own label; another teacher's arm by --name
    # issue 62's stage-3 tokens lever: twice the default's stage-3 budget (1,867,776 / 6,881,280 / 3,735,552 tokens)
    s3x = _commands("convert", "--seed", "1", "--lever", "s3tok2x", "--out", out)[0]
    assert s3x[s3x.index("--stage-tokens") + 1] == "1867776,6881280,7471104" and s3x[s3x.index("--tokens") + 1] == "12.5M"
    assert s3x[s3x.index("--out") + 1].endswith("+s2_retrieval=0.25+s3_wordings=6+s3_tokens=2x_t12500000")
    d = subprocess.run([sys.executable, str(STUDY / "run.py"), "dir", "--out", out, "--seed", "2", "--name", "headwise-7to1"],
                       capture_output=True, text=True, cwd=ROOT)
    assert d.stdout.rstrip("\n").split("\t") == [str(tmp_path / "seed2" / "headwise-7to1+s2_retrieval=0.25+s3_wordings=6_t12500000"),
                                                "headwise-7to1+s2_retrieval=0.25+s3_wordings=6"]
    s3 = _commands("convert", "--seed", "1", "--lever", "s3len8k", "--out", out)[0]
    assert s3[s3.index("--out") + 1] == str(tmp_path / "seed1" / "hydra-7to1+s2_retrieval=0.25+s3_wordings=6+long_len=8192_t12500000")
    assert s3[s3.index("--long-len") + 1] == "8192" and s3[s3.index("--batch-long") + 1] == "4"
    gem = _commands("eval", "--model", "gemma3-270m", "--mask", str(tmp_path / "m.json"), "--name", "gemma-head-L3",
                    "--out", out)[0]
    assert gem[1] == str(tmp_path / "seed0" / "gemma-head-L3+s2_retrieval=0.25+s3_wordings=6_t12500000" / "stage3")
    assert gem[gem.index("--name") + 1] == "gemma-head-L3+s2_retrieval=0.25+s3_wordings=6"
    # the package's defaults are the winning recipe: no option; a second run resumes
    rd2 = tmp_path / "seed5" / "hydra-7to1+s2_retrieval=0.25+s3_wordings=6_t12500000"
    rd2.mkdir(parents=True)
    (rd2 / "recipe.json").write_text("{}")
    assert _commands("convert", "--seed", "5", "--out", out)[0][-6:] == ["--seed", "5", "--tokens", "12.5M", "--deterministic",
                                                                         "--resume"]
    ev = _commands("eval", "--seed", "5", "--lever", "s2", "--out", out)[0]
    assert ev == ["eval", str(tmp_path / "seed5" / "hydra-7to1+s2_retrieval=0.25_t12500000" / "stage3"), "--teacher",
                  "smollm2-135m", "--formats", "unseen", "--lengths", "1K,2K,4K", "--name", "hydra-7to1+s2_retrieval=0.25",
                  "--out", str(tmp_path / "eval")]
    an = _commands("anatomy", "--seed", "5", "--arm", "layer-3to1", "--lever", "baseline", "--out", out)
    assert an[0][:3] == ["rank", "--model", str(tmp_path / "seed5" / "layer-3to1_t12500000" / "stage3")]
    assert an[1] == ["anatomy", str(tmp_path / "anatomy" / "layer-3to1_t12500000_s5"), "--format", "html"]
    ranked = _commands("convert", "--arm", "ranked", "--out", out)[0]
    assert ranked[ranked.index("--mask") + 1] == str(tmp_path / "rank" / "mask.json")
    for bad in (["convert", "--lever", "s4"], ["convert", "--arm", "layer-9to1"], ["convert", "--tokens", "lots"]):
        r = subprocess.run([sys.executable, str(STUDY / "run.py"), *bad, "--dry-run"], capture_output=True, text=True, cwd=ROOT)
        assert r.returncode == 2 or (r.returncode == 1 and "--tokens" in r.stderr), (bad, r.returncode, r.stderr)
    # extra arguments after -- go to the package's command as they are; --dry-run runs nothing
    r = subprocess.run([sys.executable, str(STUDY / "run.py"), "convert", "--out", out, "--dry-run", "--", "--device", "cpu"],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0 and r.stdout.startswith("$ headscope convert ") and r.stdout.rstrip().endswith("--device cpu")
    assert not (tmp_path / "seed0").exists()


def test_a_stage3_lever_reuses_stages_1_2_of_the_default(tmp_path):
    """--reuse-from both: the s3len8k arm starts from the default arm's finished stages 1-2 and their data (documents,
    stage-1/2 rows), not its stage-3 rows; a lever that changes stages 1-2 is refused, as a source without stage 2."""
    run = _driver()
    a = run.parser().parse_args(["convert", "--seed", "1", "--lever", "s3len8k", "--reuse-from", "both", "--out", str(tmp_path)])
    a.extra, a.out = [], tmp_path
    with pytest.raises(SystemExit, match="stage2 is not a finished stage"):
        run.commands("convert", a)
    src = tmp_path / "seed1" / "hydra-7to1+s2_retrieval=0.25+s3_wordings=6_t12500000"
    for f in ("stage1/training.json", "stage2/training.json", "data/docs/shard_0.pt", "data/stage1_rows.pt",
              "data/stage2_rows.json", "data/heldout.pt", "data/stage3_rows.pt", "recipe.json"):
        (src / f).parent.mkdir(parents=True, exist_ok=True)
        (src / f).write_text(f)
    cmds = run.commands("convert", a)
    assert [c[0] for c in cmds[:3]] == ["mkdir", "cp", "cp"] and cmds[3][-2:] == ["--deterministic", "--resume"]
    run.run(cmds[:3], dry_run=False)
    dst = tmp_path / "seed1" / "hydra-7to1+s2_retrieval=0.25+s3_wordings=6+long_len=8192_t12500000"
    assert sorted(str(p.relative_to(dst)) for p in dst.rglob("*") if p.is_file()) == [
        "data/docs/shard_0.pt", "data/heldout.pt", "data/stage1_rows.pt", "data/stage2_rows.json",
        "stage1/training.json", "stage2/training.json"]  # no recipe.json, no stage-3 rows: convert writes its own
    a.lever = "s3tok2x"  # issue 62's stage-3 tokens lever changes stage 3 only: it reuses the default's stages 1-2
    assert [c[0] for c in run.reuse_commands(a, tmp_path / "s3tok")] == ["mkdir", "cp", "cp"]
    a.lever = "baseline"
    with pytest.raises(SystemExit, match="differs from it in .*--s2-retrieval"):
        run.reuse_commands(a, dst)


def test_keep_and_cli_rows_beside_the_studys(tmp_path):
    """keep: OUT/eval's retention.csv and per-prompt cells into the records; add_cli_rows appends those rows to a
    retention.csv whose own rows stay byte for byte, the later source winning for the same cell."""
    run = _driver()
    ev = tmp_path / "out" / "eval"
    (ev / "cells" / "m__s5__t12500000").mkdir(parents=True)
    cell = {"model": "m", "seed": 5, "tokens": 12500000, "task": "niah_single", "formats": "unseen", "length": 1024,
            "n": 2, "hits": 1, "correct": [1, 0]}
    (ev / "cells" / "m__s5__t12500000" / "niah_single.unseen.1024.json.gz").write_bytes(gzip.compress(json.dumps(cell).encode()))
    rows = pd.DataFrame([dict(model="m", seed=5, tokens=12500000, task="niah_single", formats="unseen", length=L, n=2,
                              hits=1, accuracy=0.5, teacher_accuracy=1.0, agreement=1.0, source="cli") for L in (2048, 1024)])
    rows[list(EVAL_COLUMNS)].to_csv(ev / "retention.csv", index=False)
    records = tmp_path / "records"
    records.mkdir()
    assert "1 cells and 0 stage records" in run.keep(tmp_path / "out", records)
    assert not (records / "cli_training.jsonl.gz").exists()
    with gzip.open(records / "cli_cells.jsonl.gz", "rt") as fh:
        assert [json.loads(line) for line in fh] == [{**cell, "source": "cli"}]
    stage = tmp_path / "out" / "seed5" / "hydra-7to1_t12500000"
    for k in (2, 1):
        (stage / f"stage{k}").mkdir(parents=True)
        (stage / f"stage{k}" / "training.json").write_text(json.dumps({"stage": k, "seconds": 10.0 * k}))
    assert "2 stage records" in run.keep(tmp_path / "out", records)
    with gzip.open(records / "cli_training.jsonl.gz", "rt") as fh:
        assert [json.loads(line) for line in fh] == [{"run": "seed5/hydra-7to1_t12500000", "stage": k, "seconds": 10.0 * k,
                                                      "source": "cli"} for k in (1, 2)]
    # keep merges: the records' rows are the eval's (kept twice: once); a row kept from another eval stays
    assert (records / "cli_retention.csv").read_bytes() == (ev / "retention.csv").read_bytes()
    other = tmp_path / "other"
    (other / "eval").mkdir(parents=True)
    rows.iloc[:1].assign(length=512)[list(EVAL_COLUMNS)].to_csv(other / "eval" / "retention.csv", index=False)
    (tmp_path / "records2").mkdir()
    run.keep(other, tmp_path / "records2")
    run.keep(tmp_path / "out", tmp_path / "records2")
    assert sorted(pd.read_csv(tmp_path / "records2" / "cli_retention.csv").length) == [512, 1024, 2048]
    table = tmp_path / "t"
    table.mkdir()
    study = (STUDY / "retention.csv").read_bytes()
    (table / "retention.csv").write_bytes(study)
    newer = tmp_path / "newer.csv"
    rows.assign(hits=2, accuracy=1.0)[list(EVAL_COLUMNS)].iloc[:1].to_csv(newer, index=False)
    assert run.TABLES.add_cli_rows(table, [records / "cli_retention.csv", newer, tmp_path / "absent.csv"]) == 2
    text = (table / "retention.csv").read_bytes()
    assert text.startswith(study)
    added = pd.read_csv(table / "retention.csv").iloc[-2:]
    assert list(added.length) == [1024, 2048] and list(added.hits) == [1, 2] and set(added.source) == {"cli"}


@pytest.mark.slow
def test_driver_end_to_end_on_a_tiny_model(small_tokenizer, tmp_path, request):
    """convert (the three stages, baseline lever), eval (the teacher beside), generate, the anatomy (rank on the
    hybrid path + anatomy) and the tables through the package's commands on a tiny random Llama; the eval's rows land
    in the tables' retention.csv as source = cli. The steps after convert run at once (the tables after eval)."""
    from headscope.masks import HeadMask

    from conftest import tiny_llama

    teacher = tmp_path / "teacher"
    tiny_llama(small_tokenizer, seed=3).save_pretrained(teacher)  # 2,048 tokens: the LM head no longer dominates
    small_tokenizer.save_pretrained(teacher)
    HeadMask(2, 4, 2, ((1,), (0, 3))).to_json(tmp_path / "mask.json")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(f"The sailor {w} walked to the harbour in the morning and the gulls followed him. " * 8
                                  for w in ("slowly", "quietly", "happily", "often", "again", "alone", "early", "late")))
    out = tmp_path / "out"
    base = [sys.executable, str(STUDY / "run.py")]
    common = ["--model", str(teacher), "--mask", str(tmp_path / "mask.json"), "--lever", "baseline", "--tokens", "3K",
              "--out", str(out)]

    started: dict[subprocess.Popen, Path] = {}  # each command's process and its log (stdout and stderr)
    request.addfinalizer(lambda: [p.kill() for p in started if p.poll() is None])  # a failed assertion stops the rest

    def start(step: str, *args: str) -> subprocess.Popen:  # output to a file: no pipe fills while another runs
        log = tmp_path / f"{step}.log"
        with open(log, "w") as fh:
            p = subprocess.Popen([*base, step, *args], stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT)
        started[p] = log
        return p

    def finish(p: subprocess.Popen) -> str:
        p.wait(timeout=900)
        text = started[p].read_text()
        assert p.returncode == 0, text[-5000:]
        return text

    def run(*args: str) -> str:
        return finish(start(*args))

    run("convert", *common, "--", "--device", "cpu", "--corpus", str(corpus), "--seq-len", "128", "--long-len", "256",
        "--batch-size", "2", "--batch-long", "2", "--gdn-kernel", "torch")
    rd = out / "seed0" / "hydra-7to1_t3000"
    assert all((rd / f"stage{k}" / "config.json").exists() for k in (1, 2, 3))
    rec = json.loads((rd / "stage3" / "training.json").read_text())  # the driver converts with --deterministic
    assert rec["config"]["train"]["deterministic"] is True and rec["step_plan"]["nondeterministic"] == []
    # eval (then the tables), generate and the anatomy read the converted student only: they run at once (one
    # intra-op thread each, tests/conftest.py), as the study runs its steps on separate devices
    anatomy = start("anatomy", *common, "--", "--seq-len", "256", "--pairs", "2", "--device", "cpu", "--min-gap", "0")
    generate = start("generate", *common, "--", "--device", "cpu")
    run("eval", *common, "--lengths", "256", "--corpus", "builtin", "--", "--device", "cpu", "--n", "2",
        "--tasks", "niah_single", "--gen-n", "1")
    ev = pd.read_csv(out / "eval" / "retention.csv")
    assert set(ev.model) == {"hydra-7to1", "teacher"} and (ev.source == "cli").all() and (ev.n == 2).all()
    assert set(ev[ev.model == "hydra-7to1"].seed) == {0} and set(ev[ev.model == "hydra-7to1"].tokens) == {3000}
    run("tables", "--out", str(out))
    t = pd.read_csv(out / "tables" / "retention.csv")
    committed = pd.read_csv(STUDY / "retention.csv")  # the study's rows and the cli rows kept in records/
    assert len(t) == len(committed) + len(ev)
    assert (t.source == "cli").sum() == (committed.source == "cli").sum() + len(ev) and (t.source == "study").sum() == 232
    assert (out / "tables" / "levers.md").read_bytes() == (STUDY / "levers.md").read_bytes()
    assert "tokens/s" in finish(generate)
    # the anatomy: the student's FA and GDN heads ranked on the hybrid path, then summarized
    finish(anatomy)
    heads = pd.read_csv(out / "anatomy" / "hydra-7to1_t3000_s0" / "scores.csv")
    assert len(heads) == 8 and set(heads["kind"]) == {"fa", "gdn"} and (heads["kind"] == "fa").sum() == 3
    assert (out / "anatomy" / "hydra-7to1_t3000_s0" / "anatomy" / "anatomy.json").exists()
