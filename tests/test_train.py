"""Three-stage transfer trainer: losses against hand-computed references, exact-copy student, exact
resume, tiny end-to-end run of all three stages (CLI)."""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch
import torch.nn.functional as F

from headscope.hybrid import hybridize
from headscope.masks import HeadMask
from headscope.train import (
    DataConfig,
    Loader,
    StopTraining,
    TokenRows,
    TrainConfig,
    Trainer,
    alignment_loss,
    distillation_loss,
    lm_loss,
    pack,
    retrieval_rows,
    stage_loss,
)

from conftest import Vocab, tiny_llama


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def teacher():
    return tiny_llama(Vocab(), seed=3, n_layers=2, n_heads=4, n_kv=2, d_model=64)


@pytest.fixture(scope="module")
def teacher_full_vocab(smol_tokenizer):
    return tiny_llama(smol_tokenizer, seed=3, n_layers=2, n_heads=4, n_kv=2, d_model=64)


def _mask(fa):
    return HeadMask(2, 4, 2, fa)


def _rows(n=8, T=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (n, T), generator=g)
    return TokenRows(ids, torch.ones_like(ids, dtype=torch.bool))


# ------------------------------------------------------------------------------------------- data
def test_pack_by_hand():
    rows = pack([[1, 2, 3], [4, 5], [6]], seq_len=4, eos_id=0)
    # stream 1 2 3 0 4 5 0 6 0 -> two rows, the last token dropped
    assert rows.ids.tolist() == [[1, 2, 3, 0], [4, 5, 0, 6]]
    assert rows.mask.all()
    with pytest.raises(ValueError, match="fewer than one row"):
        pack([[1]], seq_len=8, eos_id=0)


def test_loader_state_resumes_the_same_batches():
    rows = _rows(n=10, T=4)
    a = Loader(rows, batch_size=3, seed=5)
    seq = [a.next()[0] for _ in range(7)]  # crosses epochs (3 batches per epoch)
    b = Loader(rows, batch_size=3, seed=5)
    for _ in range(4):
        b.next()
    c = Loader(rows, batch_size=3, seed=5)
    c.load_state_dict(b.state_dict())
    for want in seq[4:]:
        assert torch.equal(c.next()[0], want)
    # every epoch is a permutation of distinct rows
    epoch0 = torch.cat(seq[:3])
    assert len({tuple(r) for r in epoch0.tolist()}) == 9
    with pytest.raises(ValueError, match="same data settings"):
        Loader(_rows(n=11, T=4), 3, seed=5).load_state_dict(b.state_dict())


def test_retrieval_rows_hold_prompt_and_answer(smol_tokenizer):
    from headscope.tasks import niah_single

    rows = retrieval_rows(smol_tokenizer, n=3, seq_len=160, seed=1, lengths=[120, 150])
    assert rows.ids.shape == (3, 160)
    for i in range(3):
        n = int(rows.mask[i].sum())
        assert rows.mask[i, :n].all() and not rows.mask[i, n:].any()
        text = smol_tokenizer.decode(rows.ids[i, :n])
        assert "The special magic number is" in text
        needle = text.split("The special magic number is ")[1][:4]
        assert text.rstrip().endswith(needle)  # the answer is the needle's value
    assert niah_single  # the generator used


# ------------------------------------------------------------------------------------------- losses
def test_alignment_loss_equals_brute_force(teacher):
    student = hybridize(teacher, _mask(((1,), (0, 3))))
    torch.manual_seed(0)
    for p in student.parameters():  # move away from the migrated start so the loss is non-trivial
        p.data.add_(0.02 * torch.randn_like(p))
    ids = _rows(n=2, T=24).ids
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[1, 20:] = False
    total, per = alignment_loss(student, teacher, ids, mask)
    # reference: re-run the teacher layer by layer by hand
    with torch.no_grad():
        hs = teacher(input_ids=ids, output_hidden_states=True).hidden_states
        pos = torch.arange(24)[None]
        pe = teacher.model.rotary_emb(hs[0], pos)
        want = []
        for l, (tl, sl) in enumerate(zip(teacher.model.layers, student.model.layers)):
            h = tl.input_layernorm(hs[l])
            y_t = tl.self_attn(h, position_embeddings=pe, attention_mask=None)[0][mask]  # real tokens, channels
            y_s = sl.self_attn(h, position_embeddings=pe)[0][mask]
            want.append(((y_s - y_t) ** 2).mean() / ((y_t - y_t.mean(0)) ** 2).mean())
    assert torch.allclose(per, torch.stack(want), rtol=1e-4, atol=1e-7)
    assert torch.allclose(total, torch.stack(want).mean(), rtol=1e-4)
    assert (per > 1e-3).all()


