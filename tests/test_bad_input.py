"""Issue #19: every bad input is reported before any work, as one line that names the fix, never a traceback.

One table of command lines (``headscope rank / convert / anatomy``) and one of API calls (``Pair``,
``hybridize``, ``select``, ``ablate``, ``Ranking.load``, ``HeadMask.from_json``, ``rank``,
``convert_stage``). Each case asserts exit code 2 (CLI) or a HeadscopeInputError (API), the message,
no traceback, and, where the input can be judged without the model, that no model was loaded (the
loaders are patched to fail) and that the error came within a few seconds.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

import headscope
import headscope.selectors
from headscope import HeadscopeInputError
from headscope.cli import app
from headscope.masks import HeadMask

FAST_S = 5.0  # an input judged without the model fails within this (the real model loads in ~10-45 s)


class ModelLoaded(AssertionError):
    pass


@pytest.fixture
def no_model(monkeypatch):
    """Every way to load weights or sample text fails the test."""
    import headscope.api
    import headscope.models
    import headscope.selectors
    import headscope.train.data

    def boom(*a, **k):
        raise ModelLoaded("a model was loaded (or text sampled) before the bad input was reported")

    for mod, name in [(headscope.models, "load_hf"), (headscope.models, "load_model"), (headscope, "load_model"),
                      (headscope.api, "load_model"), (headscope.selectors, "load_model"),
                      (headscope.train.data, "sample_teacher_text")]:
        monkeypatch.setattr(mod, name, boom)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a machine without CUDA


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Paths the cases refer to: a plain file, masks of SmolLM2 (30 x 9, 3 KV) and of another model,
    a saved run, conversion directories in several states, a rank store of another configuration."""
    root = tmp_path_factory.mktemp("bad")
    f = {"root": root, "file": root / "a_file.txt"}
    f["file"].write_text("not a directory\n")
    rng = np.random.default_rng(0)
    f["mask"] = HeadMask.select(rng.random((30, 9)), "7:1", 3, 1).to_json(root / "mask.json")
    f["other_mask"] = HeadMask(2, 4, 2, ((0,), (1,))).to_json(root / "other_mask.json")
    (root / "broken.json").write_text("{not json")
    f["broken"] = root / "broken.json"
    # a run directory (anatomy reads it); its model spec names a GGUF file that is gone
    from headscope.scores import Ranking, head_table

    ie = torch.tensor(rng.normal(size=(3, 2, 4)), dtype=torch.float32)
    prov = {"model": "gone", "model_spec": str(root / "gone.gguf"), "tasks": ["niah_single"],
            "task_settings": {"n_pairs": 3, "seq_len": 64, "seed": 0, "depth": 0.5}, "n_pairs": 3, "lambda": 0.9}
    Ranking(head_table(ie, 2), {"n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "d_head": 8, "d_model": 32, "n_ctx": 128},
            prov, ie).save(root / "run")
    # conversions: a finished stage 1, a stage-2 checkpoint of another plan, a stage-1 checkpoint
    for name in ("conv_s1", "conv_plan", "conv_ckpt"):
        (root / name / "stage1").mkdir(parents=True)
    for name in ("conv_s1", "conv_plan"):  # a finished stage-1 model folder (its record and config)
        (root / name / "stage1" / "training.json").write_text("{}")
        (root / name / "stage1" / "config.json").write_text("{}")
    (root / "conv_plan" / "stage2" / "checkpoint").mkdir(parents=True)
    (root / "conv_plan" / "stage2" / "checkpoint" / "trainer.json").write_text(json.dumps({"stage": 2, "total_steps": 99}))
    (root / "conv_ckpt" / "stage1" / "checkpoint").mkdir(parents=True)
    (root / "conv_ckpt" / "stage1" / "checkpoint" / "trainer.json").write_text(json.dumps({"stage": 1, "total_steps": 1}))
    (root / "corpus_empty.txt").write_text("\n\n  \n")
    # a rank run directory whose store holds another lambda
    (root / "old_rank" / "receivers").mkdir(parents=True)
    (root / "old_rank" / "receivers" / "config.json").write_text(json.dumps({
        "kind": "receivers", "lam": 0.5, "direction": "noising", "tasks": ["niah_single"],
        "settings": {"n_pairs": 6, "seq_len": 512, "seed": 0, "depth": 0.5}, "model": {"model_spec": "smollm2-135m"}}))
    return f


def _conv(files, *extra, out="conv_new"):
    return ["convert", "--mask", str(files["mask"]), "--tokens", "4096", "--out", str(files["root"] / out),
            "--device", "cpu", *extra]


# (id, argv builder, text the message must contain)
CLI_CASES = [
    # ---- headscope rank
    ("rank-missing-gguf", lambda f: ["rank", "--model", str(f["root"] / "nope.gguf")], "does not exist; pass an existing .gguf"),
    ("rank-uncached-hub-id", lambda f: ["rank", "--model", "someorg/not-a-cached-model"], "not in the local Hugging Face cache"),
    ("rank-unknown-task", lambda f: ["rank", "--task", "niah_everything"], "unknown task(s) ['niah_everything']; available:"),
    ("rank-zero-pairs", lambda f: ["rank", "--pairs", "0"], "--pairs=0: need at least one calibration pair"),
    ("rank-depth-1.5", lambda f: ["rank", "--depth", "1.5"], "--depth=1.5 must lie in [0, 1]"),
    ("rank-bad-direction", lambda f: ["rank", "--direction", "sideways"], "--direction='sideways' is not one of noising, denoising"),
    ("rank-budget-7:0", lambda f: ["rank", "--budget", "7:0"], "leaves no FA head"),
    ("rank-budget-300", lambda f: ["rank", "--budget", "300"], "outside 1..270 (the model has 270 heads)"),
    ("rank-budget-lots", lambda f: ["rank", "--budget", "lots"], "'lots' is not a count, a fraction or an 'LA:FA' ratio"),
    ("rank-budget-7-1", lambda f: ["rank", "--budget", "7-1"],
     "budget '7-1' is not a count, a fraction or an 'LA:FA' ratio; write e.g. 34 (FA heads), 0.125 (a fraction of the "
     "heads) or 7:1 (LA:FA)"),
    ("rank-weights-sum", lambda f: ["rank", "--task", "niah_single", "--task", "niah_multikey", "--weight", "0.5",
                                    "--weight", "0.6"], "sum to 1.1, not 1; rescale them"),
    ("rank-bad-mode", lambda f: ["rank", "--mode", "fast"], "--mode='fast' is not one of exact, screen"),
    ("rank-out-is-a-file", lambda f: ["rank", "--out", str(f["file"])], "is a file, not a directory; pass a directory"),
    ("rank-cuda-without-cuda", lambda f: ["rank", "--device", "cuda"], "use --device cpu"),
    ("rank-negative-lambda", lambda f: ["rank", "--lambda", "-1"], "--lambda=-1.0 must lie in (0, 1]"),
    ("rank-min-per-layer", lambda f: ["rank", "--min-per-layer", "10"], "--min-per-layer=10 is more than the 9 heads"),
    ("rank-verify-most", lambda f: ["rank", "--mode", "screen", "--verify", "most"], "--verify 'most': use auto, a head count"),
    ("rank-device-map-and-devices", lambda f: ["rank", "--device-map", "auto", "--devices", "2"], "use one of them"),
    ("rank-seq-len-past-context", lambda f: ["rank", "--seq-len", "9000"], "the model's context is 8192 tokens; use a shorter"),
    ("rank-zero-devices", lambda f: ["rank", "--devices", "0"], "--devices=0 must be >= 1"),
    ("rank-resume-other-config", lambda f: ["rank", "--out", str(f["root"] / "old_rank")], "another configuration (differs in: lam)"),
    ("rank-resume-other-seq-len", lambda f: ["rank", "--out", str(f["root"] / "old_rank"), "--lambda", "0.5", "--seq-len", "256"],
     "differs in: settings.seq_len: 512 stored, 256 now"),
    ("rank-normalize-typo", lambda f: ["rank", "--normalize", "mean"], "--normalize='mean' is not one of max, minmax"),
    ("rank-unknown-kappa", lambda f: ["rank", "--senders", "--kappa", "attention"], "--kappa='attention' is not one of focus, one"),
    # ---- headscope convert
    ("convert-stage-4", lambda f: _conv(f, "--stage", "4"), "--stage 4 does not exist; use 1 (layer-wise alignment)"),
    ("convert-zero-tokens", lambda f: _conv(f, "--stage", "1", "--tokens", "0"), "--tokens='0' must be a whole number of tokens >= 1"),
    ("convert-tokens-typo", lambda f: _conv(f, "--tokens", "12.5X"), "--tokens='12.5X' is not a token count; write e.g. 12.5M"),
    ("convert-stage-tokens-two", lambda f: _conv(f, "--stage-tokens", "1M,2M"), "--stage-tokens '1M,2M': give three budgets"),
    ("convert-shares-sum", lambda f: _conv(f, "--shares", "0.2,0.5,0.5"), "--shares=[0.2, 0.5, 0.5]: give three positive shares summing to 1"),
    ("convert-s3-wordings-7", lambda f: _conv(f, "--s3-wordings", "7"), "--s3-wordings=7 must be in 1..6; the train family has 6 wordings"),
    ("convert-fa-pos-alibi", lambda f: _conv(f, "--fa-pos", "alibi"), "--fa-pos='alibi' is not one of nope, rope"),
    ("convert-seq-len-short-for-retrieval", lambda f: _conv(f, "--seq-len", "64"), "--seq-len=64 is too short for the stage-2 retrieval rows"),
    ("convert-resume-nothing", lambda f: _conv(f, "--resume", out="conv_empty"), "holds no conversion to continue; start without --resume"),
    ("convert-devices-over-batch", lambda f: _conv(f, "--devices", "4", "--batch-long", "2"), "cannot feed 4 processes"),
    ("convert-finished-without-resume", lambda f: _conv(f, "--stage", "1", out="conv_s1"), "holds a finished stage: pass --resume"),
    ("convert-missing-mask", lambda f: ["convert", "--mask", str(f["root"] / "nope.json"), "--stage", "1", "--tokens", "9",
                                        "--out", str(f["root"] / "c")], "nope.json does not exist; pass the mask.json"),
    ("convert-broken-mask", lambda f: ["convert", "--mask", str(f["broken"]), "--stage", "1", "--tokens", "9",
                                       "--out", str(f["root"] / "c")], "is not JSON"),
    ("convert-mask-of-another-model", lambda f: ["convert", "--mask", str(f["other_mask"]), "--stage", "1", "--tokens", "9",
                                                 "--out", str(f["root"] / "c")], "rank this model first"),
    ("convert-stage2-without-stage1", lambda f: _conv(f, "--stage", "2"), "stage1 is not a finished stage: stage 2 starts from stage 1's model folder"),
    ("convert-resume-without-checkpoint", lambda f: _conv(f, "--stage", "2", "--resume", out="conv_s1"),
     "holds no conversion to continue"),
    ("convert-resume-other-plan", lambda f: _conv(f, "--stage", "2", "--resume", out="conv_plan"),
     "checkpoint planned 99 steps, this run 1: resume with the same --tokens"),
    ("convert-checkpoint-without-resume", lambda f: _conv(f, "--stage", "1", out="conv_ckpt"), "stage1 holds a checkpoint: pass --resume to continue"),
    ("convert-missing-corpus", lambda f: _conv(f, "--stage", "1", "--corpus", str(f["root"] / "nope.txt")),
     "nope.txt does not exist; pass a UTF-8 text file"),
    ("convert-empty-corpus", lambda f: _conv(f, "--stage", "1", "--corpus", str(f["root"] / "corpus_empty.txt")), "is empty"),
    ("convert-unknown-seen-task", lambda f: _conv(f, "--stage", "3", "--s3-seen-task", "nope"),
     "--s3-seen-task='nope' is not one of"),
    ("convert-s3-retrieval-1", lambda f: _conv(f, "--stage", "3", "--s3-retrieval", "1"), "--s3-retrieval=1.0 must lie in [0, 0.9]"),
    ("convert-zero-lr", lambda f: _conv(f, "--stage", "1", "--lr", "1e-3,0,1e-4"), "--lr (stage 2)=0.0 must lie in (0, inf)"),
    ("convert-one-lr", lambda f: _conv(f, "--lr", "1e-3"), "--lr '1e-3': give 3 comma-separated numbers"),
    ("convert-bad-gdn-kernel", lambda f: _conv(f, "--stage", "1", "--gdn-kernel", "fast"), "is not one of auto, torch, fla"),
    ("convert-batch-over-rows", lambda f: _conv(f, "--stage", "1", "--docs", "5", "--doc-len", "510",
                                                "--seq-len", "512", "--batch-size", "8"),
     "4 training document(s) of 510 tokens make 4 row(s) of 512 tokens for stage 1, fewer than --batch-size=8"),
    ("convert-too-little-text", lambda f: _conv(f, "--stage", "1", "--docs", "1", "--doc-len", "8"), "make 0 row(s)"),
    ("convert-out-is-a-file", lambda f: _conv(f, "--stage", "1", out="a_file.txt"), "is a file, not a directory"),
    ("convert-cuda-without-cuda", lambda f: _conv(f, "--stage", "1", "--device", "cuda"), "use --device cpu"),
    # ---- a model spec that reads as a path (eval / generate)
    ("eval-mistyped-stage", lambda f: ["eval", str(f["root"] / "conv_plan" / "stage4"), "--out", str(f["root"] / "ev")],
     "stage4 does not exist; the model folders in {root}{sep}conv_plan: stage1"),
    ("generate-mistyped-stage", lambda f: ["generate", str(f["root"] / "conv_s1" / "stage9"), "hi"],
     "stage9 does not exist; the model folders in {root}{sep}conv_s1: stage1"),
    ("eval-missing-parent", lambda f: ["eval", str(f["root"] / "nowhere" / "stage1"), "--out", str(f["root"] / "ev")],
     "nowhere{sep}stage1 does not exist (nor does its folder {root}{sep}nowhere); check the path"),
    ("eval-relative-typo", lambda f: ["eval", "./no-such-model-dir", "--out", str(f["root"] / "ev")],
     "no-such-model-dir does not exist"),
    ("eval-conversion-folder", lambda f: ["eval", str(f["root"] / "conv_plan"), "--out", str(f["root"] / "ev")],
     "conv_plan is a `headscope convert` output folder: pass its last stage, {root}{sep}conv_plan{sep}stage1"),
    ("generate-conversion-folder-unfinished", lambda f: ["generate", str(f["root"] / "conv_ckpt"), "hi"],
     "conv_ckpt is a `headscope convert` output folder without a finished stage"),
    # ---- headscope mask
    ("mask-kv-layers-99", lambda f: ["mask", str(f["root"] / "run"), "--kv-layers", "99", "--budget", "7:1"],
     "--kv-layers=99 must be in 1..2; the KV budget counts whole layers' caches and the model has 2 layers"),
    # ---- headscope anatomy
    ("anatomy-missing-run", lambda f: ["anatomy", str(f["root"] / "nothing")], "is missing (no such directory)"),
    ("anatomy-run-is-a-file", lambda f: ["anatomy", str(f["file"])], "is a file, not a run directory"),
    ("anatomy-bad-format", lambda f: ["anatomy", str(f["root"] / "run"), "--no-model", "--format", "gif"],
     "--format='gif' is not one of html, png"),
    ("anatomy-negative-threshold", lambda f: ["anatomy", str(f["root"] / "run"), "--no-model", "--threshold", "-1"],
     "--threshold=-1.0 must lie in [0, inf)"),
    ("anatomy-zero-boot", lambda f: ["anatomy", str(f["root"] / "run"), "--no-model", "--boot", "0"], "--boot=0 must be >= 1"),
    ("anatomy-model-gone", lambda f: ["anatomy", str(f["root"] / "run"), "--format", "html"],
     "gone.gguf does not exist; pass an existing .gguf path (the run's model cannot be loaded: pass --no-model"),
]


def _check_fast_cli(argv, want, files):
    t0 = time.perf_counter()
    res = CliRunner().invoke(app, argv)
    dt = time.perf_counter() - t0
    assert res.exit_code == 2, (res.exit_code, res.output, res.exception)
    assert not isinstance(res.exception, AssertionError)  # the model loader was not called
    assert "Traceback" not in res.output
    assert want in res.output, res.output
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), res.output
    assert dt < FAST_S, f"{dt:.1f} s to the error"


