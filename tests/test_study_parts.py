"""Issue 62's GPU parts (experiments/conversion-generalization/gpu_parts.sh) and the state they carry between lent
sessions (sessions.py): every part's package commands (printed by DRY_RUN), a student whose cells are all in the
carried state is not converted again, what comes back leaves out weights, prompt sets and HTML, a re-conversion keeps
the earlier training record, and the merge into the records keeps other eval folders' rows (fast); each part run for
real at tiny scale on CPU, resumed in a second "session" from the first's returned folder (slow)."""
import gzip
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from headscope.evaluation.retention import EVAL_COLUMNS

ROOT = Path(__file__).resolve().parents[1]
STUDY = ROOT / "experiments" / "conversion-generalization"
PARTS = STUDY / "gpu_parts.sh"
LABEL = "hydra-7to1+s2_retrieval=0.25+s3_wordings=6"
ALL = "niah_single,niah_multikey,niah_multivalue,variable_tracking"


def _sessions():
    spec = importlib.util.spec_from_file_location("study_sessions", STUDY / "sessions.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _parts(out: Path, *parts: str, **env: str) -> subprocess.CompletedProcess:
    e = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(ROOT), "POLL": "1", **env}
    return subprocess.run(["bash", str(PARTS), str(out), *parts], capture_output=True, text=True, cwd=ROOT, env=e,
                          timeout=1200)


def _chains(out: Path, logs: Path, *chains: tuple[str, ...], **env: str) -> list[tuple[int, str]]:
    """Parts in chains side by side on one OUT (gpu_parts.sh run once per chain, as two chains share a session on the
    GPU); each chain's exit status and output (stdout then stderr, from a file: no pipe fills while the other runs)."""
    e = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(ROOT), "POLL": "1", **env}
    procs = []
    for k, parts in enumerate(chains):
        log = logs / f"chain{k}.log"
        with open(log, "w") as out_fh, open(log.with_suffix(".err"), "w") as err_fh:
            procs.append((subprocess.Popen(["bash", str(PARTS), str(out), *parts], stdout=out_fh, stderr=err_fh,
                                           text=True, cwd=ROOT, env=e), log))
    got = []
    for p, log in procs:
        p.wait(timeout=1200)
        got.append((p.returncode, log.read_text() + log.with_suffix(".err").read_text()))
    return got


def _commands(stdout: str) -> list[str]:
    """The printed commands, "python -m headscope.cli X" as "headscope X", the driver as "run.py X"."""
    out = []
    for line in stdout.splitlines():
        if line.startswith("+ "):
            c = line[2:].replace(f"{sys.executable} -m headscope.cli ", "headscope ")
            out.append(c.replace(f"{sys.executable} {STUDY}/run.py ", "run.py "))
    return out


