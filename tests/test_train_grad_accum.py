"""Gradient accumulation (TrainConfig.grad_accum, ``headscope convert --grad-accum``): K micro-batches give the
whole batch's loss and gradients (fast and plain step, stages 1-3), the trainer resumes mid-stage exactly with
it, bad settings are refused before training."""

from __future__ import annotations

import json

import pytest
import torch

from headscope.errors import HeadscopeInputError
from headscope.hybrid import hybridize
from headscope.masks import HeadMask
from headscope.train import StopTraining, TokenRows, TrainConfig, Trainer, stage_loss, trainable_parameters
from headscope.train.fast import FastStep
from headscope.train.step_plan import PlainStep

from conftest import Vocab, fast_first, tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def teacher():
    return tiny_llama(Vocab(), seed=3, n_layers=2, n_heads=4, n_kv=2, d_model=64)


def _student(teacher):
    torch.manual_seed(0)
    st = hybridize(teacher, HeadMask(2, 4, 2, ((0,), (1, 3))))
    with torch.no_grad():  # move the GDN gates off their initial values
        for n, p in st.named_parameters():
            if any(k in n for k in ("A_log", "a_proj", "b_proj")):
                p.add_(0.1 * torch.randn_like(p))
    return st


def _batch():
    """4 rows, the second and fourth padded at different lengths: the two micro-batches hold 24 + 17 and 24 + 9
    real tokens, so a per-micro-batch mean would weigh them wrongly."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (4, 24), generator=g)
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[1, 17:] = False
    mask[3, 9:] = False
    return ids, mask


@pytest.mark.parametrize("stage", fast_first([2, 1, 3]))
@pytest.mark.parametrize("kind", ["fast", "plain"])
def test_two_micro_batches_give_the_whole_batch_loss_and_gradients(teacher, stage, kind):
    """K = 2 against the brute-force reference: stage_loss on the whole batch, then one backward (fp32, CPU). The
    logged loss (stage 1: and every layer's alignment loss) to 1e-5 relative, every gradient to 1e-5 of its norm (the
    sums run in another order; stage 1's teacher variance in one pass); K = 1 of the same step agrees too. A mean of
    per-micro-batch means misses some gradient by > 10 %."""
    ids, mask = _batch()
    tch = teacher if stage < 3 else None
    ref_st = _student(teacher)
    params = [p for _, p in trainable_parameters(ref_st, stage)]
    loss, scalars = stage_loss(stage, ref_st, tch, ids, mask)
    loss.backward()
    ref = {n: p.grad.clone() for n, p in ref_st.named_parameters() if p.grad is not None}
    assert ref and float(loss) > 1e-3

    got = {}
    for k in (1, 2):
        st = _student(teacher)
        ps = [p for _, p in trainable_parameters(st, stage)]
        step = (FastStep(stage, st, tch, ps, grad_accum=k) if kind == "fast"
                else PlainStep(stage, st, tch, ps, grad_accum=k))
        st.train()
        logged = step(ids, mask)
        got[k] = (logged.tolist(), {n: p.grad.clone() for n, p in st.named_parameters() if p.grad is not None})
        step.close()
    want = list(scalars.values())  # [loss] or [loss, align_l0, align_l1]
    assert len(want) == (3 if stage == 1 else 1)
    for k, (lv, grads) in got.items():
        assert lv == pytest.approx(want, rel=1e-5), (k, lv, want)
        assert sorted(grads) == sorted(ref)
        for n in ref:
            assert float((grads[n] - ref[n]).norm()) <= 1e-5 * float(ref[n].norm()) + 1e-10, (k, n)

    # the wrong way (each half's own mean, averaged) moves some gradient by > 10 % of its norm: the test tells them apart
    st = _student(teacher)
    trainable_parameters(st, stage)
    for i, m in zip(ids.tensor_split(2), mask.tensor_split(2)):
        (stage_loss(stage, st, tch, i, m)[0] / 2).backward()
    worst = max(float((p.grad - ref[n]).norm() / ref[n].norm()) for n, p in st.named_parameters() if p.grad is not None)
    assert worst > 0.1
    del params


def _trainer(teacher, out, k, resume=False, ckpt_every=0, ckpt_on_exit=True):
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 256, (6, 32), generator=g)
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[2, 20:] = False
    cfg = TrainConfig(stage=2, tokens=5 * 4 * 32, batch_size=4, lr=3e-3, warmup=0.2, progress=False, seed=1,
                      grad_accum=k, ckpt_every=ckpt_every, ckpt_on_exit=ckpt_on_exit)
    return Trainer(_student(teacher), teacher, TokenRows(ids, mask), cfg, out, resume=resume)


def test_trainer_grad_accum_matches_whole_batches_and_resumes_exactly(teacher, tmp_path):
    """Five stage-2 steps of 4 rows: with grad_accum=2 the logged losses equal grad_accum=1's (to 1e-5; AdamW
    steps on gradients equal to 1e-5 relative) and the plan records it (done.json); stopped after step 2 (exit
    checkpoint) and resumed in a fresh trainer, the weights equal the uninterrupted grad_accum=2 run bit for bit."""
    whole = _trainer(teacher, tmp_path / "k1", 1)
    s1 = whole.run()
    acc = _trainer(teacher, tmp_path / "k2", 2)
    s2 = acc.run()
    assert s2["finished"] and s2["steps"] == 5 and s2["step_plan"]["grad_accum"] == 2 and s1["step_plan"]["grad_accum"] == 1
    assert json.loads((tmp_path / "k2" / "done.json").read_text())["step_plan"]["grad_accum"] == 2
    l1, l2 = ([json.loads(x)["loss"] for x in (tmp_path / d / "log.jsonl").read_text().splitlines()] for d in ("k1", "k2"))
    assert l2 == pytest.approx(l1, rel=1e-5) and len(l2) == 5

    def stop_at(k):
        def cb(tr, row):
            if tr.step == k:
                raise StopTraining
        return cb

    a = _trainer(teacher, tmp_path / "cut", 2)
    assert a.run(on_step=stop_at(2))["steps"] == 2
    torch.manual_seed(99)
    a2 = _trainer(teacher, tmp_path / "cut", 2, resume=True)
    assert a2.step == 2
    a2.run()
    want, got = acc.student.state_dict(), a2.student.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_grad_accum_refused_where_it_cannot_run():
    with pytest.raises(HeadscopeInputError, match="multiple"):
        TrainConfig(stage=2, tokens=100, batch_size=6, grad_accum=4)
    with pytest.raises(HeadscopeInputError, match=">= 1|or more"):
        TrainConfig(stage=2, tokens=100, batch_size=4, grad_accum=0)
    assert TrainConfig(stage=3, tokens=100, batch_size=4, grad_accum=4).grad_accum == 4
    assert TrainConfig(stage=1, tokens=100, batch_size=4, grad_accum=2).grad_accum == 2


def test_cli_grad_accum_checked_before_loading(tmp_path):
    from typer.testing import CliRunner

    from headscope.cli import app

    HeadMask(30, 9, 3, tuple((0,) for _ in range(30))).to_json(tmp_path / "mask.json")  # smollm2-135m, the default
    r = CliRunner().invoke(app, ["convert", "--mask", str(tmp_path / "mask.json"), "--out", str(tmp_path / "o"),
                                 "--batch-size", "6", "--batch-long", "4", "--grad-accum", "4", "--device", "cpu"])
    assert r.exit_code == 2 and "--grad-accum 4" in r.output, r.output
