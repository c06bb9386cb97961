"""The memory plan's options that are trainer settings (issue 63; docs/conversion.md#memory-plan):
``new_params_only`` (stage 1 trains only the parameters the hybrid adds: the copied ones bit-identical after training,
the new ones moved, AdamW states for exactly them, as many as the plan counts) and ``teacher_dtype`` (a bf16 teacher:
half its bytes, stage 2's first loss off the fp32 teacher's by what the teacher logits' change explains, stage 1
trains from its inputs); both through the fast and the plain step, recorded in the StepPlan and training.json, and
the CLI's refusals (one line, exit code 2, before a model loads)."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

from headscope.cli import app
from headscope.errors import HeadscopeInputError
from headscope.hybrid import hybridize
from headscope.train.stages import NEW_PARAMETERS
from headscope.masks import HeadMask
from headscope.train import TokenRows, TrainConfig, Trainer, distillation_loss, trainable_parameters
from headscope.train.memory_plan import MemoryOptions, ModelShape, plan_memory
from headscope.train.trainer import hold_teacher

from conftest import Vocab, tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")

MASK = HeadMask(2, 4, 2, ((1,), (0, 3)))


@pytest.fixture(scope="module")
def teacher():
    return tiny_llama(Vocab(), seed=3, n_layers=2, n_heads=4, n_kv=2, d_model=64)


def _rows(n=4, T=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (n, T), generator=g)
    return TokenRows(ids, torch.ones_like(ids, dtype=torch.bool))


def _is_new(name: str) -> bool:
    return any(f".self_attn.{n}." in name or name.endswith(f".self_attn.{n}") for n in NEW_PARAMETERS)


@pytest.mark.parametrize("fast", [None, False], ids=["fast_step", "plain_step"])
def test_new_params_only_keeps_the_copied_weights(teacher, tmp_path, fast):
    """Two stage-1 steps with new_params_only: every copied parameter (q / k / v / o, the GDN heads' k / v rows, and
    everything outside attention) bit-identical, every new one (a_proj, b_proj, A_log, dt_bias, g_proj, γ) moved; the
    optimizer holds states for exactly the new ones, whose count and bytes are the memory plan's; the same two steps
    without the setting move q_proj (so the first assertion can fail)."""
    torch.manual_seed(0)
    student = hybridize(teacher, MASK, fa_gate=True)
    before = {n: p.detach().clone() for n, p in student.named_parameters()}
    cfg = TrainConfig(stage=1, tokens=2 * 4 * 32, batch_size=4, lr=1e-2, warmup=0.0, progress=False, ckpt_on_exit=False,
                      fast=fast, new_params_only=True)
    tr = Trainer(student, teacher, _rows(), cfg, tmp_path / "new")
    summary = tr.run()
    assert summary["finished"] and tr.plan.fast == (fast is None)
    assert summary["step_plan"]["new_params_only"] is True
    new = {n for n, _ in student.named_parameters() if _is_new(n)}
    assert {n for n, _ in tr.params} == new
    assert {"a_proj.weight", "b_proj.weight", "b_proj.bias", "A_log", "dt_bias", "g_proj.weight", "g_proj.bias",
            "gamma"} == {n.split(".self_attn.")[1] for n in new}
    for n, p in student.named_parameters():
        if n in new:
            assert not torch.equal(p, before[n]), f"{n} did not move"
        else:
            assert torch.equal(p, before[n]), f"{n} changed"
    states = [st for st in tr.opt.state.values() if st]
    held = {id(p) for p in tr.opt.state if tr.opt.state[p]}
    assert held == {id(p) for n, p in student.named_parameters() if n in new} and len(states) == len(new)
    plan = plan_memory(ModelShape.from_config(teacher.config), 1, 4, 32, fa=MASK,
                       options=MemoryOptions(new_params_only=True, teacher_dtype="fp32"))
    n_new = sum(p.numel() for n, p in student.named_parameters() if n in new)
    assert n_new == plan.counts["new"] == plan.counts["trained"]
    moments = [t for st in states for k, t in st.items() if k in ("exp_avg", "exp_avg_sq")]
    assert sum(t.numel() * t.element_size() for t in moments) == plan.optimizer == 8 * n_new
    # without the setting stage 1 moves the copied projections too
    torch.manual_seed(0)
    full = hybridize(teacher, MASK, fa_gate=True)
    cfg_all = TrainConfig(stage=1, tokens=2 * 4 * 32, batch_size=4, lr=1e-2, warmup=0.0, progress=False,
                          ckpt_on_exit=False, fast=fast)
    Trainer(full, teacher, _rows(), cfg_all, tmp_path / "all").run()
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(dict(full.named_parameters())[q], before[q])


def test_new_parameters_are_what_reset_new_parameters_sets():
    """NEW_PARAMETERS against the layer itself: with every option that adds a parameter (FA gate, short convolution,
    γ), each parameter perturbed, reset_new_parameters() puts back exactly the ones listed (and all of them)."""
    from headscope.hybrid import HeadwiseHybridAttention, HybridOptions
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    layer = HeadwiseHybridAttention(cfg, 0, (1,), HybridOptions(fa_gate=True, gdn_conv=4))
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(0.5)
        before = {n: p.detach().clone() for n, p in layer.named_parameters()}
        layer.reset_new_parameters()
    reset = {n.split(".")[0] for n, p in layer.named_parameters() if not torch.equal(p, before[n])}
    kept = {n.split(".")[0] for n, p in layer.named_parameters() if torch.equal(p, before[n])}
    assert reset == set(NEW_PARAMETERS) and not kept & reset
    assert kept == {"q_proj", "o_proj", "k_proj", "v_proj", "gdn_k_proj", "gdn_v_proj"}


def test_new_params_only_is_refused_where_it_does_not_apply(teacher):
    with pytest.raises(HeadscopeInputError, match="stage 1"):
        TrainConfig(stage=2, tokens=10, new_params_only=True)
    with pytest.raises(HeadscopeInputError, match="stage 1"):
        trainable_parameters(hybridize(teacher, MASK), 3, new_params_only=True)
    all_fa = hybridize(teacher, HeadMask(2, 4, 2, ((0, 1, 2, 3),) * 2), fusion="none", fa_gate=False)
    with pytest.raises(HeadscopeInputError, match="no new parameter"):
        trainable_parameters(all_fa, 1, new_params_only=True)
    with pytest.raises(HeadscopeInputError, match="teacher_dtype"):
        TrainConfig(stage=2, tokens=10, teacher_dtype="fp16")


def test_new_params_only_resumes_only_with_the_same_setting(teacher, tmp_path):
    """A checkpoint written with new_params_only resumes with it (the same weights as an uninterrupted run) and is
    refused without it."""
    from headscope.train import StopTraining

    def run(out, resume=False, stop=None, new=True):
        torch.manual_seed(0)
        s = hybridize(teacher, MASK)
        cfg = TrainConfig(stage=1, tokens=3 * 4 * 32, batch_size=4, lr=1e-2, warmup=0.0, progress=False, new_params_only=new)
        tr = Trainer(s, teacher, _rows(n=8), cfg, out, resume=resume)

        def cb(t, row):
            if stop is not None and t.step == stop:
                raise StopTraining

        tr.run(on_step=cb)
        return s

    want = run(tmp_path / "full").state_dict()
    run(tmp_path / "cut", stop=1)
    with pytest.raises(HeadscopeInputError, match="new-params-only"):
        run(tmp_path / "cut", resume=True, new=False)
    got = run(tmp_path / "cut", resume=True).state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_a_checkpoint_resumes_only_against_the_same_teacher_dtype(teacher, tmp_path):
    from headscope.train import StopTraining

    def trainer(dt, resume=False):
        torch.manual_seed(0)
        cfg = TrainConfig(stage=2, tokens=3 * 4 * 32, batch_size=4, progress=False, teacher_dtype=dt)
        return Trainer(hybridize(teacher, MASK), copy.deepcopy(teacher), _rows(n=8), cfg, tmp_path, resume=resume)

    def stop(t, row):
        raise StopTraining

    trainer("bf16").run(on_step=stop)
    with pytest.raises(HeadscopeInputError, match="resume with --teacher-dtype bf16"):
        trainer("fp32", resume=True)
    assert trainer("bf16", resume=True).step == 1


def _first_loss(teacher, student, fast, teacher_dtype, out):
    cfg = TrainConfig(stage=2, tokens=4 * 32, batch_size=4, lr=1e-3, progress=False, ckpt_on_exit=False, fast=fast,
                      teacher_dtype=teacher_dtype)
    tr = Trainer(copy.deepcopy(student), teacher, _rows(), cfg, out)
    return tr, tr.train_step()["loss"]


def _sensitivity(z: torch.Tensor, zs: torch.Tensor) -> float:
    """S = mean over tokens of Σ_v |∂KL_t/∂z_v| = Σ_v p_v |log p_v − log q_v − KL_t| (p = softmax z, q = softmax zs)."""
    lp, lq = F.log_softmax(z.double(), -1), F.log_softmax(zs.double(), -1)
    a = lp - lq
    kl_t = (lp.exp() * a).sum(-1, keepdim=True)
    return (lp.exp() * (a - kl_t).abs()).sum(-1).mean().item()


def test_bf16_teacher_changes_stage2_loss_by_its_logits_only(teacher, tmp_path):
    """Stage 2's first loss with teacher_dtype="bf16" against "fp32", the same fp32 student and rows, fast and plain
    step (a CPU: no autocast, so the bf16 teacher's forward runs in bf16):

    * each loss is the KL computed by hand (1e-5 relative) from the student's logits and that teacher's logits as the
      step forms them: the plain step the teacher's own output (bf16 logits), the fast step its final hidden state
      times the LM head in fp32 (``fused_loss`` multiplies in the student's dtype): the setting changes the teacher's
      logits and nothing else;
    * those two bf16-teacher logits differ by the bf16 rounding of the logits alone: |z_plain − z_fast| ≤ 2⁻⁸ |z_fast|
      (bf16's unit roundoff, 8 significant bits), and the two losses by at most 2 · 2⁻⁸ max|z| · S, with S the mean
      over tokens of Σ_v |∂KL_t/∂z_v| = Σ_v p_v |log p_v − log q_v − KL_t|: a first-order bound |ΔKL_t| ≤ max_v |Δz_v| ·
      Σ_v |∂KL_t/∂z_v|, doubled for the second-order remainder;
    * against the fp32 teacher the loss moves (so a trainer that ignored the setting fails) by at most 2 · δ · S, δ
      the largest change of any teacher logit;
    * the teacher's parameter bytes halve, and are the memory plan's ``teacher`` for bf16.

    The teacher's LM head is scaled by 30 (logits up to ~20, KL ~10 nats) so that the bf16 teacher's KL differs from
    the fp32 one's by more than 3 × the 1e-5 of the first check (5.8e-5 and 1.4e-4 relative, fast / plain logits):
    the first check tells the two teachers apart.
    """
    teacher = copy.deepcopy(teacher)
    with torch.no_grad():
        teacher.lm_head.weight.mul_(30.0)
    torch.manual_seed(1)
    student = hybridize(teacher, MASK)
    shape = ModelShape.from_config(teacher.config)
    ids = _rows().ids
    mask = torch.ones_like(ids, dtype=torch.bool)
    t32 = copy.deepcopy(teacher)
    t16 = hold_teacher(copy.deepcopy(teacher), "bf16")
    with torch.no_grad():
        z32 = t32(input_ids=ids).logits.float()
        z16 = t16(input_ids=ids).logits.float()  # the plain step's: bf16 logits
        h16 = t16.model(input_ids=ids).last_hidden_state
        z16f = h16.float() @ t16.lm_head.weight.float().t()  # the fast step's
        zs = student(input_ids=ids).logits.float()
    kl = {k: distillation_loss(zs, z, mask).item() for k, z in (("32", z32), ("16", z16), ("16f", z16f))}
    assert ((z16 - z16f).abs() <= 2.0 ** -8 * z16f.abs() + 1e-6).all()
    assert min(abs(kl["16"] - kl["32"]), abs(kl["16f"] - kl["32"])) > 3e-5 * kl["32"]
    loss = {}
    for fast, name in ((None, "fast"), (False, "plain")):
        for dt in ("fp32", "bf16"):
            t = copy.deepcopy(teacher)
            tr, loss[name, dt] = _first_loss(t, student, fast, dt, tmp_path / f"{name}_{dt}")
            assert tr.plan.fast == (fast is None) and tr.plan.teacher_dtype == dt
            assert all(p.dtype == torch.float32 for p in tr.student.parameters())
            if dt == "bf16":
                assert all(p.dtype == torch.bfloat16 for p in t.parameters())
                assert t.model.rotary_emb.inv_freq.dtype == torch.float32  # buffers keep their precision
    size = lambda m: sum(p.numel() * p.element_size() for p in m.parameters())  # noqa: E731
    assert 2 * size(t16) == size(t32) == plan_memory(shape, 2, 4, 32, fa=MASK, options=MemoryOptions(teacher_dtype="fp32")).teacher
    assert size(t16) == plan_memory(shape, 2, 4, 32, fa=MASK, options=MemoryOptions(teacher_dtype="bf16")).teacher
    for name in ("fast", "plain"):
        assert loss[name, "fp32"] == pytest.approx(kl["32"], rel=1e-5)
    assert loss["fast", "bf16"] == pytest.approx(kl["16f"], rel=1e-5)
    assert loss["plain", "bf16"] == pytest.approx(kl["16"], rel=1e-5)
    rounding = 2 * 2.0 ** -8 * z16f.abs().max().item() * _sensitivity(z16f, zs)
    assert abs(loss["plain", "bf16"] - loss["fast", "bf16"]) <= rounding
    for name, z in (("fast", z16f), ("plain", z16)):
        delta = (z - z32).abs().max().item()
        assert 0 < abs(loss[name, "bf16"] - loss[name, "fp32"]) <= 2 * delta * _sensitivity(z32, zs), (name, loss, delta)


@pytest.mark.parametrize("fast", [None, False], ids=["fast_step", "plain_step"])
def test_bf16_teacher_stage1_trains_on_its_inputs(teacher, tmp_path, fast):
    """Stage 1 with a bf16 teacher: its attention inputs reach the fp32 student in fp32 (the step runs on a CPU
    without autocast), the fast and the plain step give one loss (1e-5), within 1 % of the fp32 teacher's."""
    torch.manual_seed(1)
    student = hybridize(teacher, MASK)
    losses = {}
    for dt in ("bf16", "fp32"):
        cfg = TrainConfig(stage=1, tokens=4 * 32, batch_size=4, progress=False, ckpt_on_exit=False, fast=fast,
                          teacher_dtype=dt)
        tr = Trainer(copy.deepcopy(student), copy.deepcopy(teacher), _rows(), cfg, tmp_path / dt)
        losses[dt] = tr.train_step()["loss"]
    assert losses["bf16"] != losses["fp32"]
    assert losses["bf16"] == pytest.approx(losses["fp32"], rel=1e-2)
    cfg = TrainConfig(stage=1, tokens=4 * 32, batch_size=4, progress=False, ckpt_on_exit=False,
                      fast=False if fast is None else None, teacher_dtype="bf16")
    other = Trainer(copy.deepcopy(student), copy.deepcopy(teacher), _rows(), cfg, tmp_path / "other").train_step()["loss"]
    assert other == pytest.approx(losses["bf16"], rel=1e-5)


def test_bf16_teacher_stage1_under_autocast_keeps_its_inputs_bf16(teacher, tmp_path):
    """Under bf16 autocast (here the CPU's, ``bf16=True``: the fast step autocasts on any device) the bf16 teacher's
    attention inputs reach the student uncast (autocast casts the student's matrix products); the loss is the
    no-autocast one's to bf16 precision (2 %)."""
    torch.manual_seed(1)
    student = hybridize(teacher, MASK)
    losses = []
    for bf16 in (True, False):
        cfg = TrainConfig(stage=1, tokens=4 * 32, batch_size=4, progress=False, ckpt_on_exit=False, bf16=bf16,
                          teacher_dtype="bf16")
        tr = Trainer(copy.deepcopy(student), copy.deepcopy(teacher), _rows(), cfg, tmp_path / str(bf16))
        assert tr.plan.fast and tr.plan.bf16 == bf16
        losses.append(tr.train_step()["loss"])
    assert losses[0] == pytest.approx(losses[1], rel=2e-2) and losses[0] != losses[1]


def test_hold_teacher_casts_parameters_only(teacher):
    t = hold_teacher(copy.deepcopy(teacher), "bf16")
    assert {p.dtype for p in t.parameters()} == {torch.bfloat16}
    assert t.model.rotary_emb.inv_freq.dtype == torch.float32
    ref = dict(teacher.named_parameters())
    assert all(torch.equal(p, ref[n].to(torch.bfloat16)) for n, p in t.named_parameters())
    assert hold_teacher(t, None) is t and hold_teacher(None, "bf16") is None


def test_student_of_a_bf16_teacher_is_float32(teacher):
    """load_student's dtype: the copied weights are the bf16 teacher's values exactly, the new ones unrounded."""
    from headscope.train import load_student

    t16 = hold_teacher(copy.deepcopy(teacher), "bf16")
    s = load_student(t16, MASK, dtype=torch.float32)
    ref = load_student(teacher, MASK)
    assert {p.dtype for p in s.parameters()} == {torch.float32}
    sa, ra, ta = s.model.layers[0].self_attn, ref.model.layers[0].self_attn, t16.model.layers[0].self_attn
    assert torch.equal(sa.q_proj.weight, ta.q_proj.weight.float())
    assert torch.equal(sa.dt_bias, ra.dt_bias) and sa.dt_bias.to(torch.bfloat16).float().ne(sa.dt_bias).any()


def test_cli_refuses_before_the_teacher_loads(tmp_path, monkeypatch):
    import headscope.models

    def no_load(*a, **k):
        raise AssertionError("the teacher was loaded")

    monkeypatch.setattr(headscope.models, "load_hf", no_load)
    teacher = tiny_llama(Vocab(), seed=3, n_layers=2, n_heads=4, n_kv=2, d_model=64)
    teacher.config.save_pretrained(tmp_path / "teacher")
    MASK.to_json(tmp_path / "mask.json")
    base = ["convert", "--model", str(tmp_path / "teacher"), "--mask", str(tmp_path / "mask.json"), "--out",
            str(tmp_path / "out"), "--device", "cpu"]
    r = CliRunner().invoke(app, base + ["--new-params-only", "--stage", "2"])
    assert r.exit_code == 2 and r.output.count("\n") == 1 and "--new-params-only applies to stage 1" in r.output, r.output
    r = CliRunner().invoke(app, base + ["--teacher-dtype", "fp16"])
    assert r.exit_code == 2 and r.output.count("\n") == 1 and "fp16" in r.output and "bf16" in r.output, r.output


@pytest.mark.slow  # two CLI stages: ~20 s on a busy 2-core machine
def test_cli_convert_records_the_settings(small_tokenizer, tmp_path):
    """`headscope convert --stage 1 --new-params-only --teacher-dtype bf16`, then `--stage 2 --teacher-dtype bf16`:
    training.json records both settings (config.train, config.train_options, step_plan); stage 1's folder holds the
    teacher's q/k/v/o as the bf16 teacher has them (bit for bit, in fp32) and new parameters that moved; stage 2 trains
    everything against the bf16 teacher."""
    from headscope.train.model_folder import load_model_folder
    from test_convert import corpus_text

    teacher = tiny_llama(small_tokenizer, seed=3, d_model=32)
    teacher.save_pretrained(tmp_path / "teacher")
    small_tokenizer.save_pretrained(tmp_path / "teacher")
    (tmp_path / "corpus.txt").write_text(corpus_text())
    MASK.to_json(tmp_path / "mask.json")
    out = tmp_path / "conv"
    args = ["convert", "--model", str(tmp_path / "teacher"), "--mask", str(tmp_path / "mask.json"), "--out", str(out),
            "--device", "cpu", "--corpus", str(tmp_path / "corpus.txt"), "--seq-len", "128", "--long-len", "256",
            "--batch-size", "2", "--batch-long", "2", "--stage-tokens", "512,256,512", "--gdn-kernel", "torch",
            "--teacher-dtype", "bf16"]
    r = CliRunner().invoke(app, args + ["--stage", "1", "--new-params-only"])
    assert r.exit_code == 0, r.output
    rec = json.loads((out / "stage1" / "training.json").read_text())
    assert rec["config"]["train"]["new_params_only"] is True and rec["config"]["train"]["teacher_dtype"] == "bf16"
    assert rec["config"]["train_options"] == {"new_params_only": True, "teacher_dtype": "bf16"}
    assert rec["step_plan"]["new_params_only"] is True and rec["step_plan"]["teacher_dtype"] == "bf16"
    s1 = load_model_folder(out / "stage1")
    t16 = hold_teacher(copy.deepcopy(teacher), "bf16")
    for name in ("q_proj", "o_proj", "k_proj", "v_proj"):
        for i in range(2):
            attn = s1.model.layers[i].self_attn
            got, want = getattr(attn, name).weight, getattr(t16.model.layers[i].self_attn, name).weight
            if name in ("k_proj", "v_proj"):  # the rows of the FA heads' KV groups
                d = attn.head_dim
                want = torch.cat([want[g * d:(g + 1) * d] for g in attn.kv_keep])
            assert got.dtype == torch.float32 and torch.equal(got, want.float()), (name, i)
    assert s1.model.layers[0].self_attn.a_proj.weight.abs().max() > 0  # zero at the start
    r = CliRunner().invoke(app, args + ["--stage", "2"])
    assert r.exit_code == 0, r.output
    rec2 = json.loads((out / "stage2" / "training.json").read_text())
    assert rec2["step_plan"]["teacher_dtype"] == "bf16" and rec2["step_plan"]["new_params_only"] is False
    assert rec2["config"]["train"]["new_params_only"] is False and rec2["config"]["train_options"] == {"teacher_dtype": "bf16"}


def _new_params_dp_worker(tok, root: str) -> dict:
    """One gloo rank: stage 1 with new_params_only through DDP (fast step) and FSDP2 (plain step); the full weights."""
    from pathlib import Path

    from headscope.train.parallel import full_state_dict, is_sharded
    from test_train_ddp import _trainer

    out = {}
    for mode, fast in (("ddp", True), ("fsdp", False)):
        tr = _trainer(tok, Path(root), 1, Path(root) / mode, ckpt_on_exit=False, data_parallel=mode, fast=fast,
                      new_params_only=True)
        tr.run()
        sd = full_state_dict(tr.student) if is_sharded(tr.student) else tr.student.state_dict()
        out[mode] = {k: v.detach().clone() for k, v in sd.items()}
    return out


@pytest.mark.slow
def test_new_params_only_under_ddp_and_fsdp2(small_tokenizer, tmp_path):
    """Two gloo ranks, stage 1 with new_params_only through DDP and FSDP2 (whose units then mix frozen and trained
    parameters): the copied weights stay bit-identical and the new ones end where one process puts them (1e-6)."""
    from headscope.runtime import launch
    from test_train_ddp import HMASK, _trainer

    teacher = tiny_llama(small_tokenizer, seed=3)
    torch.manual_seed(7)
    start = hybridize(teacher, HMASK).state_dict()
    torch.save(start, tmp_path / "student0.pt")
    info = launch(_new_params_dp_worker, 2, (small_tokenizer, str(tmp_path)), device="cpu")
    tr = _trainer(small_tokenizer, tmp_path, 1, tmp_path / "one", ckpt_on_exit=False, new_params_only=True)
    tr.run()
    ref = tr.student.state_dict()
    for mode in ("ddp", "fsdp"):
        got = info[mode]
        assert sorted(got) == sorted(ref)
        for k in ref:
            if _is_new(k):
                assert not torch.equal(ref[k], start[k]) and (got[k] - ref[k]).abs().max() <= 1e-6, (mode, k)
            else:
                assert torch.equal(got[k], start[k]), (mode, k)
