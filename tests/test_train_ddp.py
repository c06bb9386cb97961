"""Data parallelism through PyTorch's wrappers (DistributedDataParallel, FSDP2) on two gloo processes gives the
one-process loss and gradients of the concatenated batch, stage by stage, with padded rows of unequal real-token
counts; the trainer's DDP runs follow the one-process run step by step, and their checkpoints resume in one process.
The fast tier checks the same global normalization in one process (the ranks as threads)."""

from __future__ import annotations

import copy
import json
import threading
from pathlib import Path

import pytest
import torch

from headscope.hybrid import hybridize
from headscope.masks import HeadMask
from headscope.train import TokenRows, TrainConfig, Trainer

from conftest import tiny_llama

STEPS, BATCH, SEQ, LR = 3, 4, 24, 3e-3
FLIPS = 2  # elements per tensor whose near-zero gradient may change sign with the reduction order (_check_weights)
HMASK = HeadMask(2, 4, 2, ((1,), (0, 3)))
# real tokens per row (right padding): unequal counts, so the two ranks' slices weigh differently
LENGTHS = [24, 9, 24, 3, 17, 1, 20, 12]
GRAD_LENGTHS = [24, 9, 3, 17]  # the gradient check's one batch: rank 0 holds 33 real tokens, rank 1 20
GRAD_REL = 1e-5  # per tensor ‖g − g_ref‖ ≤ GRAD_REL · ‖g_ref‖ (fp32; see test_ddp_and_fsdp2_gradients_equal_one_process)


def _rows(lengths=LENGTHS) -> TokenRows:
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 400, (len(lengths), SEQ), generator=g)
    mask = torch.arange(SEQ)[None] < torch.tensor(lengths)[:, None]
    return TokenRows(ids, mask)


def _models(tok, root: Path):
    teacher = tiny_llama(tok, seed=3)
    student = hybridize(teacher, HMASK)
    student.load_state_dict(torch.load(root / "student0.pt"))
    return student, teacher


def _cfg(stage: int, **kw) -> TrainConfig:
    kw = {"tokens": STEPS * BATCH * SEQ, "fast": True, **kw}
    return TrainConfig(stage=stage, batch_size=BATCH, lr=LR, warmup=0.0, progress=False, save_student=False, seed=1, **kw)


def _trainer(tok, root: Path, stage: int, out: Path, resume: bool = False, **kw) -> Trainer:
    student, teacher = _models(tok, root)
    return Trainer(student, teacher if stage in (1, 2) else None, _rows(), _cfg(stage, **kw), out, resume=resume)


MODES = (("ddp", True), ("ddp", False), ("fsdp", False))  # (data_parallel, fast step)
ACCUM_MODES = (("ddp", True), ("fsdp", False))  # the same with gradient accumulation over 2 micro-batches per rank


def _grads_worker(tok, root: str) -> dict:
    """One rank: for every stage and mode, one forward + backward on this rank's rows of one batch through
    ``build_step``; returns (logged values, full gradients by parameter name) per (stage, mode, fast)."""
    from headscope.train.parallel import local_rows, shard_student, world_info
    from headscope.train.stages import trainable_parameters
    from headscope.train.step_plan import StepPlan, build_step

    rank, world = world_info()
    rows = _rows(GRAD_LENGTHS)
    ids, mask = local_rows(rows.ids, rows.mask, rank, world)
    out = {}
    for stage in (1, 2, 3):
        for mode, fast in MODES:
            student, teacher = _models(tok, Path(root))
            params = trainable_parameters(student, stage)
            if mode == "fsdp":
                shard_student(student, stage)
                params = [(n, p) for n, p in student.named_parameters() if p.requires_grad]
            step = build_step(StepPlan(world=world, data_parallel=mode, fast=fast), stage, student,
                              teacher if stage in (1, 2) else None, [p for _, p in params], loss_chunk=16)
            logged = step(ids, mask).tolist()
            if mode == "fsdp" and stage in (1, 2):  # this rank's bytes after an AdamW step, for the memory plan
                local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
                size = lambda ts: sum(local(t).numel() * local(t).element_size() for t in ts)  # noqa: E731
                opt = torch.optim.AdamW([p for _, p in params], foreach=False)
                opt.step()
                moments = [t for st in opt.state.values() for k, t in st.items() if k in ("exp_avg", "exp_avg_sq")]
                out[("bytes", stage, rank)] = {"params": size(student.parameters()), "grads": size(p.grad for _, p in params),
                                              "optimizer": size(moments)}
            grads = {}
            for n, p in params:
                g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad  # a collective for FSDP2
                grads[n] = g.detach().clone()
            out[(stage, mode, fast)] = (logged, grads)
        for mode, fast in ACCUM_MODES:  # one row per micro-batch on each rank
            student, teacher = _models(tok, Path(root))
            params = trainable_parameters(student, stage)
            if mode == "fsdp":
                shard_student(student, stage)
                params = [(n, p) for n, p in student.named_parameters() if p.requires_grad]
            step = build_step(StepPlan(world=world, data_parallel=mode, fast=fast, grad_accum=2), stage, student,
                              teacher if stage in (1, 2) else None, [p for _, p in params], loss_chunk=16)
            logged = step(ids, mask).tolist()
            grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().clone()
                     for n, p in params}
            out[(stage, mode, fast, 2)] = (logged, grads)
    if rank == 1:  # rank 0 returns: send rank 1's byte counts over
        torch.save({k: v for k, v in out.items() if k[0] == "bytes"}, Path(root) / "bytes_r1.pt")
    torch.distributed.barrier()
    if rank == 0:
        out.update(torch.load(Path(root) / "bytes_r1.pt"))
    return out


