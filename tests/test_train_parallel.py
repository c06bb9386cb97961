"""Data-parallel training on two gloo processes (DDP with the fast step, the default, and FSDP2)
reproduces the one-process run, and its checkpoints move between device counts
(torch.distributed.checkpoint)."""

from __future__ import annotations

import copy
import json
import random
import threading

import pytest
import torch

from headscope.hybrid import hybridize
from headscope.masks import HeadMask
from headscope.train import DataConfig, TrainConfig, convert_stage
from headscope.train.pipeline import spawn_convert

from conftest import tiny_llama

STEPS, BATCH, SEQ = 4, 4, 32


@pytest.fixture(scope="module")
def setup(small_tokenizer, tmp_path_factory):
    root = tmp_path_factory.mktemp("dp")
    teacher = tiny_llama(small_tokenizer, seed=3)
    teacher.save_pretrained(root / "teacher")
    small_tokenizer.save_pretrained(root / "teacher")
    rng = random.Random(0)
    words = "alpha beta gamma delta river stone cloud seven green quiet north lamp".split()
    (root / "corpus.txt").write_text("\n\n".join(" ".join(rng.choice(words) for _ in range(60)) for _ in range(12)))
    mask = HeadMask(2, 4, 2, ((1,), (0, 3)))
    torch.manual_seed(7)
    stage1 = hybridize(teacher, mask).state_dict()  # the "previous stage" every run starts from
    return root, teacher, mask, stage1


def _dir(root, name, stage1, teacher, mask, tok):
    """A conversion folder whose stage 1 is finished: the model folder of the weights ``stage1``."""
    from headscope.train import save_model_folder

    d = root / name
    student = hybridize(teacher, mask)
    student.load_state_dict(stage1)
    save_model_folder(student, tok, mask, d / "stage1", {"stage": 1})
    return d


def _cfg(mode=None):
    cfg = TrainConfig(stage=2, tokens=STEPS * BATCH * SEQ, batch_size=BATCH, lr=3e-3, warmup=0.25, progress=False, seed=1,
                      data_parallel=mode)
    return cfg, DataConfig(seq_len=SEQ, corpus=None)


def _losses(d):
    return [json.loads(x)["loss"] for x in (d / "stage2" / "log.jsonl").read_text().splitlines()]


def _weights(d):
    from safetensors.torch import load_file

    return load_file(str(d / "stage2" / "model.safetensors"))


