"""Replicated data parallelism with the fast step (two gloo processes) reproduces the one-process run
on the whole global batch, stage by stage, with padded rows of unequal real-token counts; and its
checkpoints resume in one process."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from headscope.hybrid import hybridize
from headscope.masks import HeadMask
from headscope.train import TokenRows, TrainConfig, Trainer

from conftest import fast_first, tiny_llama

STEPS, BATCH, SEQ, LR = 3, 4, 24, 3e-3
FLIPS = 2  # elements per tensor whose near-zero gradient may change sign with the reduction order (_check_weights)
HMASK = HeadMask(2, 4, 2, ((1,), (0, 3)))
# real tokens per row (right padding): unequal counts, so the two ranks' slices weigh differently
LENGTHS = [24, 9, 24, 3, 17, 1, 20, 12]


def _rows() -> TokenRows:
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 400, (len(LENGTHS), SEQ), generator=g)
    mask = torch.arange(SEQ)[None] < torch.tensor(LENGTHS)[:, None]
    return TokenRows(ids, mask)


def _models(tok, root: Path):
    teacher = tiny_llama(tok, seed=3)
    student = hybridize(teacher, HMASK)
    student.load_state_dict(torch.load(root / "student0.pt"))
    return student, teacher


def _cfg(stage: int, **kw) -> TrainConfig:
    return TrainConfig(stage=stage, tokens=STEPS * BATCH * SEQ, batch_size=BATCH, lr=LR, warmup=0.0,
                       progress=False, save_student=False, seed=1, fast=True, **kw)


def _trainer(tok, root: Path, stage: int, out: Path, resume: bool = False, **kw) -> Trainer:
    student, teacher = _models(tok, root)
    return Trainer(student, teacher if stage in (1, 2) else None, _rows(), _cfg(stage, **kw), out, resume=resume)


def _worker(tok, root: str) -> dict:
    """One rank: stages 1-3 replicated (each rank saves its final weights), then a stage-2 run stopped
    after 2 steps (its exit checkpoint is written by both ranks)."""
    from headscope.train.parallel import world_info

    root_p = Path(root)
    rank, world = world_info()
    assert world == 2
    info = {}
    for stage in (1, 2, 3):
        tr = _trainer(tok, root_p, stage, root_p / f"two_s{stage}", ckpt_on_exit=False, data_parallel="replicate")
        info[stage] = {"mode": tr.dp_mode, "fast": tr.step_fn is not None}
        tr.run()
        torch.save({k: v.detach().clone() for k, v in tr.student.state_dict().items()}, root_p / f"two_s{stage}_r{rank}.pt")
    tr = _trainer(tok, root_p, 2, root_p / "ckpt")
    info["default_mode"] = tr.dp_mode
    tr.run(max_steps=2)
    return info


def _log(d: Path) -> list[dict]:
    return [json.loads(x) for x in (d / "log.jsonl").read_text().splitlines()]



def _check_weights(ref: dict, got: dict, start: dict, what) -> None:
    """``got`` equals ``ref`` to float rounding, and training moved the weights. AdamW divides by the gradient's
    running RMS, so float rounding of gradient components — summed in another order on two ranks — reaches the
    weights amplified, in proportion to the update, not to the weight; and a component whose true value is near zero
    can change sign with the summation order, moving its element by up to 2 lr a step. So per tensor: at most
    ``FLIPS`` elements may differ by more than 0.1 lr (each by at most 2 lr per step), the others by at most 0.1 lr,
    and without those few ‖got − ref‖ ≤ 1e-3 ‖ref − start‖ (a fraction of what training moved it). Measured: a Xeon
    with AVX-512 (2026-12-01) per tensor ≤ 2.3e-4 of the movement, every element ≤ 0.019 lr; a CPU without AVX-512
    (2026-12-04) stage 2 one embedding element 1.51 lr (a sign flip), one q_proj and one down_proj element 0.061 and
    0.072 lr, the rest ≤ 5.0e-4 of the movement. A wrong gradient weighting moves every element, and shows at step 1,
    which the metrics check to 1e-6."""
    moved = max(float((ref[k] - start[k]).abs().max()) for k in ref)
    assert moved > 1e-3, what
    for k in ref:
        d = (ref[k].double() - got[k].double()).abs()
        step = float((ref[k].double() - start[k].double()).norm())
        flipped = d > 0.1 * LR
        assert int(flipped.sum()) <= FLIPS, (what, k, int(flipped.sum()), float(d.max()) / LR)
        assert float(d.max()) <= 2 * STEPS * LR, (what, k, float(d.max()) / LR)
        assert float(d[~flipped].norm()) <= 1e-3 * max(step, 1e-6), (what, k, float(d[~flipped].norm()), step)


@pytest.fixture(scope="module")
def runs(smol_tokenizer, tmp_path_factory):
    from headscope.runtime import launch

    root = tmp_path_factory.mktemp("replicate")
    teacher = tiny_llama(smol_tokenizer, seed=3)
    torch.manual_seed(7)
    torch.save(hybridize(teacher, HMASK).state_dict(), root / "student0.pt")
    t = time.perf_counter()
    info = launch(_worker, 2, (smol_tokenizer, str(root)), device="cpu")
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank
    try:
        ref = {}
        for stage in (1, 2, 3):
            tr = _trainer(smol_tokenizer, root, stage, root / f"one_s{stage}", ckpt_on_exit=False)
            assert tr.dp_mode is None and tr.step_fn is not None
            tr.run()
            ref[stage] = {k: v.detach().clone() for k, v in tr.student.state_dict().items()}
    finally:
        torch.set_num_threads(n)
    return root, info, ref, time.perf_counter() - t


def test_rows_split_unevenly_across_ranks():
    """The premise of the padded-row check: some global batch gives the two ranks different counts."""
    from headscope.train.data import Loader
    from headscope.train.replicate import real_count

    loader, uneven = Loader(_rows(), BATCH, seed=1), {2: 0, 3: 0}
    for _ in range(STEPS):
        _, m = loader.next()
        for stage in uneven:
            a, b = real_count(stage, m[:2]), real_count(stage, m[2:])
            uneven[stage] += a != b
    assert uneven[2] and uneven[3], uneven


@pytest.mark.parametrize("stage", fast_first([1, 2, 3]))
def test_two_replicated_ranks_match_one_process(runs, stage):
    root, info, ref, _ = runs
    assert info[stage] == {"mode": "replicate", "fast": True}
    one, two = _log(root / f"one_s{stage}"), _log(root / f"two_s{stage}")
    assert [r["step"] for r in two] == list(range(1, STEPS + 1))  # rank 0 alone logged
    for a, b in zip(one, two):
        for k in a:
            if k in ("seconds",):
                continue
            # step 1: the same weights, only the reduction order differs (measured ≤ 2.4e-7 relative); later steps
            # start from weights that differ by AdamW-amplified rounding (see _check_weights; measured ≤ 3.9e-5)
            rel = 1e-6 if a["step"] == 1 else 2e-4
            assert b[k] == pytest.approx(a[k], rel=rel, abs=1e-7), (stage, a["step"], k)
    assert one[-1]["loss"] != one[0]["loss"]
    start = torch.load(root / "student0.pt")
    w0, w1 = torch.load(root / f"two_s{stage}_r0.pt"), torch.load(root / f"two_s{stage}_r1.pt")
    assert all(torch.equal(w0[k], w1[k]) for k in w0)  # the replicas stayed bitwise equal
    _check_weights(ref[stage], w0, start, stage)
    if stage == 1:  # only the attention layers trained
        frozen = [k for k in start if ".self_attn." not in k]
        assert all(torch.equal(ref[1][k], w0[k]) and torch.equal(w0[k], start[k]) for k in frozen)


def test_checkpoint_of_two_replicated_ranks_resumes_in_one_process(runs, smol_tokenizer):
    root, info, ref, _ = runs
    assert info["default_mode"] == "replicate"  # the default where the fast step works
    meta = json.loads((root / "ckpt" / "checkpoint" / "trainer.json").read_text())
    assert meta["world_size"] == 2 and meta["step"] == 2
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        tr = _trainer(smol_tokenizer, root, 2, root / "ckpt", resume=True)
        assert tr.step == 2
        tr.run()
    finally:
        torch.set_num_threads(n)
    full, resumed = _log(root / "one_s2"), _log(root / "ckpt")
    assert [r["step"] for r in resumed] == [1, 2, 3]
    for a, b in zip(full, resumed):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), a["step"]
        assert b["lr"] == a["lr"]
    _check_weights(ref[2], tr.student.state_dict(), torch.load(root / "student0.pt"), "resumed")


def test_data_parallel_setting_is_checked():
    with pytest.raises(ValueError, match="'replicate', 'fsdp'"):
        TrainConfig(stage=2, tokens=10, data_parallel="ddp")
