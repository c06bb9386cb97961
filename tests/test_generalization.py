"""Retrieval formats kept apart (headscope.tasks.formats), training rows in the training family
(headscope.train.format_rows), the seen/unseen retention suite (headscope.evaluation.retention) and the
study's tables (experiments/conversion-generalization/tables.py) and committed masks."""

from __future__ import annotations

import json
import math
import re
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
from headscope.evaluation.retention import (
    EVAL_COLUMNS,
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
    assert all(len(FAMILIES["unseen"].wordings[t]) == 3 and len(FAMILIES["train"].wordings[t]) == 6 for t in FORMAT_TASKS)
    # the first three train wordings are the original family's (the study's stage-3 rows use them)
    first = [FAMILIES["train"].wordings["niah_single"][k].needle for k in range(3)]
    assert first == ["[serial number: {value}]", "Reference ID {value} is mentioned here.", "Account number on file: {value}."]
    assert FAMILIES["train"].wordings["variable_tracking"][2].hop == "Account {var} holds the same balance as account {prev}."


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


def _wording_grams(n: int = 3) -> dict[int, set]:
    """Word n-grams of train wording k (over every task) that no other train wording has."""
    fam = FAMILIES["train"]
    per = {}
    for k in range(6):
        g = set()
        for t in FORMAT_TASKS:
            w = fam.wordings[t][k]
            for text in w.texts():
                for seg in re.split(r"\{(?:value|key|var|prev)\}", text):
                    g |= ngrams(words(seg), n)
        per[k] = g
    return {k: g - set().union(*(per[j] for j in per if j != k)) for k, g in per.items()}


@pytest.mark.parametrize("n_wordings", [1, 2, 3, 4, 5, 6])
def test_format_rows_wording_diversity_stays_in_train_family(smol_tokenizer, n_wordings):
    """Under every value of the stage-3 template-diversity lever (and in stage-2-style rows of one
    length) the rows carry no evaluation wording, filler 4-gram or evaluation key, and use exactly the
    first ``n_wordings`` train wordings."""
    eval4 = wording_ngrams("seen", 4) | wording_ngrams("unseen", 4) | filler_ngrams(4)
    eval_keys = {w for f in ("seen", "unseen") for w in (*FAMILIES[f].keys, *FAMILIES[f].var_names)}  # as written (seen: A, B, ...)
    own = _wording_grams()
    assert all(own[k] for k in own)  # every wording is recognizable
    used = set()
    for lengths in ([200, 300], [312]):
        rows = format_rows(smol_tokenizer, 24, 320, TEXTS, family="train", seed=2, lengths=lengths, n_wordings=n_wordings)
        for r, m in zip(rows.ids, rows.mask):
            text = smol_tokenizer.decode(r[m])
            g3 = ngrams(words(text), 3)
            assert not ngrams(words(text), 4) & eval4
            assert not set(re.findall(r"[A-Za-z]+", text.rsplit("\n", 1)[1])) & eval_keys  # the question queries train keys
            hit = {k for k, g in own.items() if g3 & g}
            assert len(hit) == 1, hit  # one wording per row
            used |= hit
    assert used == set(range(n_wordings))  # 6 rows per task cycle through all the wordings drawn from


def test_format_rows_three_wordings_are_the_original_rows(smol_tokenizer, monkeypatch):
    """n_wordings=3 gives the rows the train family of three wordings gave (the study's data is unchanged
    by the added wordings: the same draws, and the same haystack on these texts)."""
    from headscope.tasks import formats

    now = format_rows(smol_tokenizer, 12, 320, TEXTS, family="train", seed=4, lengths=[200, 300], n_wordings=3)
    fam = formats.FAMILIES["train"]
    old = formats.Family("train", {t: w[:3] for t, w in fam.wordings.items()}, fam.keys, fam.var_names)
    monkeypatch.setitem(formats.FAMILIES, "train", old)
    before = format_rows(smol_tokenizer, 12, 320, TEXTS, family="train", seed=4, lengths=[200, 300])
    assert torch.equal(now.ids, before.ids) and torch.equal(now.mask, before.mask)


def test_format_pairs_refuses_wording_counts(smol_tokenizer):
    from headscope.errors import HeadscopeInputError

    filler = natural_filler(TEXTS, "train", "t")
    for k in (0, 7):
        with pytest.raises(HeadscopeInputError, match="n_wordings"):
            format_pairs(smol_tokenizer, "train", "niah_single", filler, n_pairs=2, seq_len=256, n_wordings=k)
    pairs = format_pairs(smol_tokenizer, "train", "niah_single", filler, n_pairs=4, seq_len=256, seed=1, n_wordings=2)
    assert [p.meta["wording"] for p in pairs] == [0, 1, 0, 1]


def test_ratio_interval_by_hand():
    r, lo, hi = ratio_interval([1, 1, 0, 0] * 25, [1, 1, 1, 1] * 25, n_boot=500)
    assert r == 0.5 and 0.35 < lo < 0.5 < hi < 0.65
    assert all(math.isnan(v) for v in ratio_interval([1, 0], [0, 0]))
    r, lo, hi = ratio_interval([1, 1, 1, 1], [1, 1, 1, 1])
    assert (r, lo, hi) == (1.0, 1.0, 1.0)


def _cell(model, seed, tokens, correct, task="niah_single", fmt="unseen", L=1024):
    return {"model": model, "seed": seed, "tokens": tokens, "task": task, "formats": fmt, "length": L, "n": len(correct),
            "hits": int(sum(correct)), "correct": list(correct), "gen_n": 2,
            "accuracy": float(np.float32(sum(correct) / len(correct))),  # as evaluate_suite stores it (a float32 mean)
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
    # hits / n exactly (not the stored float32 mean, 0.6000000238418579)
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
        assert rec["prompt_len"] == [int(p.clean.numel()) for p in pairs]
        assert rec["evidence_distance"] == [int(p.clean.numel()) - p.evidence[1] for p in pairs]
        assert all(0 < d < L for d, L in zip(rec["evidence_distance"], rec["prompt_len"]))
        parts = (rec["prompt_seconds"], rec["score_seconds"], rec["gen_seconds"])  # the cell's time, split
        assert min(parts) >= 0 and abs(sum(parts) - rec["seconds"]) <= 0.03
        g = greedy_generation_hits(model, smol_tokenizer, pairs[:2])
        assert [int(x) for x in g["exact"]] == brute[:2] and rec["gen_agree"] == 2
    import headscope.evaluation.retention as R

    monkeypatch.setattr(R, "retrieval_hits", lambda *a, **k: (_ for _ in ()).throw(AssertionError("recomputed")))
    assert evaluate_suite(model, smol_tokenizer, "tiny", 0, 0, cfg, tmp_path / "cells", filler=filler,
                          cache_dir=tmp_path / "p", log=lambda s: None) == {"done": 4, "left": 0}


def test_evaluate_suite_reuses_cells_of_a_wider_suite(smol_tokenizer, tmp_path, monkeypatch):
    """A cell is identified by what its prompts and scores depend on, not by the suite's other cells: an eval of one
    task after an eval of two reads the stored cell (seen on the GPU: a student's eval of two tasks scored its
    teacher's four-task cells again). A cell of another n is scored again."""
    import headscope.evaluation.retention as R

    model = tiny_llama(smol_tokenizer, seed=4, n_layers=1, n_heads=2, n_kv=1, d_model=32)
    filler = natural_filler(TEXTS, "unseen", "t")
    wide = SuiteConfig(tasks=("niah_single", "variable_tracking"), lengths=(256,), formats=("unseen",), n=2, gen_n=0)
    kw = dict(filler=filler, cache_dir=tmp_path / "p", log=lambda s: None)
    assert evaluate_suite(model, smol_tokenizer, "tiny", 0, 0, wide, tmp_path / "cells", **kw) == {"done": 2, "left": 0}
    f = tmp_path / "cells" / "tiny__s0__t0" / "niah_single.unseen.256.json"
    before = f.read_text()
    calls = []
    real = R.retrieval_hits
    monkeypatch.setattr(R, "retrieval_hits", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    narrow = SuiteConfig(tasks=("niah_single",), lengths=(256,), formats=("unseen",), n=2, gen_n=0)
    assert evaluate_suite(model, smol_tokenizer, "tiny", 0, 0, narrow, tmp_path / "cells", **kw) == {"done": 1, "left": 0}
    assert calls == [] and f.read_text() == before
    other_n = SuiteConfig(tasks=("niah_single",), lengths=(256,), formats=("unseen",), n=3, gen_n=0)
    evaluate_suite(model, smol_tokenizer, "tiny", 0, 0, other_n, tmp_path / "cells", **kw)
    assert calls == [1] and json.loads(f.read_text())["n"] == 3


def test_study_committed_masks_are_the_rankings_selections():
    """The study's arms' masks (records/masks/): hydra-7to1 is the 50M study's HydraHead mask (the one the
    package's benchmarks use), the fused ranking `experiments/fused-smollm2/focus` selects exactly it at 7:1 with
    >= 1 FA head per layer; ie-7to1 is the kappa = 1 ranking's selection, which keeps the teacher's top unseen
    single-needle head L16H0 that HydraHead's focus factor leaves out; hydra-5to1 holds hydra-7to1's 34 heads and 11
    more."""
    from headscope.masks import HeadMask
    from headscope.scores import Ranking

    masks = ROOT / "experiments" / "conversion-generalization" / "records" / "masks"
    hydra = HeadMask.from_json(masks / "hydra-7to1.json")
    assert hydra == HeadMask.from_json(ROOT / "experiments" / "conversion-smollm2-50m" / "masks" / "hydrahead.json")
    assert (hydra.n_layers, hydra.n_heads, hydra.n_kv_heads) == (30, 9, 3) and sum(map(len, hydra.fa_heads)) == 34
    focus = Ranking.load(ROOT / "experiments" / "fused-smollm2" / "focus").matrix("score")
    assert HeadMask.select(focus, "7:1", 3, min_per_layer=1) == hydra
    ie = HeadMask.from_json(masks / "ie-7to1.json")
    one = Ranking.load(ROOT / "experiments" / "fused-smollm2" / "one").matrix("score")
    assert ie == HeadMask.select(one, "7:1", 3, min_per_layer=1) and sum(map(len, ie.fa_heads)) == 34
    assert 0 in ie.fa_heads[16] and 0 not in hydra.fa_heads[16]
    h5 = HeadMask.from_json(masks / "hydra-5to1.json")
    heads = {(l, h) for l, hs in enumerate(h5.fa_heads) for h in hs}
    assert len(heads) == 45 and {(l, h) for l, hs in enumerate(hydra.fa_heads) for h in hs} <= heads


def _tables():
    """experiments/conversion-generalization/tables.py (the study's tables from its records)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gen_tables", ROOT / "experiments" / "conversion-generalization" / "tables.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_study_lever_table_by_hand(tmp_path):
    import pandas as pd

    rows = []

    def add(model, seed, tokens, acc, teacher, task="niah_single", fmt="unseen", lengths=(1024, 2048, 4096)):
        for L in lengths:
            rows.append({"model": model, "seed": seed, "tokens": tokens, "task": task, "formats": fmt, "length": L, "n": 100,
                         "hits": round(acc * 100), "accuracy": acc, "teacher_accuracy": teacher})

    add("teacher", 0, 0, 1.0, 1.0)
    add("hydra-7to1", 0, 50_000_000, 0.6, 0.8)
    add("hydra-7to1", 1, 50_000_000, 0.4, 0.8)
    add("hydra-7to1", 0, 200_000_000, 0.72, 0.8)
    add("hydra-7to1+fa_pos=rope", 0, 50_000_000, 0.2, 0.0)  # teacher without a hit: no retention
    add("hydra-5to1", 0, 50_000_000, 0.7, 0.8)
    add("layer-3to1+s3_wordings=6", 0, 50_000_000, 0.1, 0.8)
    add("hydra-7to1", 0, 50_000_000, 0.0, 0.8, fmt="seen")  # other cells are not in the table
    add("hydra-7to1", 0, 50_000_000, 0.0, 0.8, task="niah_multikey")
    add("hydra-7to1", 0, 50_000_000, 0.0, 0.8, lengths=(8192,))
    pd.DataFrame(rows, columns=list(RETENTION_COLUMNS)).to_csv(tmp_path / "retention.csv", index=False)
    assert _tables().lever_table(tmp_path) == 5
    t = pd.read_csv(tmp_path / "levers.csv")
    got = {r.model + "@" + str(r.tokens): r for r in t.itertuples()}
    b = got["hydra-7to1@50000000"]
    assert (b.lever, b.seeds, b.command) == ("baseline", 2, "--arm hydra-7to1 --tokens 50M")
    assert b.retention_1024 == pytest.approx(0.625) and (b.retention_1024_min, b.retention_1024_max) == pytest.approx((0.5, 0.75))
    assert got["hydra-7to1@200000000"].lever == "tokens 200M" and got["hydra-7to1@200000000"].retention_4096 == pytest.approx(0.9)
    r = got["hydra-7to1+fa_pos=rope@50000000"]
    assert r.lever == "fa_pos=rope" and r.command == "--arm hydra-7to1 --tokens 50M --fa-pos rope" and math.isnan(r.retention_2048)
    assert got["hydra-5to1@50000000"].lever == "budget 5:1" and got["hydra-5to1@50000000"].retention_1024 == pytest.approx(0.875)
    lw = got["layer-3to1+s3_wordings=6@50000000"]
    assert lw.lever == "s3_wordings=6" and lw.command == "--arm layer-3to1 --tokens 50M --s3-wordings 6"
    assert t.model.tolist()[0] == "hydra-7to1" and t.model.tolist()[-1] == "hydra-5to1"  # arms in study order
    md = (tmp_path / "levers.md").read_text().splitlines()
    assert md[0] == "| lever | arm command | tokens | unseen single 1K | unseen single 2K | unseen single 4K | seeds |"
    assert md[2] == "| baseline | `--arm hydra-7to1 --tokens 50M` | 50M | 0.62 (0.50–0.75) | 0.62 (0.50–0.75) | 0.62 (0.50–0.75) | 2 |"


def test_evaluate_suite_scores_the_chosen_cells_in_order(tmp_path, monkeypatch):
    """cells= scores exactly those cells in that order (a short session scores the unseen cells first); a cell the
    suite does not have is refused before anything is scored. Scoring itself is stubbed: the order is under test."""
    import headscope.evaluation.retention as R
    from headscope.errors import HeadscopeInputError

    cfg = SuiteConfig(lengths=(1024, 2048, 4096), n=2, gen_n=0)
    order = []

    class P:
        length = 10
        evidence = (4, 6)

    monkeypatch.setattr(R, "suite_pairs", lambda tok, c, task, fmt, L, *a, **k: order.append((task, fmt, L)) or [P()] * 3)
    monkeypatch.setattr(R, "retrieval_hits", lambda *a, **k: torch.tensor([True, False, False]))

    class Tok:
        pad_token_id = 0

    class Model:
        def eval(self):
            return self

    chosen = [(t, "unseen", L) for L in (1024, 2048) for t in cfg.tasks] + [("niah_single", "seen", 1024)]
    res = R.evaluate_suite(Model(), Tok(), "m", 0, 0, cfg, tmp_path, cells=chosen, log=lambda s: None)
    assert order == chosen and res == {"done": 9, "left": 0}
    stored = sorted(f.name for f in (tmp_path / "m__s0__t0").glob("*.json"))
    assert stored == sorted(f"{t}.{f}.{L}.json" for t, f, L in chosen)
    rec = json.loads((tmp_path / "m__s0__t0" / "niah_single.unseen.2048.json").read_text())
    assert rec["hits"] == 1 and rec["n"] == 3 and rec["accuracy"] == 1 / 3  # hits / n, not a float32 mean
    order.clear()
    with pytest.raises(HeadscopeInputError, match=r"not cells of the suite"):
        R.evaluate_suite(Model(), Tok(), "m", 0, 0, cfg, tmp_path, cells=[("niah_single", "unseen", 8192)])
    assert order == []


def test_greedy_generation_batches_equal_lengths_like_one_at_a_time(smol_tokenizer):
    """Prompts of equal length generate together (at most 2 rows per forward here, prompts of several lengths
    interleaved): the tokens, the checks and their order equal a one-prompt-at-a-time greedy loop written here (the
    brute force), and the forwards carry the rows the grouping says."""
    model = tiny_llama(smol_tokenizer, seed=5, n_layers=1, n_heads=2, n_kv=1, d_model=32).double()
    cfg = SuiteConfig(tasks=("niah_single",), lengths=(128, 256), n=3, gen_n=3)
    short = suite_pairs(smol_tokenizer, cfg, "niah_single", "seen", 128)
    long_ = suite_pairs(smol_tokenizer, cfg, "niah_single", "seen", 256)
    pairs = [long_[0], short[0], long_[1], short[1], long_[2], short[2]]
    import collections

    counts = collections.Counter(p.clean.shape[-1] for p in pairs)
    assert len(counts) >= 2 and max(counts.values()) >= 2  # several groups, one of them batched
    calls = []
    h = model.register_forward_hook(lambda m, a, k, out: calls.append(k["input_ids"].shape[0]), with_kwargs=True)
    got = greedy_generation_hits(model, smol_tokenizer, pairs, extra=2, batch_tokens=600)  # <= 2 rows of ~250 + 6
    h.remove()
    steps = pairs[0].n_answer + 2
    groups = {}
    for p in pairs:
        groups.setdefault((p.clean.shape[-1], p.n_answer), []).append(p)
    rows = {L: max(1, 600 // (L + n + 2)) for L, n in groups}
    assert sorted(calls) == sorted(b for (L, n), g in groups.items() for k in range(0, len(g), rows[L])
                                   for b in [min(rows[L], len(g) - k)] * steps)
    assert max(calls) >= 2  # some forwards carried several prompts
    want = []
    for p in pairs:
        ids = p.clean[None]
        for _ in range(p.n_answer + 2):
            with torch.no_grad():
                t = int(model(input_ids=ids, use_cache=False).logits[0, -1].argmax())
            ids = torch.cat([ids, torch.tensor([[t]])], 1)
        want.append(ids[0, p.clean.shape[-1]:].tolist())
    assert got["outputs"] == [smol_tokenizer.decode(w, skip_special_tokens=True) for w in want]
    assert got["exact"] == [w[: p.n_answer] == p.answer.tolist() for w, p in zip(want, pairs)]


def test_depth_table_by_hand(tmp_path):
    import pandas as pd

    from headscope.evaluation.retention import DEPTH_COLUMNS, depth_table

    # 10 prompts at linspace(0, 1, 10): 5 bins of width 0.2 hold prompts {0,1} {2,3} {4,5} {6,7} {8,9} (depth 1.0 in the last)
    cells = {"teacher__s0__t0": _cell("teacher", 0, 0, [1] * 9 + [0]),
             "hydra-7to1__s0__t50000000": _cell("hydra-7to1", 0, 50_000_000, [0, 0, 1, 0, 1, 1, 1, 1, 1, 1])}
    cells["hydra-7to1__s0__t50000000"]["mean_len"] = 1000.0
    for d, c in cells.items():
        (tmp_path / "cells" / d).mkdir(parents=True)
        (tmp_path / "cells" / d / "niah_single.unseen.1024.json").write_text(json.dumps(c))
    assert depth_table(tmp_path / "cells", tmp_path) == 10
    df = pd.read_csv(tmp_path / "retention_depth.csv")
    assert tuple(df.columns) == DEPTH_COLUMNS
    h = df[df.model == "hydra-7to1"]
    assert h.hits.tolist() == [0, 1, 2, 2, 2] and h.n.tolist() == [2] * 5
    assert h.teacher_hits.tolist() == [2, 2, 2, 2, 1] and h.teacher_accuracy.tolist() == [1, 1, 1, 1, 0.5]
    assert h.depth_lo.tolist() == pytest.approx([0, 0.2, 0.4, 0.6, 0.8])
    assert h.distance_tokens.tolist() == [900, 700, 500, 300, 100]  # (1 - bin middle) x mean_len
    assert df[df.model == "teacher"].distance_tokens.tolist()[0] == 922  # no mean_len: the cell's length, 0.9 x 1024
    with pytest.raises(ValueError, match="bin"):
        depth_table(tmp_path / "cells", tmp_path, bins=0)


def test_distance_table_by_hand(tmp_path):
    """retention_distance.csv: prompts binned by their stored evidence_distance; a cell stored before the field
    (the teacher's here) takes the distances of another model's cell of the same prompts; a key without stored
    distances is left out; different prompt lengths for one key are refused."""
    import pandas as pd

    from headscope.evaluation.retention import DISTANCE_COLUMNS, distance_table

    dist = [100, 600, 511, 512, 1500, 1023, 1024, 3000]  # bins [0,512) [512,1024) [1024,2048) [2048,4096)
    plen = [3000 + i for i in range(8)]
    hydra = _cell("hydra-7to1", 0, 12_500_000, [1, 1, 0, 1, 0, 1, 1, 0], L=4096)
    hydra.update(evidence_distance=dist, prompt_len=plen)
    cells = {"teacher__s0__t0": [_cell("teacher", 0, 0, [1, 1, 1, 1, 1, 0, 1, 1], L=4096), _cell("teacher", 0, 0, [1, 0], L=1024)],
             "hydra-7to1__s0__t12500000": [hydra]}
    for d, cs in cells.items():
        (tmp_path / "cells" / d).mkdir(parents=True)
        for c in cs:
            (tmp_path / "cells" / d / f"niah_single.unseen.{c['length']}.json").write_text(json.dumps(c))
    assert distance_table(tmp_path / "cells", tmp_path, edges=(0, 512, 1024, 2048, 4096)) == 8
    df = pd.read_csv(tmp_path / "retention_distance.csv")
    assert tuple(df.columns) == DISTANCE_COLUMNS and set(df.length) == {4096}  # the 1K key has no distances
    h = df[df.model == "hydra-7to1"]
    assert h.distance_lo.tolist() == [0, 512, 1024, 2048] and h.n.tolist() == [2, 3, 2, 1]
    assert h.hits.tolist() == [1, 3, 1, 0] and h.teacher_hits.tolist() == [2, 2, 2, 1]
    tt = df[df.model == "teacher"]
    assert tt.hits.tolist() == [2, 2, 2, 1] and set(tt.distance_from) == {"hydra-7to1"}
    lines = _tables().distance_lines(tmp_path, [1024, 4096])  # comparison.md's table, arms in the study's order
    assert lines[3] == "| arm | tokens | length | 0–512 | 512–1024 | 1024–2048 | 2048–4096 |"
    assert lines[5:] == ["| teacher | – | 4K | 2/2 | 2/3 | 2/2 | 1/1 |", "| hydra-7to1 | 12.5M | 4K | 1/2 | 3/3 | 1/2 | 0/1 |"]
    assert "distances stored by hydra-7to1's cells" in lines[1]
    other = dict(hydra, model="ie-7to1", prompt_len=plen[::-1])
    (tmp_path / "cells" / "ie-7to1__s0__t12500000").mkdir()
    (tmp_path / "cells" / "ie-7to1__s0__t12500000" / "niah_single.unseen.4096.json").write_text(json.dumps(other))
    with pytest.raises(ValueError, match="different prompt lengths"):
        distance_table(tmp_path / "cells", tmp_path)
    with pytest.raises(ValueError, match="strictly increasing"):
        distance_table(tmp_path / "cells", tmp_path, edges=(0, 512, 512))


def test_prompt_depths_are_the_suites(monkeypatch):
    """prompt_depths must be the depths the suite's cells are built at (the depth table reads them from there)."""
    from types import SimpleNamespace

    import headscope.tasks as tasks
    import headscope.tasks.formats as formats
    from headscope.evaluation.accuracy import prompt_depths

    seen = {}
    monkeypatch.setattr(tasks, "make_pairs", lambda task, tok, n_pairs, seq_len, depth, seed: seen.setdefault("seen", depth))
    monkeypatch.setattr(formats, "format_pairs", lambda tok, fam, task, filler, n_pairs, seq_len, depth, seed: seen.setdefault("unseen", depth))

    class Tok:
        name_or_path, __len__ = "tiny", lambda self: 10

    for n in (1, 7, 100):
        seen.clear()
        suite_pairs(Tok(), SuiteConfig(n=n), "niah_single", "seen", 256)
        suite_pairs(Tok(), SuiteConfig(n=n), "niah_single", "unseen", 256, filler=SimpleNamespace(sentences=["A b."]))
        assert np.allclose(seen["seen"], prompt_depths(n)) and np.allclose(seen["unseen"], prompt_depths(n))


@pytest.mark.parametrize("kind", ["teacher", "hybrid"])
def test_cached_greedy_generation_equals_the_cache_free_loop(smol_tokenizer, kind):
    """use_cache=True (one prefill, then one token per forward through the model's own Cache: transformers' for
    the teacher, HybridCache for a head-wise hybrid) gives the tokens and checks of the cache-free loop, and its
    decode forwards carry one token each."""
    from headscope.hybrid import hybridize
    from headscope.masks import HeadMask

    model = tiny_llama(smol_tokenizer, seed=7, n_layers=2, n_heads=4, n_kv=2, d_model=32).double()
    if kind == "hybrid":
        model = hybridize(model, HeadMask(2, 4, 2, ((0,), (2, 3)))).double().eval()
        g = torch.Generator().manual_seed(3)
        with torch.no_grad():  # non-trivial GDN parameters (decays, beta, gates)
            for layer in model.model.layers:
                for p in layer.self_attn.parameters():
                    p.add_(0.05 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    cfg = SuiteConfig(tasks=("niah_single",), lengths=(128, 256), n=3, gen_n=3)
    pairs = suite_pairs(smol_tokenizer, cfg, "niah_single", "seen", 128) + suite_pairs(smol_tokenizer, cfg, "niah_single", "seen", 256)
    widths = []
    h = model.register_forward_hook(lambda m, a, k, out: widths.append(k["input_ids"].shape[1]), with_kwargs=True)
    cached = greedy_generation_hits(model, smol_tokenizer, pairs, extra=2, batch_tokens=600, use_cache=True)
    h.remove()
    free = greedy_generation_hits(model, smol_tokenizer, pairs, extra=2, batch_tokens=600, use_cache=False)
    assert cached == free
    assert len(set(cached["outputs"])) > 1  # the prompts' continuations differ: the check compares something
    groups = {}
    for p in pairs:
        groups.setdefault((p.clean.shape[-1], p.n_answer), []).append(p)
    chunks = [(L, n) for (L, n), g in groups.items() for _ in range(0, len(g), max(1, 600 // (L + n + 2)))]
    assert sorted(w for w in widths if w > 1) == sorted(L for L, n in chunks)  # one prefill per chunk of rows
    assert widths.count(1) == sum(n + 2 - 1 for L, n in chunks) > 0  # then one token per forward


def test_study_mask_coverage_against_the_scores_csv(tmp_path):
    """mask_coverage on the committed teacher ranking (unseen single-needle pairs at 4K) and masks, recomputed here
    from the ranking's scores.csv with pandas: positive-IE share, top 10 and top N held; comparison.md's coverage
    section lists every arm."""
    import json as _json
    import shutil

    import pandas as pd

    records = ROOT / "experiments" / "conversion-generalization" / "records"
    key = "unseen_niah_single@4096_p6"
    shutil.copytree(records / "anatomy" / key / "teacher" / "ranking", tmp_path / "anatomy" / key / "teacher" / "ranking")
    shutil.copytree(records / "masks", tmp_path / "masks")
    rows = {r["arm"]: r for r in _tables().mask_coverage(tmp_path)}
    assert set(rows) == {"hydra-7to1", "layer-3to1", "layer-7to1", "random-7to1", "ie-7to1", "hydra-5to1", "layer-5to1", "random-5to1"}
    sc = pd.read_csv(tmp_path / "anatomy" / key / "teacher" / "ranking" / "scores.csv")
    sc = sc.sort_values("score", ascending=False)
    keys = list(zip(sc["layer"], sc["head"]))
    pos = sc["score"].clip(lower=0)
    for arm, r in rows.items():
        m = _json.loads((tmp_path / "masks" / f"{arm}.json").read_text())
        fa = {(int(l), h) for l, hs in m["fa_heads"].items() for h in hs}
        share = pos[[k in fa for k in keys]].sum() / pos.sum()
        assert r["positive_share"] == pytest.approx(share, rel=1e-9)
        assert r["fa_heads"] == len(fa) and r["top10_held"] == sum(k in fa for k in keys[:10])
        assert r["topN_held"] == sum(k in fa for k in keys[:len(fa)])
    assert rows["ie-7to1"]["top10_held"] == 9 and rows["hydra-7to1"]["top10_held"] == 5
    assert rows["ie-7to1"]["positive_share"] > rows["hydra-7to1"]["positive_share"] > rows["random-7to1"]["positive_share"]
    assert rows["hydra-5to1"]["fa_heads"] == 45 and rows["hydra-5to1"]["top10_held"] == 5  # 7:1's 34 heads and 11 more
    lines = _tables().coverage_lines(tmp_path)
    assert sum(ln.startswith("| ") and not ln.startswith("| arm") for ln in lines) == 8


def test_study_anatomy_table_by_hand(tmp_path):
    """anatomy.csv / anatomy_knockout.csv / comparison.md's anatomy section from two students' anatomy.json and
    knockout.csv (numbers chosen here): the summary columns are the json's values, the random-GDN column is the mean
    of the draws, the knockout table keeps every row with its arm; a student whose ranking failed has no row."""
    import pandas as pd

    key = "unseen_niah_single@4096_p6"

    def student(arm: str, seed: int, fa_share: float, ko: dict) -> None:
        d = tmp_path / "anatomy" / key / f"seed{seed}_{arm}_t50000000"
        d.mkdir(parents=True)
        res = {"arm": arm, "seed": seed, "tokens": 50_000_000, "done": True,
               "student": {"top10": ["L16H0", "L3H1", "L9H2", "L1H1"],
                           "kinds": {"fa": {"n_heads": 34, "positive_mass_share": fa_share, "top10": 7},
                                     "gdn": {"n_heads": 236, "positive_mass_share": 1 - fa_share, "top10": 3}}},
               "comparison": {"top10": {"overlap": 0.6, "spearman": 0.41, "teacher_top_kept_fa": 5}},
               "knockout": {k: {"accuracy": v, "n": 100, "n_heads": 34, "correct": []} for k, v in ko.items()}}
        (d / "anatomy.json").write_text(json.dumps(res))
        pd.DataFrame([{"model": k.split("/")[0], "method": k.split("/")[1], "condition": k.split("/")[2], "n_heads": 34,
                       "n": 100, "hits": round(100 * v), "accuracy": v} for k, v in ko.items()]).to_csv(d / "knockout.csv", index=False)

    student("ie-7to1", 0, 0.8, {"student/zero/none": 0.9, "student/zero/fa": 0.1, "student/mean/fa": 0.2,
                                "student/mean/gdn_random0": 0.85, "student/mean/gdn_random1": 0.75,
                                "student/mean/gdn_random2": 0.8, "student/mean/student_top": 0.3,
                                "teacher/zero/none": 0.98, "teacher/mean/fa": 0.5, "teacher/mean/gdn": 0.4,
                                "student/mean/single_L16H0": 0.6, "student/mean/single_L3H1": 0.05,
                                "student/mean/gdn": 0.45})
    student("hydra-7to1", 0, 0.5, {"student/zero/none": 0.76})  # knockouts not run yet
    bad = tmp_path / "anatomy" / key / "seed1_layer-3to1_t50000000"
    bad.mkdir(parents=True)
    (bad / "anatomy.json").write_text(json.dumps({"arm": "layer-3to1", "seed": 1, "tokens": 1, "student": {"error": "gap"}}))
    assert _tables().anatomy_table(tmp_path) == 2
    t = pd.read_csv(tmp_path / "anatomy.csv").set_index("model")
    r = t.loc["ie-7to1"]
    assert (r.fa_heads, r.fa_in_top10, r.teacher_top10_fa, r.student_top3, r.knockout_n) == (34, 7, 5, "L16H0 L3H1 L9H2", 100)
    assert (r.fa_positive_share, r.top10_overlap, r.spearman) == (0.8, 0.6, 0.41)
    assert (r.acc_student, r.acc_student_fa_zero, r.acc_student_fa_mean, r.acc_student_top_mean) == (0.9, 0.1, 0.2, 0.3)
    assert r.acc_student_gdn_mean == 0.45
    assert r.acc_student_gdn_random_mean == pytest.approx(0.8)
    assert (r.acc_student_gdn_random_min, r.acc_student_gdn_random_max) == (0.75, 0.85)
    assert (r.acc_teacher, r.acc_teacher_fa_mean, r.acc_teacher_gdn_mean) == (0.98, 0.5, 0.4)
    h = t.loc["hydra-7to1"]
    assert h.acc_student == 0.76 and pd.isna(h.acc_student_fa_mean) and pd.isna(h.acc_student_gdn_random_mean)
    k = pd.read_csv(tmp_path / "anatomy_knockout.csv")
    assert len(k) == 14 and list(k.columns[:4]) == ["key", "arm", "seed", "tokens"]
    assert k[(k.arm == "ie-7to1") & (k.condition == "gdn_random1")].accuracy.item() == 0.75
    lines = _tables().anatomy_lines(tmp_path)
    row = next(ln for ln in lines if ln.startswith("| ie-7to1 |"))
    assert row == ("| ie-7to1 | 0 | 50M | 0.80 | 7 | 0.60 | 0.41 | L16H0 L3H1 L9H2 | 0.90 | 0.20 / 0.10 | 0.80 (0.75–0.85) | 0.30 | 0.45 | "
                   "0.98 | 0.50 | 0.40 |")
    assert any(ln.startswith("| hydra-7to1 | 0 | 50M | 0.50 |") and "| 0.76 | – / – | – | – | – |" in ln for ln in lines)
    assert "100 prompts" in next(ln for ln in lines if ln.startswith("Anatomy after conversion"))
    assert r.student_single_heads_out == "L16H0=0.60 L3H1=0.05" and pd.isna(h.student_single_heads_out)
    assert lines[-1] == "One head knocked out (mean ablation), accuracy: ie-7to1 seed 0: L16H0=0.60 L3H1=0.05."


def test_study_token_curve_by_hand(tmp_path):
    """token_curve / curve_lines from a hand-made levers.csv: only arms with two or more token budgets get a curve,
    one row per (tokens, length) with the levers.csv values, the figure written; comparison.md's table by tokens."""
    import pandas as pd

    assert _tables().token_curve(tmp_path) == 0  # no levers.csv
    rows = []
    for model, tokens, seeds, base in (("hydra-7to1", 50_000_000, 2, 0.8), ("hydra-7to1", 200_000_000, 1, 0.9),
                                       ("hydra-7to1", 12_500_000, 1, 0.6), ("layer-3to1", 50_000_000, 1, 0.1)):
        r = {"lever": "x", "model": model, "command": "c", "tokens": tokens, "seeds": seeds}
        for k, L in enumerate((1024, 2048, 4096)):
            r.update({f"retention_{L}": base - 0.1 * k, f"retention_{L}_min": base - 0.1 * k - 0.05,
                      f"retention_{L}_max": base - 0.1 * k + 0.05})
        rows.append(r)
    pd.DataFrame(rows).to_csv(tmp_path / "levers.csv", index=False)
    assert _tables().token_curve(tmp_path, [1024, 2048, 4096]) == 1
    d = pd.read_csv(tmp_path / "token_curve.csv")
    assert set(d.model) == {"hydra-7to1"} and len(d) == 9
    r = d[(d.tokens == 200_000_000) & (d.length == 2048)].iloc[0]
    assert (r.retention, r.retention_min, r.retention_max, r.seeds) == (pytest.approx(0.8), pytest.approx(0.75), pytest.approx(0.85), 1)
    assert (tmp_path / "token_curve.html").stat().st_size > 1000
    lines = _tables().curve_lines(tmp_path)
    assert lines[3] == "| arm | length | 12.5M | 50M | 200M |"
    for t in (1, 999, 12_000, 12_500_000, 50_000_000, 200_000_000, 1_250_000, 3_000_000_000, 123_456):
        assert _tables().parse_tokens(_tables().tokens_text(t)) == t
    assert lines[5:] == ["| hydra-7to1 | 1K | 0.60 | 0.80 | 0.90 |", "| hydra-7to1 | 2K | 0.50 | 0.70 | 0.80 |",
                         "| hydra-7to1 | 4K | 0.40 | 0.60 | 0.70 |"]


def test_paired_exact_test_by_hand():
    """McNemar's exact test: 3 prompts only ``a`` gets right, none only ``b``: p = 2 · 0.5³ = 0.25; 1 against 1: p = 1."""
    from headscope.errors import HeadscopeInputError
    from headscope.evaluation.accuracy import paired_exact_test

    t = paired_exact_test([1, 1, 1, 0, 1], [0, 0, 0, 0, 1])
    assert (t["n"], t["hits_a"], t["hits_b"], t["only_a"], t["only_b"]) == (5, 4, 1, 3, 0)
    assert t["p_value"] == pytest.approx(0.25)
    assert paired_exact_test([1, 0], [0, 1])["p_value"] == pytest.approx(1.0)
    assert paired_exact_test([1, 1], [1, 1])["p_value"] == 1.0  # never disagree
    # 10 against 0: 2 · 0.5¹⁰
    assert paired_exact_test([1] * 10 + [0] * 5, [0] * 15)["p_value"] == pytest.approx(2 / 1024)
    for a, b in (([1, 0], [1]), ([], []), ([2, 0], [1, 0])):
        with pytest.raises(HeadscopeInputError):
            paired_exact_test(a, b)


def test_study_lever_pairs_by_hand(tmp_path):
    """lever_pairs: each lever row beside its reference on the shared seeds only (a seed the reference lacks is left
    out), hits summed over those seeds, McNemar's p from the pooled discordant prompts; the baseline has no row."""
    import pandas as pd

    assert _tables().lever_reference("hydra-7to1+s2_retrieval=0.25", 12_500_000) == ("hydra-7to1", 12_500_000)
    assert _tables().lever_reference("hydra-5to1", 12_500_000) == ("hydra-7to1", 12_500_000)
    assert _tables().lever_reference("ie-7to1", 50_000_000) == ("hydra-7to1", 50_000_000)
    assert _tables().lever_reference("layer-3to1", 12_500_000) == ("layer-3to1", 50_000_000)
    assert _tables().lever_reference("hydra-7to1", 50_000_000) is None

    def cell(model, seed, tokens, correct, L=1024, task="niah_single"):
        d = tmp_path / "cells" / f"{model}__s{seed}__t{tokens}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"{task}.unseen.{L}.json").write_text(json.dumps(
            {"model": model, "seed": seed, "tokens": tokens, "task": task, "formats": "unseen", "length": L,
             "n": len(correct), "hits": sum(correct), "correct": correct}))

    T = 12_500_000
    cell("hydra-7to1", 4, T, [1, 0, 0, 1])
    cell("hydra-7to1+s3_wordings=6", 4, T, [1, 1, 1, 0])
    cell("hydra-7to1", 5, T, [0, 0, 0, 0])
    cell("hydra-7to1+s3_wordings=6", 5, T, [1, 1, 0, 0])
    cell("hydra-7to1+s3_wordings=6", 6, T, [0, 0, 0, 0])  # no reference on seed 6: left out
    cell("hydra-7to1+s3_wordings=6", 4, T, [0, 0, 0, 0], task="niah_multikey")  # not a lever cell
    levers = pd.DataFrame([{"lever": "baseline", "model": "hydra-7to1", "tokens": 50_000_000},
                           {"lever": "s3_wordings=6 + tokens 12.5M", "model": "hydra-7to1+s3_wordings=6", "tokens": T}])
    levers.to_csv(tmp_path / "levers.csv", index=False)
    (tmp_path / "levers.md").write_text("| lever |\n")
    assert _tables().lever_pairs(tmp_path, [1024, 2048]) == 1
    r = pd.read_csv(tmp_path / "levers_paired.csv").iloc[0]
    assert (r.reference, r.reference_tokens, r.length, r.seeds, r.n) == ("hydra-7to1", T, 1024, "4 5", 8)
    # seed 4: lever-only prompts 1, 2; reference-only 3; seed 5: lever-only 0, 1 -> 4 against 1, p = 2 · 6/32
    assert (r.hits, r.reference_hits, r.only_lever, r.only_reference) == (5, 2, 4, 1)
    assert r.p_value == pytest.approx(0.375)
    md = (tmp_path / "levers.md").read_text()
    assert "| s3_wordings=6 + tokens 12.5M | hydra-7to1+s3_wordings=6 12.5M | hydra-7to1 12.5M | 4, 5 | 5 / 2 of 8 (p = 0.38) | — |" in md
