"""Retrieval formats kept apart (headscope.tasks.formats), training rows in the training family
(headscope.train.format_rows), the seen/unseen retention suite (headscope.train.retention) and the
study script experiments/conversion-generalization/run.py."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import tiny_llama
from headscope.tasks import make_pairs
from headscope.tasks.formats import (
    FAMILIES,
    FORMAT_TASKS,
    filler_ngrams,
    format_pairs,
    natural_filler,
    ngrams,
    wording_ngrams,
    words,
)
from headscope.train import format_rows
from headscope.train.retention import (
    RETENTION_COLUMNS,
    SuiteConfig,
    evaluate_suite,
    greedy_generation_hits,
    ratio_interval,
    retention_table,
    suite_pairs,
)

ROOT = Path(__file__).resolve().parents[1]

TEXTS = [
    "The old mill stood by the river for many years. Children played near it every summer. "
    "A farmer walked to town and bought bread. The market was busy that day. Rain fell in the evening.",
    "What is the special magic number for apple? Recall the reference ID that was mentioned. "
    "The access key is hidden somewhere. It was late when the boat came back. There were 12 boats.",
    "She opened the window and looked at the hills. A dog barked far away. The kettle began to sing. "
    "Nobody knew where the path would lead. The lanterns were lit one by one.",
]


def test_families_disjoint_by_construction():
    train3 = wording_ngrams("train", 3)
    assert ("special", "magic", "number") in wording_ngrams("seen", 3)  # the registry finds real phrases
    assert ("the", "secret", "code") in wording_ngrams("unseen", 3)
    assert ("reference", "id", "of") in train3
    for fam in ("seen", "unseen"):
        assert train3 & wording_ngrams(fam, 3) == set(), fam
        assert set(FAMILIES["train"].keys) & set(FAMILIES[fam].keys) == set()
        assert set(FAMILIES["train"].var_names) & set(FAMILIES[fam].var_names) == set()
    assert train3 & filler_ngrams(3) == set()
    # the unseen family is also apart from the seen one (its cells test formats no training row of any kind had)
    assert wording_ngrams("unseen", 3) & wording_ngrams("seen", 3) == set()
    assert all(len(FAMILIES[f].wordings[t]) == 3 for f in ("unseen", "train") for t in FORMAT_TASKS)


def test_wording_ngrams_by_hand():
    assert words("Recall the PIN, 4821!") == ["recall", "the", "pin"]
    assert ngrams(["a", "b", "c", "d"], 3) == {("a", "b", "c"), ("b", "c", "d")}


def test_seen_registry_matches_generators(smol_tokenizer):
    """Every wording n-gram of the seen registry occurs in the prompts of headscope's RULER generators."""
    for task in FORMAT_TASKS:
        p = make_pairs(task, smol_tokenizer, n_pairs=1, seq_len=256, depth=0.5, seed=3)[0]
        got = ngrams(words(smol_tokenizer.decode(p.clean)), 3)
        missing = wording_ngrams("seen", 3, tasks=[task]) - got
        assert not missing, (task, sorted(missing)[:5])


def test_natural_filler_drops_wording_and_digits():
    f = natural_filler(TEXTS, "unseen", "t")
    assert "What is the special magic number for apple?" not in f.sentences  # a seen wording 4-gram
    assert "Recall the reference ID that was mentioned." not in f.sentences  # a training wording 4-gram
    assert "There were 12 boats." not in f.sentences  # digits
    assert "The access key is hidden somewhere." not in f.sentences  # "the access key is": an unseen needle's 4-gram
    assert "The old mill stood by the river for many years." in f.sentences
    assert len(f.sentences) == 15 - 4