@pytest.mark.slow
@pytest.mark.parametrize("mode", [None, "fsdp"])
def test_two_gloo_ranks_train_like_one_process_and_checkpoints_move(setup, small_tokenizer, mode):
    root, teacher, mask, stage1 = setup
    root = root / str(mode)
    cfg, data = _cfg(mode)
    data.corpus = str(root.parent / "corpus.txt")
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # each rank runs one intra-op thread too
    try:
        # A: one process, uninterrupted
        a = _dir(root, "a", stage1, teacher, mask, small_tokenizer)
        convert_stage(teacher, small_tokenizer, mask, 2, a, config=cfg, data=data)
        # B: two ranks stop after 2 steps (checkpoint written by 2 processes) ...
        b = _dir(root, "b", stage1, teacher, mask, small_tokenizer)
        s = spawn_convert(2, str(root.parent / "teacher"), mask, 2, b, device="cpu", config=cfg, data=data, max_steps=2)
        assert s["steps"] == 2 and not s["finished"]
        assert s["data_parallel"] == (mode or "ddp")
        meta = json.loads((b / "stage2" / "checkpoint" / "trainer.json").read_text())
        assert meta["world_size"] == 2 and meta["step"] == 2
        # ... and one process resumes it to the end
        convert_stage(teacher, small_tokenizer, mask, 2, b, config=cfg, data=data, resume=True)
        # C: one process stops after 2 steps, two ranks resume it to the end
        c = _dir(root, "c", stage1, teacher, mask, small_tokenizer)
        convert_stage(teacher, small_tokenizer, mask, 2, c, config=cfg, data=data, max_steps=2)
    finally:
        torch.set_num_threads(n)
    s = spawn_convert(2, str(root.parent / "teacher"), mask, 2, c, device="cpu", config=cfg, data=data, resume=True)
    assert s["steps"] == STEPS and s["finished"]

    la, lb, lc = _losses(a), _losses(b), _losses(c)
    assert len(la) == len(lb) == len(lc) == STEPS
    # the two-rank steps (B: 1-2, C: 3-4) and the one-process steps give the same loss curve
    two_rank = lb[:2] + lc[2:]
    rel = max(abs(x - y) / abs(x) for x, y in zip(la, two_rank))
    assert rel <= 1e-5, (la, two_rank)
    assert la[-1] < la[0]  # it trained
    wa, wb, wc = _weights(a), _weights(b), _weights(c)
    assert sorted(wa) == sorted(wb) == sorted(wc)
    stage1 = {k: stage1[k] for k in wa}  # the saved weights leave out the tied LM head
    moved = max(float((wa[k] - stage1[k]).abs().max()) for k in wa)
    assert moved > 1e-3
    for w in (wb, wc):  # 2 -> 1 and 1 -> 2 resumes end where the uninterrupted run ends
        diff = max(float((wa[k] - w[k]).abs().max()) for k in wa)
        assert diff <= 1e-5 * max(1.0, moved), diff
    # only rank 0 logged: one row per step, no duplicates
    assert [json.loads(x)["step"] for x in (c / "stage2" / "log.jsonl").read_text().splitlines()] == [1, 2, 3, 4]


def test_local_rows_split_the_global_batch():
    from headscope.train.parallel import local_rows

    ids = torch.arange(5 * 3).view(5, 3)
    mask = ids % 2 == 0
    parts = [local_rows(ids, mask, r, 2) for r in range(2)]
    assert torch.equal(torch.cat([p[0] for p in parts]), ids)
    assert torch.equal(torch.cat([p[1] for p in parts]), mask)
    assert [len(p[0]) for p in parts] == [3, 2]
    with pytest.raises(ValueError, match="batch-size >= 3"):
        local_rows(ids[:2], mask[:2], 0, 3)


def test_sharded_loss_shares_sum_to_the_global_loss(setup):
    """Stage 1-3 losses computed on two row slices with a summing reducer equal the whole-batch loss."""
    from headscope.train import stage_loss, trainable_parameters

    _, teacher, mask, stage1 = setup
    student = hybridize(teacher, mask)
    student.load_state_dict(stage1)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 1000, (4, 24), generator=g)
    m = torch.ones_like(ids, dtype=torch.bool)
    m[1, 15:] = False  # padded rows: shares are weighted by the global token count, not per slice
    m[3, 5:] = False
    for stage in (1, 2, 3):
        trainable_parameters(student, stage)
        whole, sw = stage_loss(stage, student, teacher, ids, m)
        # two "ranks" as threads, each on half of the rows, with an all-reduce through a barrier
        barrier, slots, shares, logged = threading.Barrier(2), [None, None], [None, None], [None, None]

        def reducer(r):
            def f(t):
                slots[r] = t.detach().clone()
                barrier.wait()
                total = slots[0] + slots[1]
                barrier.wait()
                return t.copy_(total) if not t.requires_grad else total
            return f

        models = [(student, teacher), (copy.deepcopy(student), copy.deepcopy(teacher))]  # own hooks per "rank"

        def rank(r):
            sl = slice(2 * r, 2 * r + 2)
            shares[r], logged[r] = stage_loss(stage, *models[r], ids[sl], m[sl], reduce=reducer(r))

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert logged[0] == logged[1]
        assert logged[0]["loss"] == pytest.approx(sw["loss"], rel=1e-5)
        if stage == 1:
            assert logged[0]["align_l1"] == pytest.approx(sw["align_l1"], rel=1e-5)
        assert float(sum(shares)) == pytest.approx(float(whole), rel=1e-5), stage


