"""``headscope eval`` on tiny models: the columns it writes, one cell checked against a brute-force greedy pass, the
resume, the refusals before any model loads; and the pair-set files it keeps (gzip JSON, a pickle refused)."""

from __future__ import annotations

import json
import pickle

import pandas as pd
import pytest
import torch
from typer.testing import CliRunner

from conftest import tiny_llama
from headscope.cli import app
from headscope.errors import HeadscopeInputError
from headscope.evaluation.pairsets import load_pairs, save_pairs
from headscope.evaluation.retention import EVAL_COLUMNS

CORPUS = ("The old mill stood by the river for many years. Children played near it every summer. A farmer walked to "
          "town and bought bread. The market was busy that day. Rain fell in the evening.\n\nShe opened the window and "
          "looked at the hills. A dog barked far away. The kettle began to sing. Nobody knew where the path would lead. "
          "The lanterns were lit one by one.\n\nThe train left the station before dawn. Snow covered the fields along "
          "the tracks. A conductor walked through the quiet cars. Somewhere a child was humming a song.")


@pytest.fixture(scope="module")
def folders(smol_tokenizer, tmp_path_factory):
    """A converted folder (a saved hybrid of a tiny random Llama, with its tokenizer), its teacher's folder, a corpus."""
    from headscope import hybridize
    from headscope.masks import HeadMask

    root = tmp_path_factory.mktemp("eval")
    teacher = tiny_llama(smol_tokenizer, seed=3, n_layers=2, n_heads=4, n_kv=2, d_model=32)
    teacher.save_pretrained(root / "teacher")
    smol_tokenizer.save_pretrained(root / "teacher")
    mask = HeadMask.from_heads([(0, 1), (1, 2)], n_layers=2, n_heads=4, n_kv_heads=2)
    student = hybridize(teacher, mask)
    student.save_pretrained(root / "conv" / "stage3")
    smol_tokenizer.save_pretrained(root / "conv" / "stage3")
    # headscope convert's record: the recipe's total tokens and seed name the model's row (the stage's own tokens not)
    (root / "conv" / "stage3" / "training.json").write_text(json.dumps(
        {"format": "headscope.convert/1", "stage": 3, "tokens": 3_740_000, "seeds": {"train": 4},
         "recipe": {"tokens": 12_500_000, "seed": 4}}))
    (root / "corpus.txt").write_text(CORPUS)
    return root


def _eval(folders, out, *extra):
    argv = ["eval", str(folders / "conv" / "stage3"), "--teacher", str(folders / "teacher"), "--corpus",
            str(folders / "corpus.txt"), "--tasks", "niah_single", "--lengths", "256", "--n", "3",
            "--gen-n", "2", "--device", "cpu", "--no-progress", "--out", str(out), *extra]
    return CliRunner().invoke(app, argv)


