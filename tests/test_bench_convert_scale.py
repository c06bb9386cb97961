"""benchmarks/bench_convert_scale.py on the CPU at the tiny shape: the JSON it writes (cases, baseline, ratio, check),
its counted FLOPs and MFU against numbers worked out by hand, the fast-vs-plain check agreeing in float32, and the
equal-budget mask."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCH))
    try:
        import bench_convert_scale
    finally:
        sys.path.remove(str(BENCH))
    return bench_convert_scale


def test_tiny_run_writes_every_field_and_the_flops_worked_by_hand(bench, tmp_path):
    out = tmp_path / "scale.json"
    rep = bench.main(["--shape", "tiny", "--out", str(out), "--stages", "2", "--rows", "4,4,2", "--seq-len", "16,16,32",
                      "--stage3-long", "", "--steps", "1", "--warmup", "1", "--grad-accum", "2", "--no-compile",
                      "--check", "--check-rows", "2x16", "--check-steps", "2", "--profile", "1", "--device", "cpu"])
    on_disk = json.loads(out.read_text())
    assert on_disk["cases"].keys() == rep["cases"].keys() == {"stage2_4x16"} and not on_disk["errors"]
    c = on_disk["cases"]["stage2_4x16"]
    h, b = c["hybrid"], c["baseline"]
    # one warm-up step, one timed step, one profiled step (not timed)
    assert h["status"] == b["status"] == "done" and len(h["steps"]) == len(b["steps"]) == 3
    for r in (h, b):
        pr = r["profile"]
        assert r["timed_steps"] == 1 and pr["steps"] == 1 and pr["wall_ms_per_step"] > 0 and pr["time"] == "self CPU"
        top = [x["ms_per_step"] for x in pr["top"]]
        assert top and min(top) > 0 and top == sorted(top, reverse=True) and pr["device_busy_ms_per_step"] >= sum(top)
    assert c["grad_accum"] == 2 and c["micro_rows"] == 2 and h["step_plan"]["grad_accum"] == 2 and h["step_plan"]["fast"]
    assert c["planned_gib"] > 0 and h["peak_memory"]["bytes"] > 0

    # counted FLOPs per token at T = 16, by hand. Teacher (Qwen3, d = 64, 4 q / 2 kv heads of 16, MLP 128, 2 layers,
    # vocabulary 512): linear weights per layer q 64·64 + k 64·32 + v 64·32 + o 64·64 + MLP 3·64·128 = 36,864, two
    # layers + the LM head 512·64 = 106,496; F = 2·106,496 + 2·2·(16/2)·16 per head · 8 heads = 217,088.
    F_t = 2 * 106_496 + 4 * 8 * 16 * 8
    assert F_t == 217_088
    # the student: equal-budget 7:1 of 4 heads -> 1 FA head per layer (2 FA, 6 GDN heads), its linear weights counted
    import torch.nn as nn

    cfg = bench.teacher_config("tiny")
    mask = bench.equal_budget_mask(cfg)
    assert [list(x) for x in mask.fa_heads] == [[0], [0]]
    from headscope.train.pipeline import load_student

    # the student of `headscope convert`'s recipe (its FA output gate g_proj is a linear map too)
    student = load_student(bench.build_teacher("tiny", torch.device("cpu"), torch.float32), mask, **bench.STUDENT_OPTIONS)
    assert bench.STUDENT_OPTIONS["fa_gate"] and any(n.endswith("g_proj.weight") for n, _ in student.named_parameters())
    W_s = sum(m.weight.numel() for m in student.modules() if isinstance(m, nn.Linear))
    F_s = 2 * W_s + 4 * 8 * 16 * 2 + 2 * (5 * 64 * 16 + 3 * 16 * 16) * 6
    assert h["flops_per_token"]["total"] == pytest.approx(F_t + 3 * F_s, rel=1e-12)
    assert b["flops_per_token"]["total"] == pytest.approx(4 * F_t, rel=1e-12)  # 3 x dense + the teacher forward
    for r in (h, b):
        timed = sorted(s["seconds"] for s in r["steps"][1:2])
        sec = timed[len(timed) // 2]
        assert r["ms_per_step"] == pytest.approx(1e3 * sec)
        assert r["tokens_per_s"] == pytest.approx(64 / sec)
        assert r["mfu"] == pytest.approx(r["flops_per_token"]["total"] * 64 / sec / 989.4e12)
    assert c["ratio_tok_s"] == pytest.approx(h["tokens_per_s"] / b["tokens_per_s"])

    # the check: in float32 on a CPU the fast step's loss and gradients are the plain step's to float rounding
    ck = on_disk["check"]["stage2_2x16"]
    assert len(ck["batches"]) == 2 and ck["bf16"] is False
    assert ck["max"]["loss_rel_fast_vs_plain"] < 1e-5 and ck["max"]["grad_fast_vs_plain"] < 1e-5
    assert ck["batches"][0]["loss_fast"] != ck["batches"][1]["loss_fast"]  # AdamW moved the weights between batches


def test_rel_err_by_hand(bench):
    a = [torch.tensor([3.0, 4.0]), torch.tensor([1.0])]
    b = [torch.tensor([3.0, 0.0]), torch.tensor([2.0])]
    r = bench.rel_err(a, b, ["x", "y"])
    # ‖a − b‖ = √(16 + 1), ‖b‖ = √(9 + 4); per tensor 4/3 and 1/2
    assert r["global"] == pytest.approx((17 / 13) ** 0.5)
    assert r["worst"] == pytest.approx(4 / 3) and r["worst_parameter"] == "x"


def test_stage1_counts_the_teacher_body_without_its_lm_head(bench):
    from headscope.train.fast import flops_per_token
    from headscope.train.pipeline import load_student

    cfg = bench.teacher_config("tiny")
    teacher = bench.build_teacher("tiny", torch.device("cpu"), torch.float32)
    student = load_student(teacher, bench.equal_budget_mask(cfg))
    f1 = bench.counted_flops(1, student, teacher, 32)
    assert f1["teacher_forward"] == flops_per_token(teacher, 32, backward=False)["total"] - 2 * 512 * 64
    assert f1["student_train"] == flops_per_token(student, 32, backward=True, attention_only=True)["total"]
    assert bench.counted_flops(3, student, teacher, 32)["teacher_forward"] == 0.0
    # the weights are bf16 values held in float32 (as a bf16 checkpoint loaded by `headscope convert`)
    w = teacher.model.layers[0].mlp.up_proj.weight
    assert w.dtype == torch.float32 and torch.equal(w, w.to(torch.bfloat16).float())


def test_resume_check_on_cpu_is_bit_exact(bench, tmp_path):
    """--resume-check: cut after 1 of 2 steps (exit checkpoint), resumed in a new trainer: on a CPU the final weights
    equal the uninterrupted run's bit for bit, the losses too, and the record says what training moved."""
    out = tmp_path / "resume.json"
    bench.main(["--shape", "tiny", "--out", str(out), "--stages", "", "--resume-check", "2", "--resume-rows", "2x16",
                "--resume-steps", "2", "--no-compile", "--device", "cpu"])
    r = json.loads(out.read_text())
    assert not r["errors"]
    e = r["resume"]["stage2_2x16"]
    assert e["cut"]["steps"] == 1 and e["resumed"]["steps"] == 2 and e["losses_equal"]
    assert e["checkpoint_bytes"] > 0
    c = e["resumed_vs_uninterrupted"]
    assert c["max_abs_diff"] == 0.0 and c["tensors_bitwise_equal"] == c["tensors"] > 0 and c["max_moved"] > 0