@pytest.mark.parametrize("family", ["unseen", "train"])
def test_format_pairs_every_task(smol_tokenizer, family):
    filler = natural_filler(TEXTS, family, "t")
    for task in FORMAT_TASKS:
        pairs = format_pairs(smol_tokenizer, family, task, filler, n_pairs=3, seq_len=256, depth=[0.0, 0.5, 1.0], seed=5)
        assert [p.meta["wording"] for p in pairs] == [0, 1, 2]
        for p in pairs:
            w = FAMILIES[family].wordings[task][p.meta["wording"]]
            text = smol_tokenizer.decode(p.clean)
            assert p.length <= 256 and p.length > 150
            assert smol_tokenizer.decode(p.answer).strip() == p.meta["value"]
            assert w.intro in text
            q_fixed = w.question.split("{")[0]
            assert q_fixed in text
            ev = smol_tokenizer.decode(p.clean[p.evidence[0]:p.evidence[1]]).strip()
            assert ev == p.meta["value"] if task != "variable_tracking" else ev == p.meta["evidence_value"]
            assert not (ngrams(words(text), 3) & wording_ngrams("train" if family == "unseen" else "seen", 3))


def test_format_rows_share_no_eval_wording(smol_tokenizer):
    rows = format_rows(smol_tokenizer, 8, 320, TEXTS, family="train", seed=2, lengths=[200, 300])
    assert rows.ids.shape == (8, 320)
    eval4 = wording_ngrams("seen", 4) | wording_ngrams("unseen", 4) | filler_ngrams(4)
    train3 = wording_ngrams("train", 3)
    eval_keys = {w.lower() for f in ("seen", "unseen") for w in (*FAMILIES[f].keys, *FAMILIES[f].var_names)}
    for r, m in zip(rows.ids, rows.mask):
        text = smol_tokenizer.decode(r[m])
        g4, g3 = ngrams(words(text), 4), ngrams(words(text), 3)
        assert not g4 & eval4
        assert g3 & train3  # a training wording is there
        # the keys / variables the rows query are the training family's (natural text may hold e.g. "river")
        question = words(text.rsplit("\n", 1)[1])
        assert not set(question) & eval_keys
        assert int(m.sum()) <= 300 + 8


def test_ratio_interval_by_hand():
    r, lo, hi = ratio_interval([1, 1, 0, 0] * 25, [1, 1, 1, 1] * 25, n_boot=500)
    assert r == 0.5 and 0.35 < lo < 0.5 < hi < 0.65
    assert all(math.isnan(v) for v in ratio_interval([1, 0], [0, 0]))
    r, lo, hi = ratio_interval([1, 1, 1, 1], [1, 1, 1, 1])
    assert (r, lo, hi) == (1.0, 1.0, 1.0)


def _cell(model, seed, tokens, correct, task="niah_single", fmt="unseen", L=1024):
    return {"model": model, "seed": seed, "tokens": tokens, "task": task, "formats": fmt, "length": L, "n": len(correct),
            "hits": int(sum(correct)), "accuracy": sum(correct) / len(correct), "correct": list(correct), "gen_n": 2,
            "gen_exact_hits": 1, "gen_text_hits": 1, "gen_agree": 2}


def test_retention_table_by_hand(tmp_path):
    import pandas as pd

    cells = {"teacher__s0__t0": _cell("teacher", 0, 0, [1] * 8 + [0] * 2),
             "hydra-7to1__s0__t50000000": _cell("hydra-7to1", 0, 50_000_000, [1] * 6 + [0] * 4),
             "hydra-7to1__s1__t50000000": _cell("hydra-7to1", 1, 50_000_000, [1] * 4 + [0] * 6)}
    for d, c in cells.items():
        (tmp_path / "cells" / d).mkdir(parents=True)
        (tmp_path / "cells" / d / "niah_single.unseen.1024.json").write_text(json.dumps(c))
    r = retention_table(tmp_path / "cells", tmp_path, n_boot=200)
    assert r == {"rows": 3, "missing_teacher": 0}
    df = pd.read_csv(tmp_path / "retention.csv")
    assert tuple(df.columns) == RETENTION_COLUMNS
    h = df[df.model == "hydra-7to1"].sort_values("seed")
    assert h.accuracy.tolist() == [0.6, 0.4] and h.teacher_accuracy.tolist() == [0.8, 0.8] and h.hits.tolist() == [6, 4]
    sm = pd.read_csv(tmp_path / "retention_summary.csv")
    s0 = sm[(sm.model == "hydra-7to1") & (sm.seed == 0)].iloc[0]
    assert s0.retention == pytest.approx(0.75) and s0.retention_lo <= 0.75 <= s0.retention_hi
    from scipy.stats import binomtest

    ci = binomtest(6, 10).proportion_ci(method="wilson")
    assert (s0.accuracy_lo, s0.accuracy_hi) == pytest.approx((ci.low, ci.high))
    sd = pd.read_csv(tmp_path / "retention_seeds.csv")
    h = sd[sd.model == "hydra-7to1"].iloc[0]
    assert h.n_seeds == 2 and h.retention_mean == pytest.approx(0.625)
    assert h.retention_sd == pytest.approx(np.std([0.75, 0.5], ddof=1))


