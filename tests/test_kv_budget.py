"""Masks at a KV-cache budget (issue 62 item 4, headscope/kv_budget.py, `headscope mask`): the head-wise arm is the
best set of FA heads within L layers' KV groups, checked against a brute-force search over every head subset of tiny
score tables (one KV head per layer and GQA); without a KV limit it is HeadMask.select's top-K; per-group counts,
the layer-wise arm, the budgets' errors, and the command on a saved ranking of Gemma 3 270M's geometry."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from headscope.cli import app
from headscope.kv_budget import check_kv_budget, layerwise_at, select_in_kv_budget
from headscope.masks import HeadMask
from headscope.scores import Ranking
from headscope.selectors.layerwise import even_layers


def _brute(scores: np.ndarray, n_kv: int, kv_layers: int, k: int) -> tuple[float, set]:
    """The best summed score of k heads lying in at most kv_layers * n_kv KV groups, over every k-subset of heads."""
    n_layers, n_heads = scores.shape
    per = n_heads // n_kv
    heads = [(layer, h) for layer in range(n_layers) for h in range(n_heads)]
    best, arg = -np.inf, None
    for sub in itertools.combinations(heads, k):
        if len({(layer, h // per) for layer, h in sub}) > kv_layers * n_kv:
            continue
        v = sum(scores[layer, h] for layer, h in sub)
        if v > best:
            best, arg = v, set(sub)
    return best, arg


@pytest.mark.parametrize("n_layers,n_heads,n_kv", [(4, 3, 1), (3, 4, 2)])
def test_headwise_arm_is_the_brute_force_optimum(n_layers, n_heads, n_kv):
    for seed in range(3):
        scores = np.random.default_rng(seed).normal(size=(n_layers, n_heads))
        for kv_layers in range(1, n_layers + 1):
            for k in range(1, kv_layers * n_heads + 1):
                m = select_in_kv_budget(scores, n_kv, kv_layers, budget=k)
                want, chosen = _brute(scores, n_kv, kv_layers, k)
                assert set(m.heads()) == chosen, (seed, kv_layers, k)
                assert m.meta["score_sum"] == pytest.approx(want, abs=1e-12) and m.n_fa == k
                assert m.kv_cache_fraction <= kv_layers / n_layers + 1e-12
                if n_kv == 1:
                    assert len(m.meta["layers"]) <= kv_layers


def test_without_a_kv_limit_it_is_the_global_top_k():
    scores = np.random.default_rng(7).normal(size=(6, 4))
    for k in (1, 5, 9, 24):
        free = select_in_kv_budget(scores, 1, 6, budget=k)
        assert free.heads() == HeadMask.select(scores, k, 1, min_per_layer=0).heads()


def test_heads_per_group_takes_the_groups_whose_top_k_score_most():
    rng = np.random.default_rng(3)
    scores = rng.normal(size=(5, 4))
    for j, L in ((1, 2), (2, 3), (4, 2)):
        m = select_in_kv_budget(scores, 1, L, heads_per_group=j)
        top = np.sort(scores, axis=1)[:, ::-1][:, :j].sum(1)
        best = max(itertools.combinations(range(5), L), key=lambda c: top[list(c)].sum())
        assert m.meta["layers"] == sorted(best) and all(len(m.fa_heads[i]) == j for i in best)
        assert m.meta["score_sum"] == pytest.approx(top[list(best)].sum()) and m.kv_cache_fraction == L / 5
    # GQA: per KV group, the group's own heads
    g = select_in_kv_budget(np.arange(12.0).reshape(3, 4), 2, 1, heads_per_group=2)
    assert g.heads() == [(2, 0), (2, 1), (2, 2), (2, 3)]  # groups (2, 1) and (2, 0): 21 and 17 of the table
    assert g.kv_cache_fraction == 2 / 6 and g.n_fa == 4


def test_layerwise_arm_and_the_equal_kv_share():
    scores = np.random.default_rng(5).normal(size=(18, 4))  # Gemma 3 270M: 18 layers x 4 query heads, 1 KV head
    for L in (1, 3, 6):
        even = layerwise_at(scores, 1, L)
        assert even.meta["layers"] == even_layers(18, L) and even.n_fa == 4 * L
        best = layerwise_at(scores, 1, L, by="score")
        assert best.meta["layers"] == sorted(np.argsort(-scores.sum(1), kind="stable")[:L].tolist())
        head = select_in_kv_budget(scores, 1, L, budget="7:1" if 4 * L >= 9 else L)
        assert head.kv_cache_fraction <= even.kv_cache_fraction == best.kv_cache_fraction == L / 18
        assert head.meta["score_sum"] >= best.meta["score_sum"] - 1e-12 or head.n_fa < best.n_fa
    # the layer-wise arm by score is the head-wise arm with every head of a layer
    assert layerwise_at(scores, 1, 3, by="score").heads() == select_in_kv_budget(scores, 1, 3, heads_per_group=4).heads()


def test_budget_errors_name_the_fix():
    with pytest.raises(ValueError, match="does not fit the KV cache of 2 layer"):
        check_kv_budget(18, 4, 1, 2, budget="7:1")  # 9 heads > 2 layers x 4
    with pytest.raises(ValueError, match="one of the two"):
        check_kv_budget(18, 4, 1, 2)
    with pytest.raises(ValueError, match="one of the two"):
        check_kv_budget(18, 4, 1, 2, budget=4, heads_per_group=2)
    with pytest.raises(ValueError, match="kv_layers"):
        check_kv_budget(18, 4, 1, 19, budget=4)
    with pytest.raises(ValueError, match="--heads-per-group.*4 query heads"):
        check_kv_budget(18, 4, 1, 2, heads_per_group=5, cli=True)
    assert check_kv_budget(18, 4, 1, 3, budget="7:1") == 9


def _ranking(tmp_path, n_layers=18, n_heads=4, n_kv=1, seed=0):
    s = np.random.default_rng(seed).random((n_layers, n_heads))
    df = pd.DataFrame([{"layer": i, "head": h, "kv_group": h // (n_heads // n_kv), "score": s[i, h]}
                       for i in range(n_layers) for h in range(n_heads)])
    df["rank"] = df["score"].rank(ascending=False, method="first").astype(int)
    geo = {"n_layers": n_layers, "n_heads": n_heads, "n_kv_heads": n_kv, "d_head": 8, "d_model": 32, "n_ctx": 512}
    Ranking(df, geo, {"model": "gemma-like"}).save(tmp_path / "rank")
    return s


def test_mask_command_writes_both_arms_at_the_same_kv_share(tmp_path):
    s = _ranking(tmp_path)
    r = CliRunner().invoke(app, ["mask", str(tmp_path / "rank"), "--kv-layers", "3", "--budget", "7:1"])
    assert r.exit_code == 0, r.output
    d = tmp_path / "rank" / "kv_L3"
    head, layer = HeadMask.from_json(d / "headwise.json"), HeadMask.from_json(d / "layerwise.json")
    assert head == select_in_kv_budget(s, 1, 3, budget="7:1") and layer == layerwise_at(s, 1, 3)
    rec = json.loads((d / "kv_budget.json").read_text())
    arms = {a["arm"]: a for a in rec["arms"]}
    assert arms["headwise"]["n_fa"] == 9 and len(arms["headwise"]["layers"]) <= 3
    assert arms["layerwise (even)"]["n_fa"] == 12 and arms["layerwise (even)"]["kv_cache_fraction"] == 3 / 18
    assert arms["headwise"]["kv_cache_fraction"] <= 3 / 18
    assert "headwise: 9 FA heads of 72" in r.output and "layerwise (even): 12 FA heads of 72, KV cache kept 16.7%" in r.output
    # bad budgets: one line, exit code 2
    for args, msg in ((["--kv-layers", "2", "--budget", "7:1"], "--budget '7:1' = 9 FA heads does not fit"),
                      (["--kv-layers", "2"], "--budget"), (["--kv-layers", "2", "--budget", "4", "--layerwise", "odd"], "--layerwise")):
        r = CliRunner().invoke(app, ["mask", str(tmp_path / "rank"), *args])
        assert r.exit_code == 2 and msg in r.output, (args, r.output)


@pytest.mark.usefixtures("one_thread")
def test_both_arms_convert_a_tiny_mqa_gemma3_and_hold_the_same_kv_cache(small_tokenizer, tmp_path):
    """A tiny Gemma 3 with one KV head per layer (4 layers, sliding and full): the head-wise arm (3 FA heads in at most
    2 layers) and the layer-wise arm (2 whole layers) convert with the product path (`convert_model`,
    --deterministic), and the trained students' own caches after a forward hold the K/V of 2 layers each."""
    import torch

    from headscope.arch.random_models import _families
    from headscope.train import ConvertRecipe, convert_model
    from headscope.train.model_folder import load_model_folder

    from test_convert import corpus_text

    tok = small_tokenizer
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    teacher = _families(4, 64, 4, 1)["gemma3"](len(tok), 2)
    (tmp_path / "c.txt").write_text(corpus_text())
    recipe = ConvertRecipe(seq_len=128, long_len=256, batch_size=2, batch_long=2, corpus=str(tmp_path / "c.txt"),
                           stage_tokens=(256, 512, 512), ckpt_every=0)
    s = np.random.default_rng(0).random((4, 4))
    ids = torch.tensor([tok("The sailor walked to the harbour in the morning.").input_ids])
    for name, m in (("head", select_in_kv_budget(s, 1, 2, budget=3)), ("layer", layerwise_at(s, 1, 2))):
        assert len(m.meta["layers"]) <= 2 and m.kv_cache_fraction <= 2 / 4
        res = convert_model(teacher, tok, m, tmp_path / name, recipe=recipe, progress=False,
                            train_options={"deterministic": True})
        assert res["finished"]
        student = load_model_folder(tmp_path / name / "stage3").eval()
        with torch.no_grad():
            caches = student(ids, use_cache=True).past_key_values.decode_caches
        held = [i for i, c in enumerate(caches) if c is not None and c.k is not None]
        assert held == [i for i, hs in enumerate(m.fa_heads) if hs] and len(held) == round(4 * m.kv_cache_fraction)
        assert all(caches[i].k.shape[1] == 1 for i in held)  # the layer's one KV head, whole