@pytest.mark.parametrize("case", CLI_CASES, ids=[c[0] for c in CLI_CASES])
def test_cli_bad_input(case, files, no_model):
    _, argv, want = case
    _check_fast_cli(argv(files), want.replace("{root}", str(files["root"])).replace("{sep}", os.sep), files)


def test_the_table_is_large_enough():
    assert len(CLI_CASES) + len(API_CASES) >= 25
    assert len({c[0] for c in CLI_CASES + API_CASES}) == len(CLI_CASES) + len(API_CASES)


# ---------------------------------------------------------------------------------------------- API
def _tiny_teacher(n_layers=2):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=n_layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return LlamaForCausalLM(cfg).eval()


def _loaded():
    from types import SimpleNamespace

    from headscope.models import wrap

    return wrap(_tiny_teacher(), SimpleNamespace(pad_token_id=0, eos_token="</s>"), name="tiny")


def _pair_same_answer(f):
    from headscope.tasks import Pair

    Pair(torch.tensor([1, 2, 3, 4]), torch.tensor([1, 5, 3, 4]), torch.tensor([7, 8]), torch.tensor([7, 8]), (1, 2))


def _convert_stage_without_student(f):
    from headscope.train import TrainConfig, convert_stage

    convert_stage(None, None, HeadMask(2, 4, 2, ((0,), (1,))), 2, f["root"] / "api_conv",
                  config=TrainConfig(stage=2, tokens=100))


