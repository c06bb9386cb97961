"""`headscope convert` (issue 60 items 1-2): all three stages in one command with the study's recipe, each
stage a model folder of its own (loadable without headscope, equal in logits to the trained student),
an exact resume after a crash, the default stage-3 rows disjoint from the evaluation's wording, and
checkpoints that never unpickle."""

from __future__ import annotations

import json
import os
import pickle
import random
import subprocess
import sys
import textwrap

import pytest
import torch
from typer.testing import CliRunner

from headscope.cli import app
from headscope.masks import HeadMask
from headscope.train import ConvertRecipe, convert_model, recipe_rows
from headscope.train.model_folder import load_model_folder

from conftest import tiny_llama

MASK = HeadMask(2, 4, 2, ((1,), (0, 3)))


pytestmark = pytest.mark.usefixtures("one_thread")


def corpus_text(n_docs: int = 40, seed: int = 0) -> str:
    """Plain seeded sentences (no digits), documents separated by blank lines."""
    rng = random.Random(seed)
    subj = ["The farmer", "A young painter", "The old sailor", "My neighbour", "The teacher", "A quiet student"]
    verb = ["walked to", "looked at", "talked about", "painted", "cleaned", "visited"]
    obj = ["the harbour", "a small garden", "the village square", "an empty barn", "the long road"]
    tail = ["in the morning", "after the rain", "with great care", "before dinner", "once again"]
    return "\n\n".join(" ".join(f"{rng.choice(subj)} {rng.choice(verb)} {rng.choice(obj)} {rng.choice(tail)}."
                                for _ in range(12)) for _ in range(n_docs))


@pytest.fixture(scope="module")
def setup(small_tokenizer, tmp_path_factory):
    root = tmp_path_factory.mktemp("convert")
    teacher = tiny_llama(small_tokenizer, seed=3, d_model=32)  # a 2,048-token LM head (not 49,152): the layers are the cost
    teacher.save_pretrained(root / "teacher")
    small_tokenizer.save_pretrained(root / "teacher")
    (root / "corpus.txt").write_text(corpus_text())
    MASK.to_json(root / "mask.json")
    return root, teacher


def _recipe(root, **kw):
    base = dict(seq_len=128, long_len=256, batch_size=2, batch_long=2, stage_tokens=(2 * 128, 3 * 2 * 128, 2 * 256),
                corpus=str(root / "corpus.txt"), ckpt_every=2)
    return ConvertRecipe(**{**base, **kw})


def _tok(small_tokenizer):
    if small_tokenizer.pad_token_id is None:
        small_tokenizer.pad_token = small_tokenizer.eos_token
    return small_tokenizer