def test_suite_config_refuses_bad_cells():
    from headscope.errors import HeadscopeInputError

    with pytest.raises(HeadscopeInputError, match="formats"):
        SuiteConfig(formats=("other",))
    with pytest.raises(HeadscopeInputError, match="tasks"):
        SuiteConfig(tasks=("induction",))
    with pytest.raises(HeadscopeInputError, match="haystack"):
        suite_pairs(None, SuiteConfig(n=2), "niah_single", "unseen", 256)


@pytest.mark.slow
def test_evaluate_suite_scores_and_resumes(smol_tokenizer, tmp_path, monkeypatch):
    """Teacher-forced hits equal a per-prompt brute force (argmax at each answer position of prompt ⊕ answer),
    greedy generation agrees with them, and a rerun reads the stored cells."""
    model = tiny_llama(smol_tokenizer, seed=4, n_layers=1, n_heads=2, n_kv=1, d_model=32)
    cfg = SuiteConfig(tasks=("niah_single", "variable_tracking"), lengths=(256,), n=3, gen_n=2, gen_max_len=256)
    filler = natural_filler(TEXTS, "unseen", "t")
    res = evaluate_suite(model, smol_tokenizer, "tiny", 0, 0, cfg, tmp_path / "cells", filler=filler, cache_dir=tmp_path / "p",
                         log=lambda s: None)
    assert res == {"done": 4, "left": 0}
    for task, fmt, L in cfg.cells():
        rec = json.loads((tmp_path / "cells" / "tiny__s0__t0" / f"{task}.{fmt}.{L}.json").read_text())
        pairs = suite_pairs(smol_tokenizer, cfg, task, fmt, L, filler, tmp_path / "p")
        brute = []
        for p in pairs:
            with torch.no_grad():
                lg = model(torch.cat([p.clean, p.answer[:-1]])[None]).logits[0]
            brute.append(int(all(int(lg[p.length - 1 + j].argmax()) == int(p.answer[j]) for j in range(p.n_answer))))
        assert rec["correct"] == brute and rec["hits"] == sum(brute)
        g = greedy_generation_hits(model, smol_tokenizer, pairs[:2])
        assert [int(x) for x in g["exact"]] == brute[:2] and rec["gen_agree"] == 2
    import headscope.train.retention as R

    monkeypatch.setattr(R, "retrieval_hits", lambda *a, **k: (_ for _ in ()).throw(AssertionError("recomputed")))
    assert evaluate_suite(model, smol_tokenizer, "tiny", 0, 0, cfg, tmp_path / "cells", filler=filler,
                          cache_dir=tmp_path / "p", log=lambda s: None) == {"done": 4, "left": 0}