def test_eval_writes_cells_checked_by_brute_force_and_resumes(folders, tmp_path, monkeypatch):
    from headscope.models import load_hf

    out = tmp_path / "out"
    res = _eval(folders, out)
    assert res.exit_code == 0, (res.output, res.exception)
    df = pd.read_csv(out / "retention.csv")
    assert tuple(df.columns) == EVAL_COLUMNS
    assert sorted(df.model.unique()) == ["conv-stage3", "teacher"] and (df.source == "cli").all() and len(df) == 2
    assert set(df.task) == {"niah_single"} and (df.length == 256).all() and (df.n == 3).all()
    student = df[df.model == "conv-stage3"]
    assert (student.seed == 4).all() and (student.tokens == 12_500_000).all()
    assert (out / "report.md").read_text().count("| niah_single | unseen | 256 | 3 |") == 1
    html = (out / "report.html").read_text()
    assert "plotly" in html and "conv-stage3 (unseen)" in html and len(html) > 1_000_000  # plotly.js inlined
    # one cell by hand: the stored per-prompt outcomes against a brute-force greedy pass over its prompts
    model, tok, _ = load_hf(folders / "conv" / "stage3", device="cpu")
    pairs = load_pairs(out / "prompts" / "unseen_niah_single@256_n3_s4321.json.gz")
    assert len(pairs) == 3 and all(p.meta["family"] == "unseen" for p in pairs)
    rec = json.loads(__import__("gzip").decompress((out / "cells" / "conv-stage3__s4__t12500000" / "niah_single.unseen.256.json.gz")
                                                   .read_bytes()))
    brute, gen = [], []
    with torch.no_grad():
        for p in pairs:
            lg = model(torch.cat([p.clean, p.answer[:-1]])[None]).logits[0]
            brute.append(int(all(int(lg[p.length - 1 + j].argmax()) == int(p.answer[j]) for j in range(p.n_answer))))
        for p in pairs[:2]:
            g = model.generate(p.clean[None], max_new_tokens=p.n_answer, do_sample=False, pad_token_id=tok.eos_token_id)
            gen.append(int(g[0, p.length:].tolist() == p.answer.tolist()))
    assert rec["correct"] == brute and rec["gen_exact"] == gen and rec["gen_agree"] == sum(a == b for a, b in zip(gen, brute))
    row = df[(df.model == "conv-stage3") & (df.task == "niah_single")].iloc[0]
    assert row.hits == sum(brute) and row.accuracy == pytest.approx(sum(brute) / 3)
    assert row.agreement == pytest.approx(rec["gen_agree"] / 2)
    t = json.loads(__import__("gzip").decompress((out / "cells" / "teacher__s0__t0" / "niah_single.unseen.256.json.gz")
                                                 .read_bytes()))
    assert row.teacher_accuracy == pytest.approx(t["hits"] / 3)
    # resume: every cell is stored, no model loads, nothing is scored again, the table is the same
    import headscope.evaluation.retention as R

    def boom(*a, **k):
        raise AssertionError("a stored cell was scored again")

    import headscope.models

    monkeypatch.setattr(R, "retrieval_hits", boom)
    monkeypatch.setattr(R, "greedy_generation_hits", boom)
    monkeypatch.setattr(headscope.models, "load_hf", boom)  # every cell stored: no weights load
    again = _eval(folders, out)
    assert again.exit_code == 0, (again.output, again.exception)
    pd.testing.assert_frame_equal(pd.read_csv(out / "retention.csv"), df)
    # the same weights under a second name into the same folder: the teacher's stored cells are skipped and the
    # model's are copied from conv-stage3's (same fingerprint and settings), nothing loads
    monkeypatch.undo()
    calls = []
    real = headscope.models.load_hf
    monkeypatch.setattr(headscope.models, "load_hf", lambda spec, **k: (calls.append(str(spec)), real(spec, **k))[1])
    second = _eval(folders, out, "--name", "conv-b")
    assert second.exit_code == 0, (second.output, second.exception)
    assert calls == [] and "conv-b: 1 cell(s) reused from conv-stage3__s4__t12500000" in second.stderr
    both = pd.read_csv(out / "retention.csv")
    assert sorted(both.model.unique()) == ["conv-b", "conv-stage3", "teacher"] and len(both) == 3
    b = both[both.model == "conv-b"].set_index("task")
    a = both[both.model == "conv-stage3"].set_index("task")
    assert (b.hits == a.hits).all() and (b.teacher_accuracy == a.teacher_accuracy).all()  # same weights, same prompts