def test_every_part_prints_its_package_commands(tmp_path):
    """DRY_RUN: the teacher's long cells once per part that needs them, each student converted through the driver then
    scored length by length; the budget masks at LA:FA = R:1 within round(30 / (R + 1)) layers of KV cache (8 / 4 / 2 /
    1, the study's layer-3to1 and layer-7to1 had 8 and 4); the lever rankings on one and on four tasks; Gemma's masks
    within 3 layers; one evaluation setting everywhere (cells are skipped only under the same settings)."""
    r = _parts(tmp_path / "o", "long_teacher", "long_s1", "budget_s0_3", "budget_s0_7", "budget_s0_15", "budget_s0_31",
               "levers_rank", "levers_s1_masks", "levers_s1_s3tok", "gemma_rank", "gemma_s0_head", DRY_RUN="1")
    assert r.returncode == 0, r.stderr
    cmds = _commands(r.stdout)
    evals = [c for c in cmds if c.startswith("headscope eval") or c.startswith("run.py eval")]
    setting = "--n 100 --gen-n 20 --gen-max-len 65536 --batch-tokens 32768 --workers 8 --no-progress"
    assert evals and all(c.endswith(setting) or setting + " " in c for c in evals)
    w = tmp_path / "o" / "work"
    assert cmds[0] == (f"headscope eval smollm2-135m --name teacher --out {w}/smollm2/eval --tasks {ALL} "
                       f"--lengths 8K,16K,32K,64K {setting}")
    long1 = [c for c in cmds if "--seed 1" in c and "--name" not in c and "--lever" not in c]
    assert long1[0] == f"run.py convert --out {w}/smollm2 --tokens 12.5M --model smollm2-135m --seed 1 --"
    # one eval per set of missing tasks over the lengths that miss them (one model load)
    assert long1[1].split("--lengths ")[1].split()[0] == "8K,16K,32K,64K"
    assert f"-- --tasks {ALL} " in long1[1]
    masks = [c for c in cmds if c.startswith("headscope mask")]
    ranking = STUDY / ".." / "fused-smollm2" / "focus"
    assert masks[:4] == [f"headscope mask {ranking} --kv-layers {L} --budget {R}:1 --layerwise even --out "
                         f"{w}/smollm2/masks/kv_{R}to1" for R, L in ((3, 8), (7, 4), (15, 2), (31, 1))]
    budget = [c for c in cmds if "--name headwise-7to1" in c or "--name layerwise-7to1" in c]
    assert budget[0].startswith("run.py convert") and f"--mask {w}/smollm2/masks/kv_7to1/headwise.json" in budget[0]
    assert [c.split("--lengths ")[1].split()[0] for c in budget if c.startswith("run.py eval")] == ["1K,2K,4K,8K,16K"] * 2
    assert all("--tasks niah_single,niah_multikey " in c for c in budget if c.startswith("run.py eval"))
    ranks = [c for c in cmds if c.startswith("headscope rank")]
    assert ranks[1] == (f"headscope rank --model smollm2-135m --task niah_single --task niah_multikey --task "
                        f"niah_multivalue --task variable_tracking --pairs 6 --seq-len 512 --budget 7:1 --min-per-layer 1 "
                        f"--out {w}/smollm2/rank/fused4")
    lever = [c for c in cmds if "--lever s3tok2x" in c]
    assert lever[0].startswith("run.py convert") and "--reuse-from both" in lever[0]
    assert [c.split("--lengths ")[1].split()[0] for c in lever[1:]] == ["1K,2K,4K,8K", "16K,32K"]
    assert "-- --tasks niah_multikey " in lever[-1]
    assert (f"headscope mask {w}/gemma3/rank/fused2 --kv-layers 3 --budget 7:1 --layerwise even --out "
            f"{w}/gemma3/masks/kv_L3") in cmds
    gem = [c for c in cmds if "--name gemma-headwise-kv3" in c]
    assert gem[0] == (f"run.py convert --out {w}/gemma3 --tokens 12.5M --model /tmp/g/gemma3-270m.gguf --seed 0 --name "
                      f"gemma-headwise-kv3 --mask {w}/gemma3/masks/kv_L3/headwise.json --")
    bad = _parts(tmp_path / "o", "long_s", DRY_RUN="1")
    assert bad.returncode == 2 and "unknown part long_s" in bad.stderr


def test_a_student_whose_cells_came_back_is_not_converted(tmp_path):
    """A part run again in a later session with the earlier session's folder as STATE: its student's cells are all
    there, so nothing is converted or scored; the cells are restored into the work folder."""
    state = tmp_path / "state"
    d = state / "smollm2" / "eval" / "cells" / f"{LABEL}__s0__t12500000"
    d.mkdir(parents=True)
    for t in ALL.split(","):
        for L in (8192, 16384, 32768, 65536):
            (d / f"{t}.unseen.{L}.json.gz").write_bytes(gzip.compress(b"{}"))
    r = _parts(tmp_path / "o", "long_s0", STATE=str(state))
    assert r.returncode == 0, r.stderr
    assert f"{LABEL} seed 0: every cell is there" in r.stdout and "+ " not in r.stdout
    assert len(list((tmp_path / "o" / "work" / "smollm2" / "eval" / "cells").rglob("*.json.gz"))) == 16
    (d / "variable_tracking.unseen.65536.json.gz").unlink()
    r = _parts(tmp_path / "o2", "long_s0", STATE=str(state), DRY_RUN="1")
    assert r.returncode == 0 and "convert and score its missing cells" in r.stdout
    # the stage-3 tokens lever and its reference with all their cells: neither converted (nor the reference for the
    # lever's stages 1-2)
    for label in (LABEL, LABEL + "+s3_tokens=2x"):
        d = state / "smollm2" / "eval" / "cells" / f"{label}__s1__t12500000"
        d.mkdir(parents=True)
        cells = [(t, L) for t in ALL.split(",") for L in (1024, 2048, 4096, 8192)] + [("niah_multikey", 16384),
                                                                                      ("niah_multikey", 32768)]
        for t, L in cells:
            (d / f"{t}.unseen.{L}.json.gz").write_bytes(gzip.compress(b"{}"))
    r = _parts(tmp_path / "o3", "levers_s1_s3tok", STATE=str(state))
    assert r.returncode == 0, r.stderr
    assert f"{LABEL} seed 1: every cell is there" in r.stdout and f"{LABEL}+s3_tokens=2x seed 1: every cell is there" \
        in r.stdout and "+ " not in r.stdout