# (id, call, exception type it must also be, text)
API_CASES = [
    ("pair-answer-equals-counter-answer", _pair_same_answer, ValueError, "gap m(x) - m(x') is 0 by construction"),
    ("hybridize-mask-of-another-model", lambda f: headscope.hybridize(_tiny_teacher(3), HeadMask(2, 4, 2, ((0,), (1,)))),
     ValueError, "rank this model first"),
    ("hybridize-unsupported-model", lambda f: headscope.hybridize(torch.nn.Linear(2, 2), HeadMask(2, 4, 2, ((0,), (1,)))),
     TypeError, "hybridize supports"),
    ("hybridize-mask-path-missing", lambda f: headscope.hybridize(_tiny_teacher(), f["root"] / "nope.json"),
     FileNotFoundError, "does not exist"),
    ("ranking-load-missing", lambda f: headscope.Ranking.load(f["root"] / "nothing"), FileNotFoundError, "is missing"),
    ("ranking-load-no-csv", lambda f: headscope.Ranking.load(f["root"]), FileNotFoundError, "scores.csv is missing"),
    ("headmask-from-json-broken", lambda f: HeadMask.from_json(f["broken"]), ValueError, "is not JSON"),
    ("headmask-from-json-not-a-mask", lambda f: (f["root"] / "x.json").write_text("{}") and HeadMask.from_json(f["root"] / "x.json"),
     ValueError, "not a headscope HeadMask"),
    ("select-unknown-method", lambda f: headscope.selectors.select("smollm2-135m", "nope"), ValueError, "unknown selector"),
    ("select-bad-literal", lambda f: headscope.selectors.select("smollm2-135m", "duo_gates", granularity="layer"),
     ValueError, "granularity='layer' is not one of head, kv_group"),
    ("select-missing-model", lambda f: headscope.selectors.select(str(f["root"] / "nope.gguf"), "random"),
     ValueError, "does not exist"),
    ("select-causal-lambda", lambda f: headscope.selectors.select("smollm2-135m", "causal", lam=2.0), ValueError,
     "lam=2.0 must lie in (0, 1]"),
    ("ablate-head-outside", lambda f: headscope.ablate(_loaded(), [(5, 0)]).__enter__(), ValueError, "outside the model"),
    ("ablate-bad-method", lambda f: headscope.ablate(_loaded(), [(0, 0)], method="melt").__enter__(), ValueError,
     "unknown ablation method 'melt'"),
    ("rank-api-task-setting", lambda f: headscope.rank("smollm2-135m", task_settings={"n_digit": 3}), ValueError,
     "['n_digit'] are not settings of task 'niah_single'"),
    ("rank-api-cuda", lambda f: headscope.rank("smollm2-135m", device="cuda"), ValueError, "use device cpu"),
    ("rank-api-dtype", lambda f: headscope.rank("smollm2-135m", dtype=torch.int8), ValueError, "torch.bfloat16"),
    ("convert-stage-api-no-student", _convert_stage_without_student, FileNotFoundError, "stage1/training.json does not exist"),
]