def test_a_teacher_scored_alone_before_is_not_scored_again(folders, tmp_path, monkeypatch):
    """The teacher evaluated alone into OUT (as 'ref'), then a student with --teacher (the same folder) into OUT: the
    teacher's cells are copied from ref's (same weights' fingerprint and settings), only the student loads."""
    import gzip

    import headscope.models

    out = tmp_path / "out"
    def alone(name, lengths):  # the teacher's folder evaluated by itself
        return CliRunner().invoke(app, ["eval", str(folders / "teacher"), "--name", name, "--corpus",
                                        str(folders / "corpus.txt"), "--tasks", "niah_single", "--lengths", lengths,
                                        "--n", "3", "--gen-n", "2", "--device", "cpu", "--no-progress", "--out", str(out)])

    first = alone("ref", "128")
    assert first.exit_code == 0, (first.output, first.exception)
    calls = []
    real = headscope.models.load_hf
    monkeypatch.setattr(headscope.models, "load_hf", lambda spec, **k: (calls.append(str(spec)), real(spec, **k))[1])
    res = _eval(folders, out, "--lengths", "128")  # lengths 256 (_eval's) and 128: 128 was scored as ref, 256 not
    assert res.exit_code == 0, (res.output, res.exception)
    assert "teacher: 1 cell(s) reused from ref__s0__t0 (the same model, weights and settings)" in res.stderr
    assert calls == [str(folders / "teacher"), str(folders / "conv" / "stage3")]  # the teacher loads for 256 only
    cell = "niah_single.unseen.128.json.gz"
    ref = json.loads(gzip.decompress((out / "cells" / "ref__s0__t0" / cell).read_bytes()))
    tea = json.loads(gzip.decompress((out / "cells" / "teacher__s0__t0" / cell).read_bytes()))
    assert tea["model"] == "teacher" and tea["reused_from"] == "ref__s0__t0"
    assert tea["correct"] == ref["correct"] and tea["config"] == ref["config"] and tea["seconds"] == ref["seconds"]
    assert "reused_from" not in json.loads(gzip.decompress((out / "cells" / "teacher__s0__t0" /
                                                            "niah_single.unseen.256.json.gz").read_bytes()))
    df = pd.read_csv(out / "retention.csv")
    row = df[(df.model == "conv-stage3") & (df.length == 128)].iloc[0]
    assert row.teacher_accuracy == pytest.approx(ref["hits"] / 3)
    # the other way: the teacher's folder alone again, under a new name, at 256 (scored as the teacher): nothing loads
    calls.clear()
    again = alone("ref2", "256")
    assert again.exit_code == 0, (again.output, again.exception)
    assert calls == [] and "ref2: 1 cell(s) reused from teacher__s0__t0" in again.stderr


@pytest.mark.parametrize("extra, want", [
    (["--tasks", "niah_single,induction"], "--tasks='induction' is not one of"),
    (["--formats", "unseen,other"], "--formats='other' is not one of seen, unseen"),
    (["--lengths", "1k,12x"], "--lengths '12x': give prompt lengths in tokens"),
    (["--lengths", "64"], "give prompt lengths of at least 128 tokens"),
    (["--n", "0"], "--n=0 must be >= 1"),
    (["--dtype", "int8"], "--dtype='int8' is not one of float32, bfloat16, float16"),
    (["--corpus", "/nonexistent/corpus.txt"], "--corpus /nonexistent/corpus.txt: no such file"),
    (["--teacher", "/nonexistent/teacher.gguf"], "/nonexistent/teacher.gguf does not exist"),
    (["--name", "teacher"], "--name 'teacher' is the teacher's"),
])
def test_eval_refuses_bad_arguments_before_loading(folders, tmp_path, monkeypatch, extra, want):
    import headscope.models

    monkeypatch.setattr(headscope.models, "load_hf", lambda *a, **k: pytest.fail("a model was loaded"))
    res = _eval(folders, tmp_path / "out", *extra)
    assert res.exit_code == 2, (res.output, res.exception)
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and want in lines[0], res.output


@pytest.mark.parametrize("model, want", [
    ("/nonexistent/model_dir", "/nonexistent/model_dir does not exist (nor does its folder /nonexistent); check the path"),
    ("nobody/not-a-cached-model", "is no local directory and not in the local Hugging Face cache"),
])
def test_eval_refuses_a_model_it_cannot_load(tmp_path, monkeypatch, model, want):
    import headscope.models

    monkeypatch.setattr(headscope.models, "load_hf", lambda *a, **k: pytest.fail("a model was loaded"))
    res = CliRunner().invoke(app, ["eval", model, "--out", str(tmp_path / "o"), "--device", "cpu"])
    assert res.exit_code == 2 and res.output.startswith("error: ") and want in res.output, res.output