def test_missing_cells_and_kv_layers(tmp_path):
    s = _sessions()
    d = tmp_path / "cells" / "m+x=1__s2__t12500000"
    d.mkdir(parents=True)
    (d / "niah_single.unseen.8192.json.gz").write_bytes(b"")
    (d / "niah_multikey.unseen.8192.json").write_text("{}")
    (d / "variable_tracking.unseen.4096.json.gz").write_bytes(b"")
    assert s.missing(tmp_path, "m+x=1", 2, 12_500_000, ALL.split(","), 8192) == ["niah_multivalue", "variable_tracking"]
    assert s.missing(tmp_path, "m+x=1", 1, 12_500_000, ["niah_single"], 8192) == ["niah_single"]  # another seed
    r = subprocess.run([sys.executable, str(STUDY / "sessions.py"), "missing", str(tmp_path), "m+x=1", "2", "12.5M", ALL,
                        "8K"], capture_output=True, text=True)
    assert r.stdout.strip() == "niah_multivalue,variable_tracking"
    focus = ROOT / "experiments" / "fused-smollm2" / "focus"
    assert [s.kv_layers(focus, R) for R in (3, 7, 15, 31)] == [8, 4, 2, 1]  # round(30 / (R + 1)), at least 1
    gemma = ROOT / "experiments" / "anatomy-gemma3-270m" / "run"
    assert [s.kv_layers(gemma, R) for R in (3, 7, 15, 31)] == [4, 2, 1, 1]  # round(18 / (R + 1))


def test_collect_and_restore_carry_what_a_session_needs(tmp_path):
    """collect: the eval folder without prompt sets, HTML or a file being written (.NAME.PID.tmp), masks, rankings without tensors, each conversion's recipe
    and stage records without weights; a re-conversion's training.json replaces B's and keeps it as training.1.json.
    restore: eval, masks and rankings into W (no file replaced), the stage records only into B."""
    s = _sessions()
    w, b = tmp_path / "w", tmp_path / "b"
    files = {"eval/cells/m__s0__t1/niah_single.unseen.1024.json.gz": "c", "eval/retention.csv": "r",
             "eval/cells/m__s0__t1/.niah_single.unseen.2048.json.gz.77.tmp": "a cell being written",
             "eval/haystack/docs.json.gz": "h", "eval/prompts/unseen_x.json.gz": "p", "eval/report.html": "big",
             "masks/kv_7to1/headwise.json": "m", "rank/single/scores.csv": "s", "rank/single/ie.pt": "t",
             "rank/single/heatmap.html": "big", "seed0/a_t1/recipe.json": "{}", "seed0/a_t1/stage1/training.json": "v1",
             "seed0/a_t1/stage1/model.safetensors": "w", "seed0/a_t1/data/docs/shard_0.pt": "d",
             "seed0/a_t1/data/stage1_rows.json": "j"}
    for rel, text in files.items():
        (w / rel).parent.mkdir(parents=True, exist_ok=True)
        (w / rel).write_text(text)
    assert s.collect(w, tmp_path / "b_eval", eval_only=True) == 3  # a teacher's eval beside a conversion: eval/ alone
    assert s.collect(w, b) == 7
    got = sorted(str(p.relative_to(b)) for p in b.rglob("*") if p.is_file())
    assert got == sorted(["eval/cells/m__s0__t1/niah_single.unseen.1024.json.gz", "eval/retention.csv",
                          "eval/haystack/docs.json.gz", "masks/kv_7to1/headwise.json", "rank/single/scores.csv",
                          "seed0/a_t1/recipe.json", "seed0/a_t1/stage1/training.json"])
    assert s.collect(w, b) == 0  # nothing changed
    (w / "seed0/a_t1/stage1/training.json").write_text("v2")  # converted again
    (w / "eval/retention.csv").write_text("r2")
    assert s.collect(w, b) == 2
    assert (b / "seed0/a_t1/stage1/training.json").read_text() == "v2"
    assert (b / "seed0/a_t1/stage1/training.1.json").read_text() == "v1"
    assert (b / "eval/retention.csv").read_text() == "r2"
    w2, b2 = tmp_path / "w2", tmp_path / "b2"
    (w2 / "eval").mkdir(parents=True)
    (w2 / "eval" / "retention.csv").write_text("newer")
    assert s.restore(b, w2, records_to=b2) == 4 + 3
    assert (w2 / "eval" / "retention.csv").read_text() == "newer"  # W's file kept
    assert (w2 / "eval/haystack/docs.json.gz").read_text() == "h" and not (w2 / "seed0").exists()
    assert sorted(str(p.relative_to(b2)) for p in b2.rglob("*") if p.is_file()) == [
        "seed0/a_t1/recipe.json", "seed0/a_t1/stage1/training.1.json", "seed0/a_t1/stage1/training.json"]