@pytest.mark.parametrize("case", API_CASES, ids=[c[0] for c in API_CASES])
def test_api_bad_input(case, files, no_model):
    _, call, also, want = case
    t0 = time.perf_counter()
    with pytest.raises(HeadscopeInputError) as ei:
        call(files)
    assert time.perf_counter() - t0 < FAST_S
    assert isinstance(ei.value, also)  # existing `except ValueError / FileNotFoundError / TypeError` keep working
    assert want in str(ei.value), str(ei.value)


# ------------------------------------------------------------------------------ geometry without weights
def test_geometry_is_read_without_weights(tiny_dir):
    """The checks judge budgets, masks and context lengths from the config / GGUF metadata alone."""
    from headscope.models import check_model
    from headscope.model_specs import Geometry
    from headscope.models import load_model

    t0 = time.perf_counter()
    g = check_model("smollm2-135m")  # the GGUF header of SmolLM2-135M-Instruct
    assert time.perf_counter() - t0 < 2.0
    # the values the loaded model reports (checked once against load_model: 45 s on this machine)
    assert g == Geometry(n_layers=30, n_heads=9, n_kv_heads=3, d_head=64, d_model=576, n_ctx=8192)
    assert check_model(str(tiny_dir)) == load_model(str(tiny_dir), device="cpu").geometry