def test_three_stages_write_model_folders_and_resume_exactly(setup, small_tokenizer, tmp_path):
    root, teacher = setup
    tok = _tok(small_tokenizer)
    recipe = _recipe(root)
    full = convert_model(teacher, tok, MASK, tmp_path / "full", recipe=recipe, progress=False)
    assert full["finished"] and full["folder"] == str(tmp_path / "full" / "stage3")
    for k, steps in ((1, 1), (2, 3), (3, 1)):
        d = tmp_path / "full" / f"stage{k}"
        rec = json.loads((d / "training.json").read_text())
        assert rec["stage"] == k and rec["steps"] == steps and rec["tokens"] == recipe.stage_budget(k)
        assert {"model.safetensors", "config.json", "modeling_hybrid.py", "mask.json", "tokenizer.json"} <= {p.name for p in d.iterdir()}
        assert not (d / "checkpoint").exists()  # removed once the folder is complete
        assert [r[0] for r in rec["loss_curve"]["rows"]] == list(range(1, steps + 1))
        assert len(rec["data"]["rows_sha256"]) == 64 and rec["recipe"] == recipe.to_dict()
        assert rec["seconds"] > 0 and rec["peak_memory"]["bytes"] > 0 and rec["versions"]["torch"] == torch.__version__
        cfg = json.loads((d / "config.json").read_text())
        assert cfg["headscope_hybrid"]["options"]["fa_pos"] == "nope" and cfg["headscope_hybrid"]["options"]["fa_gate"] is True
        assert HeadMask.from_json(d / "mask.json") == MASK
    s2 = json.loads((tmp_path / "full" / "stage2" / "training.json").read_text())["data"]
    assert s2["retrieval_rows"] == max(4, round(s2["text_rows"] / 3))  # a quarter of the stage-2 rows
    want = load_model_folder(tmp_path / "full" / "stage3").state_dict()

    # a crash in the middle of stage 2 (after its step-2 checkpoint, at step 3 before the next one) ...
    class Crash(RuntimeError):
        pass

    def crash(tr, row):
        if tr.cfg.stage == 2 and tr.step == 3:
            raise Crash
    recipe_c = _recipe(root, ckpt_every=2)
    cut = tmp_path / "cut"
    with pytest.raises(Crash):
        convert_model(teacher, tok, MASK, cut, recipe=recipe_c, progress=False, train_options={"ckpt_on_exit": False},
                      on_step=crash)
    assert (cut / "stage1" / "training.json").exists() and (cut / "stage2" / "checkpoint" / "trainer.json").exists()
    assert json.loads((cut / "stage2" / "checkpoint" / "trainer.json").read_text())["step"] == 2
    with pytest.raises(FileExistsError, match="resume"):
        convert_model(teacher, tok, MASK, cut, recipe=recipe_c, progress=False)
    torch.manual_seed(123)  # disturb the global RNG: the resume restores it
    res = convert_model(teacher, tok, MASK, cut, recipe=recipe_c, progress=False, resume=True)
    assert res["finished"] and res["stages"][1].get("skipped")
    got = load_model_folder(cut / "stage3").state_dict()
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    curve = json.loads((cut / "stage2" / "training.json").read_text())["loss_curve"]["rows"]
    ref = json.loads((tmp_path / "full" / "stage2" / "training.json").read_text())["loss_curve"]["rows"]
    assert curve == ref  # the replayed step 3 is kept once, with the same loss
    # stage 1-2 folders deleted once stage 3 is complete (disk): --resume has nothing to do, trains nothing again
    import shutil

    from headscope.train import pipeline as pipeline_mod

    for k in (1, 2):
        shutil.rmtree(cut / f"stage{k}")
    real_stage = pipeline_mod.convert_stage
    pipeline_mod.convert_stage = lambda *a, **kw: pytest.fail("a stage trained again")
    try:
        again = convert_model(teacher, tok, MASK, cut, recipe=recipe_c, progress=False, resume=True)
    finally:
        pipeline_mod.convert_stage = real_stage
    assert again["finished"] and again["folder"] == str(cut / "stage3")
    assert [again["stages"][k]["skipped"] for k in (1, 2, 3)] == [
        "finished (its folder removed; a later stage is complete)"] * 2 + ["already finished"]
    with pytest.raises(FileExistsError, match=r"cut holds stage 1 finished \(a later stage's folder is complete\)"):  # without --resume: refused as before
        convert_model(teacher, tok, MASK, cut, recipe=recipe_c, progress=False)
    # another recipe into the same folder is refused before any work
    with pytest.raises(ValueError, match="another recipe.*s3_wordings: 6 stored, 3 now"):
        convert_model(teacher, tok, MASK, cut, recipe=_recipe(root, s3_wordings=3), resume=True, progress=False)


SUBPROCESS_LOAD = textwrap.dedent("""
    import sys, torch
    assert "headscope" not in sys.modules
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True).eval()
    assert "headscope" not in sys.modules and type(m).__module__.startswith("transformers_modules"), type(m).__module__
    ids = torch.load(sys.argv[2], weights_only=True)
    with torch.no_grad():
        torch.save(m(ids).logits, sys.argv[3])
""")