def test_teacher_dtype_and_new_params_only_are_the_trainer_settings(bench, tmp_path):
    """--teacher-dtype bf16 --new-params-only reach the trainer (TrainConfig fields, recorded in the step plan): stage 1
    trains exactly the parameters the hybrid adds (their count is the memory plan's ``new``), the teacher held in
    bf16, the student in fp32."""
    from headscope.train.memory_plan import MemoryOptions, ModelShape, plan_memory

    rep = bench.main(["--shape", "tiny", "--out", str(tmp_path / "s.json"), "--stages", "1", "--rows", "2,2,2",
                      "--seq-len", "16,16,32", "--stage3-long", "", "--steps", "1", "--warmup", "1", "--no-compile",
                      "--no-baseline", "--teacher-dtype", "bf16", "--new-params-only", "--device", "cpu"])
    assert not rep["errors"] and rep["teacher_dtype"] == "bf16" and rep["settings"]["new_params_only"]
    h = rep["cases"]["stage1_2x16"]["hybrid"]
    assert h["step_plan"]["teacher_dtype"] == "bf16" and h["step_plan"]["new_params_only"] is True
    cfg = bench.teacher_config("tiny")
    # the bench's student is `headscope convert`'s: its recipe's hybrid options, the FA output gate included
    plan = plan_memory(ModelShape.from_config(cfg), 1, 2, 16, fa=bench.equal_budget_mask(cfg),
                       options=MemoryOptions(new_params_only=True, fa_gate=bench.STUDENT_OPTIONS["fa_gate"]))
    assert h["trained_parameters"] == plan.counts["new"] > 0


def test_profile_summary_counts_each_kernel_once_and_no_cupti_marker(bench):
    """The H100 profile of 2026-12-06 summed the launching operators' time with their kernels' and CUPTI's
    'Command Buffer Full' records (busy share 1.94 and 3.08). Hand-made events: kernels A [0, 100] µs and B [50, 150]
    µs on two streams (union 150 µs), A again [400, 500]; a marker over [0, 1000]; a CPU operator [0, 600]."""
    from types import SimpleNamespace as NS

    from torch.autograd import DeviceType

    def ev(name, a, b, dev=DeviceType.CUDA, cpu=0.0):
        return NS(name=name, device_type=dev, time_range=NS(start=a, end=b), self_cpu_time_total=cpu)

    events = [ev("A", 0, 100), ev("B", 50, 150), ev("A", 400, 500), ev("Command Buffer Full", 0, 1000),
              ev("aten::mm", 0, 600, DeviceType.CPU, cpu=600.0)]
    s = bench.profile_summary(events, n_steps=2, wall_s=1e-3, device_kernels=True)
    assert s["wall_ms_per_step"] == pytest.approx(0.5)
    assert s["device_busy_ms_per_step"] == pytest.approx(0.250 / 2)  # (150 + 100) µs over 2 steps
    assert s["busy_share"] == pytest.approx(0.25)
    assert [(r["name"], r["ms_per_step"], r["calls_per_step"]) for r in s["top"]] == [
        ("A", pytest.approx(0.1), 1.0), ("B", pytest.approx(0.05), 0.5)]
    c = bench.profile_summary(events, n_steps=1, wall_s=1e-3, device_kernels=False)
    assert [r["name"] for r in c["top"]] == ["aten::mm"] and c["device_busy_ms_per_step"] == pytest.approx(0.6)