# ------------------------------------------------------------------------------ after the model loads
def test_prompt_too_short_is_one_line_after_the_model_loads(tiny_dir, tmp_path, monkeypatch):
    """A prompt too short for the task's text needs the tokenizer: reported after the load, before the sweep."""
    import headscope.patching.receivers as rec

    def boom(*a, **k):
        raise ModelLoaded("the sweep started")

    monkeypatch.setattr(rec, "receiver_patching", boom)
    monkeypatch.setattr(headscope.api, "receiver_patching", boom)
    res = CliRunner().invoke(app, ["rank", "--model", str(tiny_dir), "--seq-len", "20", "--budget", "2",
                                   "--out", str(tmp_path / "r"), "--device", "cpu"])
    assert res.exit_code == 2, (res.output, res.exception)
    assert "seq_len=20 is shorter than niah_single's fixed text and answer" in res.output
    assert "raise seq_len" in res.output and "Traceback" not in res.output


def test_unexpected_errors_keep_their_traceback(monkeypatch):
    """A bug is not an input error: the CLI lets it through (exit 1, the exception kept for the traceback)."""
    import headscope.models

    def bug(*a, **k):
        raise KeyError("a bug")

    monkeypatch.setattr(headscope.models, "check_model", bug)
    res = CliRunner().invoke(app, ["rank"])
    assert res.exit_code == 1 and isinstance(res.exception, KeyError)


