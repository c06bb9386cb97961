import json

import headscope.api

from typer.testing import CliRunner

from headscope.cli import app
from headscope.masks import HeadMask
from headscope.scores import Ranking


def test_rank_command_writes_outputs(tiny_dir, tmp_path):
    model_dir = tiny_dir
    out = tmp_path / "run"
    args = ["rank", "--model", str(model_dir), "--pairs", "2", "--seq-len", "64", "--budget", "3",
            "--min-gap", "0", "--out", str(out), "--device", "cpu"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    assert "top 8 heads" in res.output or "top 10 heads" in res.output
    r = Ranking.load(out)
    assert len(r.scores) == 8 and sorted(r.scores["rank"]) == list(range(1, 9))
    assert r.provenance["model_spec"] == str(model_dir) and r.provenance["direction"] == "noising"
    m = HeadMask.from_json(out / "mask.json")
    assert m.n_fa == 3 and all(len(h) >= 1 for h in m.fa_heads)
    kept = sum(len(g) for g in m.kv_groups())  # the printed KV line counts the kept groups of the mask
    assert f"KV cache kept {kept / (m.n_layers * m.n_kv_heads):.1%} ({kept} of {m.n_layers * m.n_kv_heads} KV groups" in res.output
    assert json.loads((out / "mask.json").read_text())["meta"]["n_pairs"] == 2
    assert (out / "heatmap.html").stat().st_size > 1000
    # the mask's heads are the best-scored ones of each layer plus the global best
    best = r.top(1).iloc[0]
    assert int(best["head"]) in m.fa_heads[int(best["layer"])]


def test_bad_input_exits_with_message(tiny_dir, tmp_path):
    res = CliRunner().invoke(app, ["rank", "--model", "nope-model", "--out", str(tmp_path)])
    assert res.exit_code == 2 and "unknown model spec" in res.output
    res = CliRunner().invoke(app, ["rank", "--model", "smollm2-135m", "--pairs", "0", "--out", str(tmp_path)])
    assert res.exit_code == 2 and "at least one calibration pair" in res.output
    model_dir = tiny_dir
    res = CliRunner().invoke(app, ["rank", "--model", str(model_dir), "--pairs", "1", "--seq-len", "64",
                                   "--budget", "2", "--out", str(tmp_path / "r")])
    # a random model cannot tell the two needle values apart: a zero gap is refused, not divided by
    assert res.exit_code == 2 and "gap below min_gap=0.1" in res.output
    res = CliRunner().invoke(app, ["rank", "--model", str(model_dir), "--pairs", "1", "--seq-len", "64",
                                   "--min-gap", "0", "--budget", "9", "--out", str(tmp_path / "r2")])
    assert res.exit_code == 2 and "outside 1..8" in res.output
    assert not (tmp_path / "r2").exists()  # the budget is checked before any patching


def test_rank_screen_mode_flags(tiny_dir, tmp_path):
    base = ["rank", "--model", str(tiny_dir), "--pairs", "2", "--seq-len", "64", "--budget", "3", "--min-gap", "0",
            "--device", "cpu", "--mode", "screen"]
    res = CliRunner().invoke(app, base + ["--verify", "2", "--spot-checks", "1", "--out", str(tmp_path / "a")])
    assert res.exit_code == 0, res.output
    assert "screen: 2 head(s) verified exactly; 1 spot checks found" in res.output
    r = Ranking.load(tmp_path / "a")
    assert int(r.scores["verified"].sum()) == 3  # 2 verified + 1 spot check
    res = CliRunner().invoke(app, base + ["--verify", "most", "--out", str(tmp_path / "b")])
    assert res.exit_code == 2 and "--verify 'most'" in res.output


def test_small_budget_is_raised_after_ranking(tiny_dir, tmp_path, monkeypatch):
    # the default 7:1 keeps round(8/8) = 1 of 8 heads: too few for one FA head in each of 2 layers.
    # The ranking runs and is saved; the mask's budget is raised to 2 = 1 x 2 layers, with a note.
    out = tmp_path / "r"
    args = ["rank", "--model", str(tiny_dir), "--pairs", "1", "--seq-len", "64", "--min-gap", "0",
            "--device", "cpu", "--out", str(out)]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    assert "raised to 2" in res.output
    r = Ranking.load(out)
    m = HeadMask.from_json(out / "mask.json")
    s = r.matrix("score")
    assert m.fa_heads == ((int(s[0].argmax()),), (int(s[1].argmax()),))  # each layer's best head
    d = json.loads((out / "mask.json").read_text())
    assert d["summary"]["n_fa"] == 2 and d["meta"]["n_fa_requested"] == 1
    assert "raised to 2" in d["summary"]["notes"][0] and d["meta"]["budget_note"] == d["summary"]["notes"][0]
    # a mask step that fails writes no mask, keeps the ranking and says so
    monkeypatch.setattr(Ranking, "mask", lambda self, *a, **k: (_ for _ in ()).throw(ValueError("boom")))
    out2 = tmp_path / "r2"
    res = CliRunner().invoke(app, args[:-1] + [str(out2)])
    assert res.exit_code == 1 and "no mask.json written: boom" in res.output
    assert not (out2 / "mask.json").exists() and len(Ranking.load(out2).scores) == 8


def test_rank_dtype_flag_loads_and_records_the_dtype(tiny_dir, tmp_path):
    out = tmp_path / "bf16"
    args = ["rank", "--model", str(tiny_dir), "--pairs", "1", "--seq-len", "64", "--budget", "3", "--min-gap", "0",
            "--device", "cpu", "--out", str(out)]
    res = CliRunner().invoke(app, args + ["--dtype", "bfloat16"])
    assert res.exit_code == 0, res.output
    r = Ranking.load(out)
    assert r.provenance["dtype"] == "bfloat16" and r.provenance["config"]["dtype"] == "bfloat16"
    assert len(r.scores) == 8
    res = CliRunner().invoke(app, args[:-1] + [str(tmp_path / "bad"), "--dtype", "int8"])
    assert res.exit_code == 2 and "--dtype 'int8': use float32, bfloat16 or float16" in res.output
    assert not (tmp_path / "bad").exists()  # refused before the model loads


def test_rank_without_plotly_keeps_the_ranking_and_says_so(tiny_dir, tmp_path, monkeypatch):
    """A machine without plotly (wheels installed with --no-deps) still gets scores, mask and the summary:
    the heatmap is skipped with a warning naming the fix, and the exit code is 0."""
    import sys

    for name in ("headscope.plots", "plotly", "plotly.graph_objects"):
        monkeypatch.setitem(sys.modules, name, None)  # `import` of these now raises ImportError
    out = tmp_path / "run"
    args = ["rank", "--model", str(tiny_dir), "--pairs", "2", "--seq-len", "64", "--budget", "3",
            "--min-gap", "0", "--out", str(out), "--device", "cpu"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    assert not (out / "heatmap.html").exists()
    assert "warning: no heatmap.html written: plotly could not be imported" in res.output
    assert f"wrote {out}/: scores.csv, mask.json, ranking.json" in res.output
    r = Ranking.load(out)
    assert len(r.scores) == 8 and HeadMask.from_json(out / "mask.json").n_fa == 3


def test_rank_runs_each_check_once(tiny_dir, tmp_path, monkeypatch):
    """One `headscope rank` of a tiny model: the config validates itself once, the API checks the model spec, the
    call, the store and (through the CLI's callback) the budget once each, before the model loads."""
    import headscope.rank_config
    import headscope.masks
    import headscope.models
    import headscope.patching.store

    calls: dict[str, list[bool]] = {}
    loaded: list[bool] = []
    load = headscope.models.load_model

    def loading(*a, **k):
        loaded.append(True)
        return load(*a, **k)

    def counted(owner, name, key=None):
        orig = getattr(owner, name)

        def wrapper(*a, **k):
            calls.setdefault(key or name, []).append(bool(loaded))  # True: called after the model loaded
            return orig(*a, **k)

        monkeypatch.setattr(owner, name, wrapper)

    monkeypatch.setattr(headscope.api, "load_model", loading)
    counted(headscope.rank_config.RankConfig, "_validate", "RankConfig._validate")
    counted(headscope.rank_config, "check_rank_call")
    counted(headscope.models, "check_model")
    counted(headscope.patching.store, "check_rank_store")
    counted(headscope.masks, "check_budget")
    res = CliRunner().invoke(app, ["rank", "--model", str(tiny_dir), "--pairs", "1", "--seq-len", "64", "--budget",
                                   "3", "--min-gap", "0", "--device", "cpu", "--out", str(tmp_path / "r")])
    assert res.exit_code == 0, res.output
    assert loaded == [True]
    assert calls == {"RankConfig._validate": [False], "check_rank_call": [False], "check_model": [False],
                     "check_rank_store": [False], "check_budget": [False]}