def test_distillation_and_lm_loss_by_hand():
    g = torch.Generator().manual_seed(0)
    s, t = torch.randn(2, 3, 5, generator=g), torch.randn(2, 3, 5, generator=g)
    mask = torch.tensor([[True, True, False], [True, True, False]])
    kl = []
    for b, i in [(0, 0), (0, 1), (1, 0), (1, 1)]:
        p = torch.softmax(t[b, i].double(), -1)
        q = torch.softmax(s[b, i].double(), -1)
        kl.append(float((p * (p / q).log()).sum()))
    assert distillation_loss(s, t, mask).item() == pytest.approx(sum(kl) / 4, rel=1e-5)
    ids = torch.tensor([[1, 2, 3], [4, 4, 0]])
    # positions with a real input and a real target: b0 t0 -> 2, b1 t0 -> 4
    ce = [-float(torch.log_softmax(s[0, 0], -1)[2]), -float(torch.log_softmax(s[1, 0], -1)[4])]
    assert lm_loss(s, ids, mask).item() == pytest.approx(sum(ce) / 2, rel=1e-5)
    with pytest.raises(ValueError, match="share the tokenizer"):
        distillation_loss(s, t[..., :4], mask)


def test_exact_copy_student_has_zero_loss_and_gradients(teacher):
    """All heads FA, no fusion norm: the student computes the teacher's function exactly."""
    student = hybridize(teacher, _mask(((0, 1, 2, 3), (0, 1, 2, 3))), fusion="none")
    ids = _rows(n=2, T=32).ids
    mask = torch.ones_like(ids, dtype=torch.bool)
    for stage in (1, 2):
        from headscope.train import trainable_parameters

        params = trainable_parameters(student, stage)
        student.zero_grad(set_to_none=True)
        loss, _ = stage_loss(stage, student, teacher, ids, mask)
        loss.backward()
        assert abs(loss.item()) <= 1e-6, (stage, loss.item())
        gmax = max(float(p.grad.abs().max()) for _, p in params if p.grad is not None)
        assert gmax <= 1e-6, (stage, gmax)
        n_with_grad = sum(p.grad is not None for _, p in params)
        assert n_with_grad == len(params)  # the gradient reached every trained parameter, and it is zero
    # sanity: a perturbed student has a clearly non-zero loss and gradient
    student.model.layers[0].self_attn.v_proj.weight.data.add_(0.05)
    student.zero_grad(set_to_none=True)
    loss, _ = stage_loss(1, student, teacher, ids, mask)
    loss.backward()
    assert loss.item() > 1e-3
    assert float(student.model.layers[0].self_attn.v_proj.weight.grad.abs().max()) > 1e-4


# ------------------------------------------------------------------------------------------- trainer
def _trainer(teacher, out, stage=2, ckpt_every=0, ckpt_on_exit=True, resume=False, student=None):
    student = student or hybridize(teacher, _mask(((1,), (0, 3))))
    cfg = TrainConfig(
        stage=stage, tokens=6 * 2 * 32, batch_size=2, lr=3e-3, warmup=0.2, ckpt_every=ckpt_every,
        ckpt_on_exit=ckpt_on_exit, progress=False, seed=1,
    )
    return Trainer(student, teacher, _rows(n=5, T=32, seed=2), cfg, out, resume=resume)