@pytest.mark.slow
def test_subprocess_prints_one_line_without_traceback(files):
    """The real console path (rich tracebacks on): `rank --out FILE` was a NotADirectoryError traceback."""
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-m", "headscope.cli", "rank", "--out", str(files["file"])],
                       capture_output=True, text=True, timeout=300, cwd=Path(headscope.__file__).parent.parent)
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stdout + p.stderr
    assert p.stderr.strip().splitlines() == [f"error: --out {files['file']} is a file, not a directory; pass a directory "
                                             "path (created when missing)"]
    # the installed command's entry (headscope.__main__, its garbage collection tuned): after Triton is imported,
    # still one line (freezing every object at exit made nanobind print ~30 lines of "leaked instance" after it)
    p = subprocess.run([sys.executable, "-m", "headscope", "rank", "--pairs", "0"], capture_output=True, text=True,
                       timeout=300, cwd=Path(headscope.__file__).parent.parent)
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip().splitlines() == ["error: --pairs=0: need at least one calibration pair per task"]


def test_one_slash_path_typo_is_a_path_error(tmp_path, monkeypatch):
    """'runs/stage9' reads as a hub id 'org/name'; where ./runs is a local folder it was a path with a typo: the error
    names the folder's model folders instead of the Hugging Face cache."""
    from headscope.models import ModelSpecError, check_model

    for name in ("stage1", "stage2"):
        (tmp_path / "runs" / name).mkdir(parents=True)
        (tmp_path / "runs" / name / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelSpecError, match=r"^runs.stage9 does not exist; the model folders in runs: stage1, stage2$"):
        check_model("runs/stage9")
    with pytest.raises(ModelSpecError, match="not in the local Hugging Face cache"):  # no local folder 'someorg'
        check_model("someorg/stage9")