def test_pair_sets_round_trip_and_refuse_a_pickle(smol_tokenizer, tmp_path):
    from headscope.evaluation.accuracy import eval_pairs

    pairs = eval_pairs(smol_tokenizer, "niah_single", 160, 2, seed=5)
    f = tmp_path / "set.json.gz"
    save_pairs(f, {"tokenizer": "x", "vocab": 7}, pairs)
    back = load_pairs(f, {"tokenizer": "x", "vocab": 7})
    assert [p.to_dict() for p in back] == [p.to_dict() for p in pairs]
    assert load_pairs(f, {"tokenizer": "x", "vocab": 8}) is None  # built from something else: rebuild

    hit = tmp_path / "pickle-ran"

    class Bomb:
        def __reduce__(self):
            return (open, (str(hit), "w"))  # unpickling would create this file

    bomb = tmp_path / "bomb.json.gz"
    bomb.write_bytes(pickle.dumps({"ident": {}, "pairs": [Bomb()]}))
    with pytest.raises(HeadscopeInputError, match="not a headscope pair-set file"):
        load_pairs(bomb)
    import gzip

    bomb.write_bytes(gzip.compress(pickle.dumps(Bomb())))  # a gzip-wrapped pickle: still not JSON
    with pytest.raises(HeadscopeInputError, match="not a headscope pair-set file"):
        load_pairs(bomb)
    assert not hit.exists()


@pytest.mark.slow
def test_prompt_sets_built_in_parallel_equal_one_process(smol_tokenizer, tmp_path):
    """build_prompt_sets over two spawned processes writes the sets suite_pairs builds alone."""
    from headscope.evaluation.retention import SuiteConfig, build_prompt_sets, prompt_set_file, suite_pairs
    from headscope.tasks.formats import natural_filler

    cfg = SuiteConfig(tasks=("niah_single", "niah_multikey"), formats=("seen", "unseen"), lengths=(160, 256), n=2)
    filler = natural_filler(CORPUS.split("\n\n"), "unseen", "test corpus")
    assert build_prompt_sets(smol_tokenizer, cfg, tmp_path / "par", filler, workers=2, log=lambda s: None) == 8
    assert build_prompt_sets(smol_tokenizer, cfg, tmp_path / "par", filler, workers=2, log=lambda s: None) == 0
    for cell in cfg.cells():
        got = load_pairs(prompt_set_file(tmp_path / "par", cfg, *cell))
        want = suite_pairs(smol_tokenizer, cfg, *cell, filler=filler)
        assert [p.to_dict() for p in got] == json.loads(json.dumps([p.to_dict() for p in want]))


def test_sampled_haystack_documents_are_kept_and_read_back(smol_tokenizer, tmp_path, monkeypatch):
    """The default haystack: documents sampled with the study's haystack seed (HAYSTACK_SEED + seed), the model loaded
    only when they must be sampled, kept in gzip JSON and read back by a rerun of the same settings."""
    import headscope.train
    from headscope.evaluation.haystack import HAYSTACK_SEED, HaystackConfig, sampled_documents
    from headscope.train import sample_teacher_text

    model = tiny_llama(smol_tokenizer, seed=6, n_layers=1, n_heads=2, n_kv=1, d_model=32)
    cfg = HaystackConfig(docs=3, doc_len=16, seed=2)
    loads = []

    def loader():
        loads.append(1)
        return model

    docs = sampled_documents(loader, smol_tokenizer, cfg, tmp_path, "tiny")
    assert loads == [1] and len(docs) == 3 and all(len(d) == 17 for d in docs)
    assert docs == sample_teacher_text(model, smol_tokenizer, 3, 16, seed=HAYSTACK_SEED + 2, batch_size=3, progress=False)
    monkeypatch.setattr(headscope.train, "sample_teacher_text", lambda *a, **k: pytest.fail("sampled again"))
    assert sampled_documents(loader, smol_tokenizer, cfg, tmp_path, "tiny") == docs and loads == [1]
    monkeypatch.undo()
    other = sampled_documents(loader, smol_tokenizer, HaystackConfig(docs=3, doc_len=16, seed=3), tmp_path, "tiny")
    assert loads == [1, 1] and other != docs  # other settings: sampled again