def test_resume_equals_uninterrupted(teacher, tmp_path):
    full = _trainer(teacher, tmp_path / "full")
    s_full = full.run()
    assert s_full["finished"] and s_full["steps"] == 6
    want = full.student.state_dict()

    def stop_at(k):
        def cb(tr, row):
            if tr.step == k:
                raise StopTraining
        return cb

    # 1) interrupted after 3 steps (checkpoint on exit), resumed in a fresh process state
    a = _trainer(teacher, tmp_path / "a")
    assert a.run(on_step=stop_at(3))["steps"] == 3
    torch.manual_seed(123)  # disturb the global RNG: resume must restore it
    a2 = _trainer(teacher, tmp_path / "a", resume=True)
    assert a2.step == 3
    a2.run()
    # 2) hard kill after step 3 with no exit checkpoint: resume from the step-2 checkpoint, replay step 3
    b = _trainer(teacher, tmp_path / "b", ckpt_every=2, ckpt_on_exit=False)
    b.run(on_step=stop_at(3))
    b2 = _trainer(teacher, tmp_path / "b", ckpt_every=2, resume=True)
    assert b2.step == 2
    b2.run()
    for tr in (a2, b2):
        got = tr.student.state_dict()
        assert all(torch.equal(got[k], want[k]) for k in want)
    changed = [k for k, v in want.items() if not torch.equal(v, hybridize(teacher, _mask(((1,), (0, 3)))).state_dict()[k])]
    assert changed  # training moved the weights
    # the log of the resumed run is continuous: steps 1..6 once each (run a) / step 3 twice (run b, replayed)
    steps = [json.loads(x)["step"] for x in (tmp_path / "a" / "log.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]
    with pytest.raises(FileExistsError, match="resume"):
        _trainer(teacher, tmp_path / "a")


class _SigintDuringStep:
    """The trainer's step with ``signals`` SIGINTs sent to this process in the middle of step ``at`` (after the
    batch was taken from the loader, before the gradients): what a user's Ctrl-C does during a step."""

    def __init__(self, trainer, at, signals):
        self.inner, self.trainer, self.at, self.signals = trainer.step_fn, trainer, at, signals

    def __call__(self, ids, mask):
        if self.trainer.step + 1 == self.at:
            for _ in range(self.signals):
                os.kill(os.getpid(), signal.SIGINT)
        return self.inner(ids, mask)

    def close(self):
        self.inner.close()


def _uninterrupted(teacher, out):
    tr = _trainer(teacher, out)
    assert tr.run()["finished"]
    return tr.student.state_dict()


def test_ctrl_c_in_a_step_stops_after_it_and_resumes_exactly(teacher, tmp_path):
    """One Ctrl-C in step 3 finishes step 3, writes its checkpoint and stops; the resumed run's weights equal the
    uninterrupted run's bit for bit; the SIGINT handler in place before run() is back after it."""
    want = _uninterrupted(teacher, tmp_path / "full")
    before = signal.getsignal(signal.SIGINT)
    a = _trainer(teacher, tmp_path / "a")
    a.step_fn = _SigintDuringStep(a, at=3, signals=1)
    s = a.run()
    assert (s["steps"], s["stopped"], s["exit_checkpoint"]) == (3, "interrupted", True)
    assert signal.getsignal(signal.SIGINT) is before
    a2 = _trainer(teacher, tmp_path / "a", resume=True)
    assert a2.step == 3
    a2.run()
    got = a2.student.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("cut", ["second_ctrl_c", "error"])
def test_a_step_cut_in_the_middle_keeps_the_last_complete_checkpoint(teacher, tmp_path, cut):
    """A second Ctrl-C (KeyboardInterrupt at once) or an error inside step 3, after its batch was taken: no exit
    checkpoint is written, the step-2 checkpoint stays, and resuming from it gives the uninterrupted weights.
    (Before this, the exit checkpoint said step 2 with the loader already past step 3's batch: resume skipped it.)"""
    want = _uninterrupted(teacher, tmp_path / "full")
    b = _trainer(teacher, tmp_path / "b", ckpt_every=2)
    if cut == "second_ctrl_c":
        b.step_fn = _SigintDuringStep(b, at=3, signals=2)
        s = b.run()
        assert (s["steps"], s["stopped"], s["exit_checkpoint"]) == (2, "interrupted", False)
    else:
        inner = b.step_fn

        class Failing:
            def __call__(self, ids, mask):
                if b.step + 1 == 3:
                    raise RuntimeError("CUDA out of memory (simulated)")
                return inner(ids, mask)

            def close(self):
                inner.close()

        b.step_fn = Failing()
        with pytest.raises(RuntimeError, match="simulated"):
            b.run()
    b2 = _trainer(teacher, tmp_path / "b", ckpt_every=2, resume=True)
    assert b2.step == 2
    b2.run()
    got = b2.student.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_stage1_trains_only_attention_and_lowers_the_loss(teacher, tmp_path):
    student = hybridize(teacher, _mask(((1,), (0, 3))))
    frozen = {k: v.clone() for k, v in student.state_dict().items() if ".self_attn." not in k}
    cfg = TrainConfig(stage=1, tokens=12 * 4 * 32, batch_size=4, lr=1e-2, progress=False, ckpt_on_exit=False)
    tr = Trainer(student, teacher, _rows(n=4, T=32), cfg, tmp_path)
    s = tr.run()
    rows = [json.loads(x) for x in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert {"align_l0", "align_l1"} <= set(rows[0])
    assert rows[-1]["loss"] < 0.8 * rows[0]["loss"]
    assert s["finished"] and (tmp_path / "done.json").exists()
    assert not (tmp_path / "student.pt").exists()  # only with save_student (convert_stage writes a model folder)
    sd = student.state_dict()
    assert all(torch.equal(sd[k], v) for k, v in frozen.items())


@pytest.mark.slow
def test_cli_convert_one_stage_at_a_time(teacher_full_vocab, smol_tokenizer, tmp_path):
    """`--stage K` runs one stage from the previous stage's folder; the plain step; --resume of a finished stage."""
    from typer.testing import CliRunner

    from headscope.cli import app
    from headscope.train.model_folder import load_model_folder

    mdir = tmp_path / "teacher"
    teacher_full_vocab.save_pretrained(mdir)
    smol_tokenizer.save_pretrained(mdir)
    _mask(((1,), (0, 3))).to_json(tmp_path / "mask.json")
    words = "The farmer walked to the harbour in the morning. A young painter looked at an empty barn after the rain."
    (tmp_path / "corpus.txt").write_text("\n\n".join(words for _ in range(30)))
    out = tmp_path / "conv"
    common = ["convert", "--model", str(mdir), "--mask", str(tmp_path / "mask.json"), "--out", str(out),
              "--device", "cpu", "--corpus", str(tmp_path / "corpus.txt"), "--seq-len", "128", "--long-len", "160",
              "--batch-size", "2", "--batch-long", "2", "--ckpt-every", "2", "--stage-tokens", "768,768,960"]
    runner = CliRunner()
    r = runner.invoke(app, common + ["--stage", "2"])
    assert r.exit_code == 2 and "run the previous stage first" in r.output
    for stage in (1, 2, 3):
        r = runner.invoke(app, common + ["--stage", str(stage)])
        assert r.exit_code == 0, r.output
        summary = json.loads(r.output[r.output.index('{"' + str(stage) + '"') :].splitlines()[0])[str(stage)]
        assert summary["finished"] and summary["steps"] == 3
        log = (out / f"stage{stage}" / "log.csv").read_text().splitlines()
        assert len(log) == 4 and log[0].startswith("stage,step,tokens,loss")
        rec = json.loads((out / f"stage{stage}" / "training.json").read_text())
        assert rec["config"]["train"]["fast"] is None  # auto (the default): the fast step on CPU, and on CUDA with fla
    # stage 3 mixed retrieval rows in: its rows are padded (mask) where the prompts end early
    assert rec["data"]["retrieval_rows"] >= 4 and rec["data"]["row_len"] == 160
    r = runner.invoke(app, [c if c != str(out) else str(tmp_path / "plain") for c in common] + ["--stage", "1", "--plain-step"])
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "plain" / "stage1" / "training.json").read_text())["config"]["train"]["fast"] is False
    # --activation-checkpointing reaches the trainer (its plan is recorded) and leaves the losses as they were
    r = runner.invoke(app, [c if c != str(out) else str(tmp_path / "ckpt") for c in common] + ["--stage", "1",
                                                                                           "--activation-checkpointing"])
    assert r.exit_code == 0, r.output
    rec_ck = json.loads((tmp_path / "ckpt" / "stage1" / "training.json").read_text())
    assert rec_ck["config"]["train"]["activation_checkpointing"] is True and rec_ck["step_plan"]["activation_checkpointing"]
    losses = [[json.loads(x)["loss"] for x in (d / "stage1" / "log.jsonl").read_text().splitlines()] for d in (out, tmp_path / "ckpt")]
    assert losses[1] == pytest.approx(losses[0], rel=1e-6)
    # resume a finished stage: nothing left to do, same weights
    before = load_model_folder(out / "stage3").state_dict()
    r = runner.invoke(app, common + ["--stage", "3", "--resume"])
    assert r.exit_code == 0 and "already finished" in r.output, r.output
    after = load_model_folder(out / "stage3").state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def _stage3_teachers(teacher, tmp_path, device):
    """convert_stage's stage 3 from `student` (no folder): the teacher the trainer sees and where the teacher's
    weights are at each step."""
    from headscope.train import convert_stage

    t = teacher.to(device)
    student = hybridize(t, _mask(((1,), (0, 3))))
    before = {k: v.detach().clone() for k, v in t.state_dict().items()}
    seen = []
    cfg = TrainConfig(stage=3, tokens=2 * 4 * 32, batch_size=4, lr=1e-3, progress=False, ckpt_on_exit=False)
    _, summ = convert_stage(t, None, _mask(((1,), (0, 3))), 3, tmp_path, config=cfg, rows=_rows(n=4, T=32),
                            student=student.to(device), save_folder=False,
                            on_step=lambda tr, row: seen.append((tr.teacher, next(t.parameters()).device.type)))
    assert summ["finished"] and len(seen) == 2
    assert all(torch.equal(v, t.state_dict()[k].to(v.device)) for k, v in before.items())  # weights untouched
    return seen, next(t.parameters()).device.type


def test_stage3_trains_without_the_teacher(teacher, tmp_path):
    seen, after = _stage3_teachers(teacher, tmp_path, "cpu")
    assert [s[0] for s in seen] == [None, None] and after == "cpu"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_stage3_parks_a_gpu_teacher_in_host_memory(teacher, tmp_path):
    import copy

    seen, after = _stage3_teachers(copy.deepcopy(teacher), tmp_path, "cuda")
    assert [s for s in seen] == [(None, "cpu"), (None, "cpu")] and after == "cuda"