def _eval_folder(root: Path, rows: list[tuple], cells: list[dict]) -> None:
    ev = root / "eval"
    ev.mkdir(parents=True, exist_ok=True)
    pd.DataFrame([dict(zip(["model", "seed", "tokens", "task", "formats", "length", "n", "hits", "accuracy",
                            "teacher_accuracy", "agreement"], r), source="cli") for r in rows])[list(EVAL_COLUMNS)].to_csv(
        ev / "retention.csv", index=False)
    for c in cells:
        d = ev / "cells" / f"{c['model']}__s{c['seed']}__t{c['tokens']}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"{c['task']}.{c['formats']}.{c['length']}.json.gz").write_bytes(gzip.compress(json.dumps(c).encode()))


def test_merge_keeps_other_eval_folders_rows(tmp_path):
    """merge (run.py keep --tag): rows of each eval folder under source cli:TAG, so two folders' teachers on the same cell
    are two rows; merging a folder again replaces its own rows, cells and stage records; the stage records carry the
    earlier conversions (training.N.json) beside the latest."""
    s = _sessions()
    rec = tmp_path / "records"
    rec.mkdir()
    cell = {"model": "teacher", "seed": 0, "tokens": 0, "task": "niah_single", "formats": "unseen", "length": 8192,
            "n": 2, "hits": 1, "correct": [1, 0]}
    a, b = tmp_path / "a", tmp_path / "b"
    _eval_folder(a, [("teacher", 0, 0, "niah_single", "unseen", 8192, 2, 1, 0.5, 0.5, 1.0),
                     ("x", 0, 5, "niah_single", "unseen", 8192, 2, 2, 1.0, 0.5, float("nan"))], [cell])
    _eval_folder(b, [("teacher", 0, 0, "niah_single", "unseen", 8192, 2, 2, 1.0, 1.0, 1.0)], [{**cell, "hits": 2,
                                                                                                  "correct": [1, 1]}])
    (a / "seed0" / "x_t5" / "stage3").mkdir(parents=True)
    (a / "seed0" / "x_t5" / "stage3" / "training.json").write_text(json.dumps({"stage": 3, "seconds": 2.0}))
    (a / "seed0" / "x_t5" / "stage3" / "training.1.json").write_text(json.dumps({"stage": 3, "seconds": 1.0}))
    assert "merged 2 rows, 1 cells and 2 stage records" in s.merge(a, rec, "smollm2-62")
    assert "merged 1 rows, 1 cells and 0 stage records" in s.merge(b, rec, None)
    df = pd.read_csv(rec / "cli_retention.csv")
    assert tuple(df.columns) == EVAL_COLUMNS and len(df) == 3
    t = df[df.model == "teacher"].set_index("source")
    assert t.loc["cli:smollm2-62", "hits"] == 1 and t.loc["cli", "hits"] == 2
    assert pd.isna(df[df.model == "x"].agreement.iloc[0])
    _eval_folder(a, [("teacher", 0, 0, "niah_single", "unseen", 8192, 2, 0, 0.0, 0.0, 1.0)], [{**cell, "hits": 0,
                                                                                                  "correct": [0, 0]}])
    s.merge(a, rec, "smollm2-62")
    df = pd.read_csv(rec / "cli_retention.csv")
    assert len(df) == 3 and df[(df.model == "teacher") & (df.source == "cli:smollm2-62")].hits.tolist() == [0]
    with gzip.open(rec / "cli_cells.jsonl.gz", "rt") as fh:
        cells = {(c["source"], c["model"]): c["correct"] for c in map(json.loads, fh)}
    assert cells == {("cli", "teacher"): [1, 1], ("cli:smollm2-62", "teacher"): [0, 0]}
    with gzip.open(rec / "cli_training.jsonl.gz", "rt") as fh:
        stages = sorted((r["run"], r["seconds"], r["source"]) for r in map(json.loads, fh))
    assert stages == [("seed0/x_t5", 1.0, "cli:smollm2-62"), ("seed0/x_t5", 2.0, "cli:smollm2-62")]
    with pytest.raises(SystemExit, match="retention.csv is not there"):
        s.merge(tmp_path / "none", rec)