def test_single_process_checkpoint_round_trips(tmp_path):
    """Without a process group, save/load_checkpoint restore the weights (tied ones too), the optimizer state
    and extra exactly, from safetensors and JSON only."""
    from headscope.train.parallel import load_checkpoint, save_checkpoint

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Embedding(5, 3), torch.nn.Linear(3, 5))
    m[1].weight = m[0].weight  # tied, as an LM head is to its embedding
    o = torch.optim.AdamW([{"params": [m[0].weight], "weight_decay": 0.1}, {"params": [m[1].bias]}], lr=0.1)
    m(torch.tensor([[1, 2]])).sum().backward()
    o.step()
    want = {k: v.clone() for k, v in m.state_dict().items()}
    want_avg = o.state[m[0].weight]["exp_avg"].clone()
    save_checkpoint(tmp_path / "ck", m, o, {"step": 7})
    assert {p.name for p in (tmp_path / "ck").iterdir()} == {"model.safetensors", "optim.safetensors", "optim.json", "trainer.json"}
    with torch.no_grad():
        m[0].weight.zero_()
        m[1].bias.zero_()
    o.state[m[0].weight]["exp_avg"].zero_()
    o.param_groups[0]["lr"] = 5.0
    extra = load_checkpoint(tmp_path / "ck", m, o)
    assert extra == {"step": 7} and all(torch.equal(m.state_dict()[k], v) for k, v in want.items())
    assert m[1].weight is m[0].weight
    assert torch.equal(o.state[m[0].weight]["exp_avg"], want_avg) and o.param_groups[0]["lr"] == 0.1
    assert o.param_groups[0]["weight_decay"] == 0.1 and o.param_groups[1]["weight_decay"] == 0.01


@pytest.mark.slow
def test_convert_model_on_two_gloo_ranks_equals_one_process(setup, small_tokenizer):
    """All three stages of a recipe on two ranks (rank 0 builds the documents and rows, the others read them)
    end where the one-process conversion ends."""
    from safetensors.torch import load_file

    from headscope.train import ConvertRecipe, convert_model
    from headscope.train.pipeline import spawn_convert_model

    root, teacher, mask, _ = setup
    root = root / "model"
    words = "The farmer walked to the harbour in the morning. A young painter looked at an empty barn after the rain."
    (root).mkdir()
    (root / "corpus.txt").write_text("\n\n".join(f"{words} {words}" for _ in range(40)))
    recipe = ConvertRecipe(seq_len=128, long_len=256, batch_size=4, batch_long=2, stage_tokens=(1024, 1024, 1024),
                           corpus=str(root / "corpus.txt"))
    if small_tokenizer.pad_token_id is None:
        small_tokenizer.pad_token = small_tokenizer.eos_token
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one = convert_model(teacher, small_tokenizer, mask, root / "one", recipe=recipe, progress=False)
    finally:
        torch.set_num_threads(n)
    two = spawn_convert_model(2, str(root.parent / "teacher"), mask, root / "two", device="cpu", recipe=recipe,
                              progress=False)
    assert one["finished"] and two["finished"] and two["stages"][3]["data_parallel"] == "ddp"
    a = load_file(str(root / "one" / "stage3" / "model.safetensors"))
    b = load_file(str(root / "two" / "stage3" / "model.safetensors"))
    assert sorted(a) == sorted(b)
    diff = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert diff <= 1e-4, diff
    for k in (1, 2, 3):
        ra = json.loads((root / "one" / f"stage{k}" / "training.json").read_text())
        rb = json.loads((root / "two" / f"stage{k}" / "training.json").read_text())
        assert ra["data"]["rows_sha256"] == rb["data"]["rows_sha256"] and rb["world_size"] == 2