def _train_worker(tok, root: str) -> dict:
    """One rank: stages 1-3 through the trainer with DDP (each rank saves its final weights), then a stage-2 run
    stopped after 2 steps (its exit checkpoint is written by rank 0); also the gradient check's steps."""
    from headscope.train.parallel import world_info

    root_p = Path(root)
    rank, world = world_info()
    assert world == 2
    info = {"grads": _grads_worker(tok, root)}
    for stage in (1, 2, 3):
        tr = _trainer(tok, root_p, stage, root_p / f"two_s{stage}", ckpt_on_exit=False, data_parallel="ddp")
        info[stage] = tr.plan.as_dict()
        tr.run()
        torch.save({k: v.detach().clone() for k, v in tr.student.state_dict().items()}, root_p / f"two_s{stage}_r{rank}.pt")
    tr = _trainer(tok, root_p, 2, root_p / "ckpt")
    info["default_mode"] = tr.plan.data_parallel
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
    and without those few ‖got − ref‖ ≤ 1e-3 ‖ref − start‖ (a fraction of what training moved it). Measured with the
    hand-written replicated mode: a Xeon with AVX-512 per tensor ≤ 2.3e-4 of the movement, every element ≤ 0.019 lr;
    a CPU without AVX-512 one embedding element 1.51 lr (a sign flip), the rest ≤ 0.072 lr. A wrong gradient
    weighting moves every element, and shows at step 1, which the metrics check to 1e-6."""
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
def runs(small_tokenizer, tmp_path_factory):
    from headscope.runtime import launch

    root = tmp_path_factory.mktemp("ddp")
    teacher = tiny_llama(small_tokenizer, seed=3)
    torch.manual_seed(7)
    torch.save(hybridize(teacher, HMASK).state_dict(), root / "student0.pt")
    info = launch(_train_worker, 2, (small_tokenizer, str(root)), device="cpu")
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank
    try:
        ref = {}
        for stage in (1, 2, 3):
            tr = _trainer(small_tokenizer, root, stage, root / f"one_s{stage}", ckpt_on_exit=False)
            assert tr.plan.data_parallel is None and tr.plan.fast
            tr.run()
            ref[stage] = {k: v.detach().clone() for k, v in tr.student.state_dict().items()}
    finally:
        torch.set_num_threads(n)
    return root, info, ref


def _whole_batch_grads(tok, root: Path, stage: int) -> tuple[list[float], dict]:
    """The brute-force reference: the plain loss of the whole (concatenated) batch in one process, autograd."""
    from headscope.train.stages import stage_loss_logged, trainable_parameters

    student, teacher = _models(tok, root)
    params = trainable_parameters(student, stage)
    rows = _rows(GRAD_LENGTHS)
    loss, logged = stage_loss_logged(stage, student, teacher if stage in (1, 2) else None, rows.ids, rows.mask)
    loss.backward()
    return logged.tolist(), {n: p.grad.detach().clone() for n, p in params}


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_ddp_and_fsdp2_gradients_equal_one_process(runs, small_tokenizer, stage):
    """Two gloo ranks, each on its slice of a padded batch (33 and 20 real tokens), through DDP (fast and plain
    step) and FSDP2 (plain step), and both with gradient accumulation over two micro-batches per rank: the logged
    loss and every trained parameter's gradient equal the one-process autograd gradient of the whole batch's plain
    loss, per tensor to ‖Δ‖ ≤ 1e-5 ‖g‖ (fp32)."""
    root, info, _ = runs
    ref_logged, ref = _whole_batch_grads(small_tokenizer, root, stage)
    for key in [(m, f) for m, f in MODES] + [(m, f, 2) for m, f in ACCUM_MODES]:
        mode, fast = key[:2]
        logged, grads = info["grads"][(stage, *key)]
        assert logged == pytest.approx(ref_logged, rel=1e-5), (mode, fast)
        assert sorted(grads) == sorted(ref), (mode, fast)
        for k, g in ref.items():
            err = float((grads[k].double() - g.double()).norm())
            assert err <= GRAD_REL * float(g.double().norm()) + 1e-9, (stage, mode, fast, k, err, float(g.norm()))
    assert any(float(g.abs().max()) > 0 for g in ref.values())


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2])
def test_fsdp2_bytes_per_rank_match_the_memory_plan(runs, small_tokenizer, stage):
    """Each FSDP2 rank's local parameter, gradient and AdamW-moment bytes after a step equal the memory plan's
    per-device figures up to FSDP2's uneven split of a first dimension (at most one row per sharded parameter);
    stage 1 shards only the attention modules (the rest is replicated on both ranks)."""
    from headscope.train.memory_plan import MemoryOptions, ModelShape, plan_memory

    root, info, _ = runs
    student, teacher = _models(small_tokenizer, root)
    plan = plan_memory(ModelShape.from_config(teacher.config), stage, 2, SEQ, fa=HMASK,
                       options=MemoryOptions(devices=2, fa_gate=False))
    sharded = [p for n, p in student.named_parameters() if stage == 2 or ".self_attn." in n]
    slack = sum(4 * (p.numel() // p.shape[0]) for p in sharded)  # one row of each sharded parameter
    got = [info["grads"][("bytes", stage, r)] for r in (0, 1)]
    for part in ("params", "grads", "optimizer"):
        k = 2 if part == "optimizer" else 1  # two moments per parameter
        want = getattr(plan, part)
        for g in got:
            assert abs(g[part] - want) <= k * slack, (stage, part, g[part], want)
        assert abs(sum(g[part] for g in got) - 2 * want) <= 4, (stage, part)  # the shards add up exactly
    assert (got[0]["grads"] < got[0]["params"]) == (stage == 1)  # stage 1 trains the attention modules only


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_two_ddp_ranks_train_like_one_process(runs, stage):
    root, info, ref = runs
    assert info[stage]["data_parallel"] == "ddp" and info[stage]["fast"] and info[stage]["world"] == 2
    one, two = _log(root / f"one_s{stage}"), _log(root / f"two_s{stage}")
    assert [r["step"] for r in two] == list(range(1, STEPS + 1))  # rank 0 alone logged
    for a, b in zip(one, two):
        for k in a:
            if k in ("seconds",):
                continue
            # step 1: the same weights, only the reduction order differs; later steps start from weights that
            # differ by AdamW-amplified rounding (see _check_weights)
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


@pytest.mark.slow
def test_checkpoint_of_two_ddp_ranks_resumes_in_one_process(runs, small_tokenizer):
    root, info, ref = runs
    assert info["default_mode"] == "ddp"  # the default where the fast step works
    meta = json.loads((root / "ckpt" / "checkpoint" / "trainer.json").read_text())
    assert meta["world_size"] == 2 and meta["step"] == 2 and meta["step_plan"]["data_parallel"] == "ddp"
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        tr = _trainer(small_tokenizer, root, 2, root / "ckpt", resume=True)
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


# ------------------------------------------------------------------------------ fast tier: one process
def test_rows_split_unevenly_across_ranks():
    """The premise of the padded-row checks: some global batch gives the two ranks different counts."""
    from headscope.train.data import Loader
    from headscope.train.stages import loss_token_count

    loader, uneven = Loader(_rows(), BATCH, seed=1), {2: 0, 3: 0}
    for _ in range(STEPS):
        _, m = loader.next()
        for stage in uneven:
            uneven[stage] += int(loss_token_count(stage, m[:2])) != int(loss_token_count(stage, m[2:]))
    assert uneven[2] and uneven[3], uneven


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_fast_step_shares_sum_to_the_whole_batch(small_tokenizer, stage):
    """The fast step with ``reduce`` (what DDP runs on each rank), on two row slices as two threads with a summing
    reducer: the loss shares sum to the whole batch's loss, the gradients to its gradient (to 1e-5 of the norm), and
    both threads log the global values."""
    from headscope.train.fast import FastStep
    from headscope.train.stages import trainable_parameters

    teacher = tiny_llama(small_tokenizer, seed=3)
    torch.manual_seed(7)
    base = hybridize(teacher, HMASK)
    rows = _rows(GRAD_LENGTHS)
    models = [copy.deepcopy(base) for _ in range(3)]
    steps = []
    for m in models:
        params = [p for _, p in trainable_parameters(m, stage)]
        steps.append(FastStep(stage, m, teacher if stage in (1, 2) else None, params, chunk_rows=16))
    ref_logged = steps[2](rows.ids, rows.mask)
    barrier, slots = threading.Barrier(2), [None, None]

    def reducer(r):
        def f(t):
            slots[r] = t.detach().clone()
            barrier.wait()
            total = slots[0] + slots[1]
            barrier.wait()
            return total
        return f

    logged = [None, None]

    def rank(r):
        steps[r].reduce = reducer(r)
        logged[r] = steps[r](rows.ids[2 * r:2 * r + 2], rows.mask[2 * r:2 * r + 2])

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert torch.equal(logged[0], logged[1])
    assert logged[0].tolist() == pytest.approx(ref_logged.tolist(), rel=1e-5)
    named = [dict(m.named_parameters()) for m in models]
    for k, p in named[2].items():
        if p.grad is None:
            continue
        total = named[0][k].grad + named[1][k].grad
        assert float((total - p.grad).norm()) <= 1e-5 * float(p.grad.norm()) + 1e-9, (stage, k)


def test_step_plan_resolves_and_is_recorded(small_tokenizer, tmp_path):
    """One process: no data parallelism, the fast step on CPU, no compile / graph / fused AdamW; the plan is
    frozen and saved whole in the checkpoint and the summary."""
    import dataclasses

    from headscope.train.step_plan import StepPlan, resolve_step_plan

    teacher = tiny_llama(small_tokenizer, seed=3)
    student = hybridize(teacher, HMASK)
    cpu = torch.device("cpu")
    plan = resolve_step_plan(_cfg(2), student, teacher, cpu, world=1)
    assert plan == StepPlan(world=1, data_parallel=None, fast=True, compile=False, cuda_graph=False, fused_adamw=False,
                            bf16=False, teacher_dtype="fp32")
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.fast = False  # type: ignore[misc]
    two = resolve_step_plan(_cfg(2), student, teacher, cpu, world=2)
    assert (two.data_parallel, two.fast, two.loss_scale) == ("ddp", True, 2.0)
    fsdp = resolve_step_plan(_cfg(2, data_parallel="fsdp"), student, teacher, cpu, world=2)
    assert (fsdp.data_parallel, fsdp.fast, fsdp.loss_scale) == ("fsdp", False, 2.0)
    plain = resolve_step_plan(_cfg(2, fast=False), student, teacher, cpu, world=2)
    assert (plain.data_parallel, plain.fast) == ("fsdp", False)
    tr = Trainer(student, teacher, _rows(), _cfg(2, tokens=BATCH * SEQ), tmp_path)
    s = tr.run()
    assert s["step_plan"] == plan.as_dict()
    assert json.loads((tmp_path / "checkpoint" / "trainer.json").read_text())["step_plan"] == plan.as_dict()


def test_data_parallel_setting_is_checked():
    with pytest.raises(ValueError, match="'ddp', 'fsdp'"):
        TrainConfig(stage=2, tokens=10, data_parallel="horovod")