@pytest.mark.slow
def test_study_smoke(tmp_path):
    """run.py --smoke: every piece (suite, data, train, eval of one arm and the teacher, report, anatomy) on a tiny
    model."""
    out = tmp_path / "smoke"
    r = subprocess.run([sys.executable, str(ROOT / "experiments" / "conversion-generalization" / "run.py"), "--smoke",
                        "--out", str(out)], capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    import pandas as pd

    df = pd.read_csv(out / "retention.csv")
    assert tuple(df.columns) == RETENTION_COLUMNS
    assert set(df.model) == {"hydra-7to1", "teacher"} and set(df.formats) == {"seen", "unseen"}
    assert len(df) == 2 * 4 * 2 and (df.n == 2).all()
    t = df[df.model == "teacher"]
    assert (t.accuracy == t.teacher_accuracy).all()
    m = json.loads((out / "manifest.json").read_text())
    assert {"commit", "hardware", "commands", "seeds", "data"} <= set(m) and m["seeds"] == [0]
    assert len(m["data"]["seed0"]["docs_sha256"]) == 64 and "suite_docs_sha256" in m["data"]
    info = json.loads((out / "seed0" / "data" / "info.json").read_text())
    assert info["long_retrieval_rows"] >= 4
    # the training rows carry no evaluation wording (4-grams), scanned on the stored rows
    from headscope.train import TokenRows
    from transformers import AutoTokenizer  # noqa: F401  (the tokenizer comes with the smoke settings)

    rows = TokenRows.load(out / "seed0" / "data" / "long.pt")
    assert rows.ids.shape[1] == 256
    # the anatomy piece: both rankings, the comparison, the knockout table; a rerun computes only what is missing
    d = out / "anatomy" / "unseen_niah_single@256_p2_gap0" / "seed0_hydra-7to1_t1"
    res = json.loads((d / "anatomy.json").read_text())
    assert res["done"] and res["teacher"]["path"] == "fast" and res["student"]["path"] == "hybrid"
    assert res["student"]["kinds"]["fa"]["n_heads"] == 2 and res["student"]["kinds"]["gdn"]["n_heads"] == 14
    assert set(res["comparison"]) == {"top2", "top10"} and res["comparison"]["top2"]["k"] == 2
    heads = pd.read_csv(d / "heads.csv")
    assert len(heads) == 16 and set(heads["kind"]) == {"fa", "gdn"} and heads["ie_student"].notna().all()
    ko = pd.read_csv(d / "knockout.csv")
    want = {f"student/{m}/{c}" for m in ("zero", "mean") for c in ("fa", "gdn_random0", "student_top")}
    want |= {"student/zero/none", "teacher/zero/none"} | {f"teacher/{m}/{c}" for m in ("zero", "mean") for c in ("fa", "gdn")}
    assert set(ko["model"] + "/" + ko["method"] + "/" + ko["condition"]) == want
    assert (ko.loc[ko.condition == "fa", "n_heads"] == 2).all() and (ko.n == 2).all()
    del res["knockout"]["student/mean/fa"]
    res["done"] = False
    (d / "anatomy.json").write_text(json.dumps(res))
    r = subprocess.run([sys.executable, str(ROOT / "experiments" / "conversion-generalization" / "run.py"), "--smoke",
                        "--out", str(out)], capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("anatomy knockout")]
    assert len(lines) == 1 and lines[0].startswith("anatomy knockout student/mean/fa:")
    assert json.loads((d / "anatomy.json").read_text())["done"]


def _study():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gen_study", ROOT / "experiments" / "conversion-generalization" / "run.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_study_settings_frozen_and_token_split(tmp_path):
    run = _study()
    a = run.parser().parse_args(["--out", str(tmp_path), "--n", "50", "--lengths", "1024", "4096"])
    s = run.settings(a)
    assert s["suite"]["n"] == 50 and s["suite"]["lengths"] == [1024, 4096]
    # a later command that leaves the options at their defaults reads the stored settings
    assert run.settings(run.parser().parse_args(["--out", str(tmp_path)]))["suite"]["n"] == 50
    with pytest.raises(SystemExit, match="suite.n"):
        run.settings(run.parser().parse_args(["--out", str(tmp_path), "--n", "70"]))
    assert run.parse_tokens("50M") == 50_000_000 and run.parse_tokens("1.5e6") == 1_500_000
    # 50M tokens at 64 x 512 (stages 1, 2) and 16 x 2048 (stage 3): whole steps of 32,768 tokens, shares 15/55/30 %
    assert run.stage_tokens(s, 50_000_000) == [229 * 32768, 839 * 32768, 458 * 32768]