def test_cli_convert_final_folder_loads_without_headscope(setup, small_tokenizer, tmp_path):
    root, _ = setup
    out = tmp_path / "conv"
    args = ["convert", "--model", str(root / "teacher"), "--mask", str(root / "mask.json"), "--out", str(out),
            "--device", "cpu", "--corpus", str(root / "corpus.txt"), "--seq-len", "128", "--long-len", "256",
            "--batch-size", "2", "--batch-long", "2", "--stage-tokens", "256,256,512", "--gdn-kernel", "torch"]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    assert f"converted model: {out / 'stage3'}" in r.output
    # the in-memory student of the last stage is the folder's weights; a fresh process without headscope on
    # its path loads the folder with the saved code and gives the same logits
    student = load_model_folder(out / "stage3").eval()
    ids = torch.randint(3, 1000, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = student(ids).logits
    torch.save(ids, tmp_path / "ids.pt")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["HF_HUB_OFFLINE"] = "1"
    p = subprocess.run([sys.executable, "-c", SUBPROCESS_LOAD, str(out / "stage3"), str(tmp_path / "ids.pt"),
                        str(tmp_path / "logits.pt")], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    got = torch.load(tmp_path / "logits.pt", weights_only=True)
    assert (got - ref).abs().max().item() <= 1e-5
    # the same command again: refused (one line, exit 2) without --resume; with it, nothing is left to do
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 2 and r.output.count("\n") == 1 and "pass --resume" in r.output, r.output
    r = CliRunner().invoke(app, args + ["--resume"])
    assert r.exit_code == 0 and "already finished" in r.output, r.output
    # one stage at a time reads the previous stage's folder
    r = CliRunner().invoke(app, args[:6] + [str(tmp_path / "one")] + args[7:] + ["--stage", "2"])
    assert r.exit_code == 2 and "stage1 is not a finished stage" in r.output, r.output


def test_default_stage3_rows_share_no_3gram_with_the_evaluation(setup, small_tokenizer):
    from headscope.tasks.formats import EVAL_FAMILIES, wording_ngrams, words, ngrams

    root, _ = setup
    tok = _tok(small_tokenizer)
    recipe = _recipe(root)
    assert ConvertRecipe().s3_seen_task is None and ConvertRecipe().s3_wordings == 6
    docs = [list(tok(t)["input_ids"]) for t in corpus_text().split("\n\n")]
    rows, info = recipe_rows(tok, recipe, docs, 3)
    assert info["retrieval"] == "train family" and info["retrieval_rows"] >= 4
    text_words = set()
    for i in range(len(rows)):
        text_words |= ngrams(words(tok.decode(rows.ids[i][rows.mask[i]])), 3)
    # the rows carry the train family's wording, and no 3-gram of the seen or unseen family's
    assert text_words & wording_ngrams("train")
    for fam in EVAL_FAMILIES:
        assert not (text_words & wording_ngrams(fam)), fam
    # the explicit option trains on the seen templates: their 3-grams are there
    rows, info = recipe_rows(tok, _recipe(root, s3_seen_task="niah_single"), docs, 3)
    seen = set()
    for i in range(len(rows)):
        seen |= ngrams(words(tok.decode(rows.ids[i][rows.mask[i]])), 3)
    assert seen & wording_ngrams("seen", tasks=("niah_single",))


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


def test_checkpoint_that_would_run_code_is_refused(setup, small_tokenizer, tmp_path):
    """A checkpoint folder whose files are pickles (a foreign or old format) is refused, never unpickled."""
    from headscope.train.parallel import load_checkpoint, read_trainer_state

    ck = tmp_path / "stage1" / "checkpoint"
    ck.mkdir(parents=True)
    (ck / "trainer.json").write_bytes(pickle.dumps({"x": _Evil()}))
    with pytest.raises(ValueError, match="not a headscope checkpoint"):
        read_trainer_state(ck)
    (ck / "trainer.json").write_text(json.dumps({"stage": 1, "total_steps": 2}))
    (ck / "model.safetensors").write_bytes(pickle.dumps(_Evil()))
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="not a complete headscope checkpoint"):
        load_checkpoint(ck, model, torch.optim.AdamW(model.parameters()))


def test_cli_defaults_are_the_recipe():
    """Each `headscope convert` option of a recipe field defaults to ConvertRecipe's value (one source of truth
    for the documented defaults), and parse_tokens reads the budgets' spellings."""
    import dataclasses

    import typer

    from headscope.train import parse_tokens

    params = {p.name: p.default for p in typer.main.get_command(app).commands["convert"].params}
    r = ConvertRecipe()
    for f in dataclasses.fields(ConvertRecipe):
        if f.name == "tasks":
            continue  # not an option: the four tasks of the template families
        v = getattr(r, f.name)
        cli = params[f.name]
        if f.name == "tokens":
            cli = parse_tokens(cli)
        elif f.name in ("shares", "lr"):
            cli = tuple(float(x) for x in cli.split(","))
        assert cli == v, (f.name, cli, v)
    assert r.plan() == [
        {"stage": 1, "tokens": 1_867_776, "steps": 57, "rows_per_step": 64, "row_len": 512, "lr": 1e-3},
        {"stage": 2, "tokens": 6_881_280, "steps": 210, "rows_per_step": 64, "row_len": 512, "lr": 2e-4},
        {"stage": 3, "tokens": 3_735_552, "steps": 114, "rows_per_step": 16, "row_len": 2048, "lr": 1e-4}]
    assert r.hybrid_options() == {"fa_pos": "nope", "fa_gate": True, "gdn_rope": True}
    assert [parse_tokens(x) for x in ("12.5M", "200K", "200000", "1.5e6", "2G")] == [12_500_000, 200_000, 200_000, 1_500_000, 2 * 10**9]


def test_sampled_documents_are_saved_per_shard_and_reused(setup, small_tokenizer, tmp_path):
    """Without a corpus the teacher samples the documents in shards of sample_batch (shard k with seed 10,000 · seed
    + k), each saved as it finishes; a resumed run reads them instead of sampling again."""
    import headscope.train.data as data_mod
    from headscope.train import sample_teacher_text
    from headscope.train.recipe import docs_sha256

    root, teacher = setup
    tok = _tok(small_tokenizer)
    recipe = ConvertRecipe(seq_len=32, long_len=64, batch_size=2, batch_long=2, docs=7, heldout_docs=0, doc_len=30,
                           sample_batch=3, s2_retrieval=0.0, s3_retrieval=0.0, stage_tokens=(64, 64, 128), seed=2)
    calls = []
    real = data_mod.sample_teacher_text

    def spy(*a, **k):
        calls.append((a[2], k["seed"]))
        return real(*a, **k)

    data_mod.sample_teacher_text = spy
    try:
        class Stop(RuntimeError):
            pass

        def stop(tr, row):
            raise Stop
        with pytest.raises(Stop):
            convert_model(teacher, tok, MASK, tmp_path / "c", recipe=recipe, progress=False, on_step=stop)
        assert calls == [(3, 20_000), (3, 20_001), (1, 20_002)]  # 7 documents in shards of 3, seeds 10,000 · 2 + k
        shards = sorted(p.name for p in (tmp_path / "c" / "data" / "docs").iterdir())
        assert shards == ["shard_0.pt", "shard_1.pt", "shard_2.pt"]
        want = [d for s in range(3) for d in sample_teacher_text(teacher, tok, [3, 3, 1][s], 30, seed=20_000 + s,
                                                                  batch_size=3, progress=False)]
        calls.clear()
        res = convert_model(teacher, tok, MASK, tmp_path / "c", recipe=recipe, progress=False, resume=True)
    finally:
        data_mod.sample_teacher_text = real
    assert calls == [] and res["finished"]  # nothing sampled again
    rec = json.loads((tmp_path / "c" / "stage3" / "training.json").read_text())
    assert rec["data"]["docs_sha256"] == docs_sha256(want) and rec["data"]["sample_dtype"] == "float32"
    assert rec["seeds"]["documents"] == [20_000, 20_001, 20_002]