def _tiny_env(tmp_path: Path) -> dict[str, str]:
    """A tiny random Llama teacher (4 layers x 4 heads, 2 KV heads) and a Gemma-like one (1 KV head per layer), a
    tiny ranking and default mask for them, and the recipe's knobs at tiny scale on CPU (sampled documents: 16 of 64
    tokens in two shards)."""
    import numpy as np

    from conftest import tiny_llama
    from headscope.masks import HeadMask
    from headscope.scores import Ranking
    from small_vocab import small_tokenizer

    tok = small_tokenizer()
    for name, kv in (("teacher", 2), ("gemma", 1)):
        tiny_llama(tok, seed=3, n_layers=4, n_heads=4, n_kv=kv).save_pretrained(tmp_path / name)
        tok.save_pretrained(tmp_path / name)
    HeadMask(4, 4, 2, ((1,), (0, 3), (2,), (1,))).to_json(tmp_path / "mask.json")
    rng = np.random.default_rng(0)
    Ranking(pd.DataFrame([{"layer": i, "head": h, "kv_group": h // 2, "score": float(rng.random())}
                          for i in range(4) for h in range(4)]),
            {"n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "d_head": 16, "d_model": 64, "n_ctx": 1024}).save(
        tmp_path / "ranking")
    return {"SMOL": str(tmp_path / "teacher"), "GEMMA": str(tmp_path / "gemma"), "DEFAULT_MASK": str(tmp_path / "mask.json"),
            "RANKING": str(tmp_path / "ranking"), "TOKENS": "3K", "N": "2", "GEN_N": "1", "WORKERS": "1", "LONG": "256",
            "BUDGET_LENGTHS": "256", "SUITE": "256", "MK_LONG": "256", "GEMMA_LENGTHS": "256", "GEMMA_KV": "1",
            "OMP_NUM_THREADS": "1", "COLLECT_S": "2", "RANK_SET": "--pairs 2 --seq-len 256", "RANK_ARGS": "--device cpu --min-gap 0",
            "CONVERT_ARGS": "--device cpu --seq-len 128 --long-len 256 --batch-size 2 --batch-long 2 --gdn-kernel torch "
                            "--docs 16 --doc-len 64 --sample-batch 8",
            "EVAL_ARGS": "--device cpu --corpus builtin"}


@pytest.mark.slow
def test_parts_run_and_resume_at_tiny_scale(tmp_path):
    """Each session runs two chains of parts side by side on one OUT, as a GPU session does. Session 1: long_s0 (the
    teacher's cells beside the conversion; the student samples seed 0's documents, packs them as soon as they exist,
    trains, and is scored length by length) | gemma_rank (the Gemma-like teacher ranked, masks within one layer's KV
    cache). Session 2, from session 1's returned folder: long_s0 does nothing, then the stage-3 lever part converts the
    default arm again for its stages 1-2 on the carried documents (the same SHA-256) and trains the s3tok2x arm's
    stage 3 on twice the tokens | the Gemma-like part converts with the carried mask (sampling its own documents) and
    scores with its teacher. Nothing returned is a weight, a prompt set or
    HTML; the merged rows carry source cli:TAG."""
    env = _tiny_env(tmp_path)
    o1 = tmp_path / "s1"
    # each session runs two chains side by side on one OUT, as a GPU session does: here long_s0 | gemma_rank
    (tmp_path / "logs1").mkdir()
    (rc, text), (rc_g, text_g) = _chains(o1, tmp_path / "logs1", ("long_s0",), ("gemma_rank",), **env)
    assert rc == 0 and rc_g == 0, text[-3000:] + text_g[-3000:]
    b1 = o1 / "bring"
    assert (b1 / "docs" / "smollm2_s0.tar.gz").exists()
    assert (b1 / "gemma3" / "rank" / "fused2" / "ranking.json").exists()  # the ranking and masks come back
    assert (b1 / "gemma3" / "masks" / "kv_L1" / "headwise.json").exists()
    cells = b1 / "smollm2" / "eval" / "cells"
    assert len(list((cells / "teacher__s0__t0").glob("*.json.gz"))) == 4
    assert len(list((cells / f"{LABEL}__s0__t3000").glob("*.json.gz"))) == 4
    o2 = tmp_path / "s2"
    # budget_s0_3 and levers_s0_masks (two conversions each) are left to their dry runs
    # (test_every_part_prints_its_package_commands): their steps are the Gemma part's (mask, convert on the carried
    # documents, score), and running them here cost ~100 s of CI's 10-minute suite
    # the SmolLM2 parts | the Gemma-like part, on the ranking and masks carried from session 1
    (tmp_path / "logs2").mkdir()
    (rc, text), (rc_g, text_g) = _chains(o2, tmp_path / "logs2", ("long_s0", "levers_s0_s3tok"), ("gemma_s0_head",),
                                          STATE=str(b1), **env)
    assert rc == 0 and rc_g == 0, text[-3000:] + text_g[-3000:]
    assert f"{LABEL} seed 0: every cell is there" in text
    assert "headscope.cli rank" not in text_g and "headscope.cli mask" not in text_g  # session 1's, carried
    b2 = o2 / "bring"
    assert not (b2 / "docs" / "smollm2_s0.tar.gz").exists() and (b2 / "docs" / "gemma3_s0.tar.gz").exists()
    sha = {json.loads(f.read_text())["data"]["docs_sha256"]
           for f in [*(b1 / "smollm2").glob("seed0/*/stage1/training.json"), *(b2 / "smollm2").glob("seed0/*/stage1/training.json")]}
    assert len(sha) == 1  # every SmolLM2 arm of seed 0, in both sessions, on the same documents
    runs = {p.parent.parent.name for p in (b2 / "smollm2").glob("seed0/*/stage3/training.json")}
    assert runs == {f"{LABEL}_t3000", f"{LABEL}+s3_tokens=2x_t3000"}
    s3 = {n: json.loads((b2 / "smollm2" / "seed0" / f"{n}_t3000" / "stage3" / "training.json").read_text())["tokens"]
          for n in (LABEL, f"{LABEL}+s3_tokens=2x")}
    assert s3[f"{LABEL}+s3_tokens=2x"] == 2 * s3[LABEL]
    assert (b2 / "smollm2" / "seed0" / f"{LABEL}_t3000" / "stage3" / "training.1.json").exists()  # the first session's
    g = b2 / "gemma3"
    assert json.loads((g / "masks" / "kv_L1" / "kv_budget.json").read_text())["arms"][0]["kv_cache_fraction"] == 0.25
    assert len(list((g / "eval" / "cells" / "gemma-headwise-kv1+s2_retrieval=0.25+s3_wordings=6__s0__t3000").glob("*"))) == 4
    back = [p for b in (b1, b2) for p in b.rglob("*") if p.is_file()]
    assert not [p for p in back if p.suffix in (".pt", ".safetensors", ".html") or "prompts" in p.parts]
    rec = tmp_path / "records"
    rec.mkdir()
    _sessions().merge(o2 / "bring" / "smollm2", rec, "tiny")
    df = pd.read_csv(rec / "cli_retention.csv")
    assert set(df.source) == {"cli:tiny"} and {"teacher", f"{LABEL}+s3_tokens=2x"} <= set(df.model)
