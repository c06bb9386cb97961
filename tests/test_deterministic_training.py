"""`headscope convert --deterministic` (issue 62 item 5): two conversions of a tiny model with the setting give
bit-equal weights and loss curves; the setting is recorded (training.json, done.json, the StepPlan) with the parts
it leaves nondeterministic; with it off the CPU losses are the same to float tolerance; PyTorch's flags come back
after a run; a checkpoint resumes only under its own setting; a bad CUBLAS_WORKSPACE_CONFIG is refused before
the teacher loads; the parts outside PyTorch's switch are listed for a CUDA student with fla, several ranks and an
old Inductor."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from headscope.cli import app
from headscope.masks import HeadMask
from headscope.train import ConvertRecipe, convert_model
from headscope.train.determinism import deterministic_mode, fa_kernel_override, nondeterministic_parts
from headscope.train.model_folder import load_model_folder

from conftest import tiny_llama
from test_convert import corpus_text

MASK = HeadMask(2, 4, 2, ((1,), (0, 3)))
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def setup(small_tokenizer, tmp_path_factory):
    root = tmp_path_factory.mktemp("det")
    teacher = tiny_llama(small_tokenizer, seed=3, d_model=32)
    teacher.save_pretrained(root / "teacher")
    small_tokenizer.save_pretrained(root / "teacher")
    (root / "corpus.txt").write_text(corpus_text())
    if small_tokenizer.pad_token_id is None:
        small_tokenizer.pad_token = small_tokenizer.eos_token
    return root, teacher, small_tokenizer


def _recipe(root):
    return ConvertRecipe(seq_len=128, long_len=256, batch_size=2, batch_long=2, corpus=str(root / "corpus.txt"),
                         stage_tokens=(2 * 2 * 128, 3 * 2 * 128, 2 * 2 * 256), ckpt_every=0)


def _convert(setup, out, **train_options):
    root, teacher, tok = setup
    res = convert_model(teacher, tok, MASK, out, recipe=_recipe(root), progress=False, train_options=train_options)
    assert res["finished"]
    weights = load_model_folder(out / "stage3").state_dict()
    curves = {k: json.loads((out / f"stage{k}" / "training.json").read_text()) for k in (1, 2, 3)}
    return weights, curves


def test_two_deterministic_conversions_are_bit_equal_and_recorded(setup, tmp_path):
    before = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic)
    w1, r1 = _convert(setup, tmp_path / "a", deterministic=True)
    w2, r2 = _convert(setup, tmp_path / "b", deterministic=True)
    assert sorted(w1) == sorted(w2) and all(torch.equal(w1[k], w2[k]) for k in w1)
    for k in (1, 2, 3):
        c1, c2 = r1[k]["loss_curve"]["rows"], r2[k]["loss_curve"]["rows"]
        assert len(c1) == {1: 2, 2: 3, 3: 2}[k] and c1 == c2  # every step's loss, bit for bit
        assert r1[k]["config"]["train"]["deterministic"] is True
        assert r1[k]["config"]["train_options"] == {"deterministic": True}
        plan = r1[k]["step_plan"]
        assert plan["deterministic"] is True and plan["nondeterministic"] == []  # a CPU, one process: nothing left
        done = json.loads((tmp_path / "a" / f"stage{k}" / "done.json").read_text())
        assert done["step_plan"]["deterministic"] is True
    # PyTorch's flags are the caller's again after the conversion
    assert (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic) == before

    # the same conversion without the setting: the same losses on the CPU, to float tolerance
    w0, r0 = _convert(setup, tmp_path / "off")
    for k in (1, 2, 3):
        assert r0[k]["step_plan"]["deterministic"] is False and r0[k]["config"]["train"]["deterministic"] is False
        on = torch.tensor([row[2] for row in r1[k]["loss_curve"]["rows"]], dtype=torch.float64)
        off = torch.tensor([row[2] for row in r0[k]["loss_curve"]["rows"]], dtype=torch.float64)
        torch.testing.assert_close(off, on, rtol=1e-5, atol=1e-6)
    for name in w1:
        torch.testing.assert_close(w0[name], w1[name], rtol=1e-4, atol=1e-5)


def test_a_checkpoint_resumes_only_under_its_own_setting(setup, tmp_path):
    from headscope.train.trainer import StopTraining

    def stop(tr, row):
        if tr.cfg.stage == 2 and tr.step == 1:
            raise StopTraining

    root, teacher, tok = setup
    out = tmp_path / "cut"
    res = convert_model(teacher, tok, MASK, out, recipe=_recipe(root), progress=False, on_step=stop,
                        train_options={"deterministic": True})
    assert not res["finished"] and (out / "stage2" / "checkpoint" / "trainer.json").exists()
    with pytest.raises(ValueError, match="written with --deterministic.*resume with it"):
        convert_model(teacher, tok, MASK, out, recipe=_recipe(root), progress=False, resume=True)
    res = convert_model(teacher, tok, MASK, out, recipe=_recipe(root), progress=False, resume=True,
                        train_options={"deterministic": True})
    assert res["finished"]


def test_deterministic_mode_sets_and_restores_the_flags(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    assert not torch.are_deterministic_algorithms_enabled()
    with deterministic_mode(True) as got:
        assert torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled()
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
        assert got["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        # an op without a deterministic version raises instead of running (warn_only=False), here on the CPU
        with pytest.raises(RuntimeError, match="deterministic"):
            torch.zeros(4).put_(torch.tensor([0, 0]), torch.tensor([1.0, 2.0]), accumulate=False)
    assert not torch.are_deterministic_algorithms_enabled()
    with deterministic_mode(False) as got:
        assert got == {} and not torch.are_deterministic_algorithms_enabled()


def test_the_parts_outside_pytorchs_switch_are_listed(small_tokenizer):
    from headscope.hybrid import hybridize

    teacher = tiny_llama(small_tokenizer, seed=3, d_model=32)
    student = hybridize(teacher, MASK)
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert nondeterministic_parts(student, cpu, fla=True, flash_attn=True, compiled=True, torch_version="2.9.0") == ()
    parts = nondeterministic_parts(student, cuda, world=2, compiled=True, fla=True, flash_attn=True, torch_version="2.9.1+cu128")
    assert len(parts) == 4
    assert parts[0].startswith("GDN heads: fla's Triton kernels") and "--gdn-kernel torch" in parts[0]
    assert parts[1].startswith("FA heads: flash-attn's backward")
    assert parts[2].startswith("torch.compile: Inductor before torch 2.10")
    assert parts[3].startswith("the gradient all-reduce over 2 ranks")
    # torch >= 2.10 compiles deterministically; no fla, no flash-attn, one process: nothing left on CUDA
    assert nondeterministic_parts(student, cuda, compiled=True, fla=False, flash_attn=False, torch_version="2.11.0") == ()
    torch_gdn = hybridize(teacher, MASK, gdn_kernel="torch", fa_kernel="sdpa")
    assert nondeterministic_parts(torch_gdn, cuda, compiled=True, fla=True, flash_attn=True, torch_version="2.11.0") == ()
    # convert: the FA heads with SDPA on CUDA where flash-attn would run; an explicit flash_attn is refused
    assert fa_kernel_override(True, {"fa_pos": "nope"}, "cpu") == {"fa_pos": "nope"}
    assert fa_kernel_override(False, {"fa_kernel": "flash_attn"}, "cuda") == {"fa_kernel": "flash_attn"}
    with pytest.raises(ValueError, match="flash_attn.*no deterministic backward"):
        fa_kernel_override(True, {"fa_kernel": "flash_attn"}, "cuda")


def test_cli_refuses_a_cublas_workspace_that_is_not_deterministic(setup, tmp_path, monkeypatch):
    root, _, _ = setup
    MASK.to_json(tmp_path / "mask.json")
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":0:0")
    r = CliRunner().invoke(app, ["convert", "--model", str(root / "teacher"), "--mask", str(tmp_path / "mask.json"),
                                 "--out", str(tmp_path / "o"), "--deterministic"])
    assert r.exit_code == 2 and "CUBLAS_WORKSPACE_CONFIG=':0:0'" in r.output, r.output
