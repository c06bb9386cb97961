"""The readout as one value, the frozen configs, the CLI generated from them, one front door (issue 18)."""

from __future__ import annotations

import dataclasses
import json
import warnings

import pytest
import torch

import headscope
from headscope.rank_config import FusionConfig, RankConfig, ScreenConfig, cli_fields, config_from_cli
from headscope.errors import HeadscopeInputError
from headscope.readout import Readout, logit_diff, normalized_ie


@pytest.fixture(scope="module")
def pair(smol_tokenizer):
    from headscope.tasks import niah_single

    return niah_single(smol_tokenizer, n_pairs=1, seq_len=64, depth=0.5, seed=0)[0]


def test_readout_metric_and_normalization_are_eq9_and_eq10():
    r = Readout(lam=0.5, direction="noising", min_gap=0.2)
    logits = torch.zeros(2, 5)
    logits[0, 1], logits[0, 2] = 3.0, 1.0  # token 0: a+ = 1, a- = 2 -> 2
    logits[1, 3], logits[1, 4] = 0.0, 4.0  # token 1: a+ = 3, a- = 4 -> -4
    a, c = torch.tensor([1, 3]), torch.tensor([2, 4])
    # (1 * 2 + 0.5 * -4) / 1.5 = 0
    assert float(r.metric(logits, a, c)) == pytest.approx(0.0, abs=1e-12)
    assert float(r.metric(logits, a, c)) == float(logit_diff(logits, a, c, 0.5))
    assert float(r.normalized_ie(torch.tensor(1.0), 3.0, -1.0)) == pytest.approx(0.5)
    d = Readout(direction="denoising")
    assert float(d.normalized_ie(torch.tensor(1.0), 3.0, -1.0)) == pytest.approx(0.5)
    assert float(d.normalized_ie(torch.tensor(2.0), 3.0, -1.0)) == float(normalized_ie(torch.tensor(2.0), 3.0, -1.0, "denoising"))
    assert r.to_dict() == {"lam": 0.5, "direction": "noising", "min_gap": 0.2}
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.lam = 0.9  # type: ignore[misc]


def test_readout_validates_once_and_resolves_old_keywords():
    with pytest.raises(HeadscopeInputError, match=r"lam=0 must lie in \(0, 1\]"):
        Readout(lam=0)
    with pytest.raises(HeadscopeInputError, match="is not one of noising, denoising"):
        Readout(direction="sideways")
    with pytest.raises(HeadscopeInputError, match="min_gap=-1"):
        Readout(min_gap=-1)
    assert Readout.resolve(None, lam=0.7) == Readout(lam=0.7)
    r = Readout(lam=0.7)
    assert Readout.resolve(r, lam=0.7) is r
    with pytest.raises(HeadscopeInputError, match="contradicts readout"):
        Readout.resolve(r, lam=0.9)


def test_rank_config_roundtrip_and_validation():
    cfg = RankConfig(tasks=["niah_single", "induction"], depth=[0.2, 0.8], dtype=torch.bfloat16,
                     fusion=FusionConfig(weights=[0.25, 0.75], senders=True))
    assert cfg.tasks == ("niah_single", "induction") and cfg.depth == (0.2, 0.8) and cfg.dtype == "bfloat16"
    assert cfg.torch_dtype is torch.bfloat16 and cfg.fused
    d = json.loads(json.dumps(cfg.to_dict()))
    assert d["readout"] == {"lam": 0.9, "direction": "noising", "min_gap": 0.1}
    assert d["fusion"]["weights"] == [0.25, 0.75] and d["screen"]["verify"] == "auto"
    assert RankConfig.from_dict(d) == cfg
    assert not RankConfig().fused
    with pytest.raises(HeadscopeInputError, match="n_pairs=0"):
        RankConfig(n_pairs=0)
    with pytest.raises(HeadscopeInputError, match="weights .* sum to 0.5"):
        RankConfig(tasks=("niah_single", "induction"), fusion=FusionConfig(weights=(0.25, 0.25)))
    with pytest.raises(HeadscopeInputError, match="atp_slack=0.5 must be >= 1"):
        ScreenConfig(atp_slack=0.5)
    with pytest.raises(HeadscopeInputError, match="path='fastest' is not one of auto, fast, generic"):
        RankConfig(path="fastest")
    kw = RankConfig.from_kwargs(lam=0.5, verify=3, senders=True, top_k=4, n_pairs=2)
    assert (kw.readout.lam, kw.screen.verify, kw.fusion.senders, kw.fusion.top_k, kw.n_pairs) == (0.5, 3, True, 4, 2)
    with pytest.raises(TypeError, match="no setting 'n_pair'"):
        RankConfig.from_kwargs(n_pair=2)


def test_cli_options_are_generated_from_the_configs():
    """Every rank() setting that the CLI offers comes from a config field; the defaults are the configs'."""
    from typer.testing import CliRunner

    from headscope.cli import app

    flags = {f.flag: f for f in cli_fields()}
    assert flags["--lambda"].default == Readout().lam == 0.9
    assert flags["--min-gap"].default == Readout().min_gap
    assert {"--task", "--pairs", "--seq-len", "--depth", "--seed", "--direction", "--mode", "--path", "--verify",
            "--spot-checks", "--senders", "--weight", "--kappa", "--normalize", "--sender-mode", "--top-k",
            "--max-rounds", "--device", "--dtype", "--device-map"} <= set(flags)
    out = CliRunner().invoke(app, ["rank", "--help"], terminal_width=200).output
    for flag in flags:
        assert flag in out, flag
    values = {f.name: f.default for f in cli_fields()}
    values.update(readout_lam=0.5, screen_verify="7", depth=[0.3])
    kw = config_from_cli(values)
    assert kw["lam"] == 0.5 and kw["verify"] == 7 and kw["depth"] == 0.3 and kw["weights"] is None
    assert RankConfig.from_kwargs(**kw) == RankConfig(readout=Readout(lam=0.5), depth=0.3, screen=ScreenConfig(verify=7))


def test_rank_with_config_equals_keywords_and_saves_it(tiny, tmp_path):
    kw = dict(n_pairs=1, seq_len=64, min_gap=0.0, progress=False)
    a = headscope.rank(tiny, **kw)
    cfg = RankConfig(n_pairs=1, seq_len=64, readout=Readout(min_gap=0.0))
    b = headscope.rank(tiny, config=cfg, progress=False, out_dir=tmp_path / "r")
    assert torch.equal(a.ie, b.ie)
    saved = headscope.Ranking.load(tmp_path / "r").provenance["config"]
    assert RankConfig.from_dict(saved) == cfg
    with pytest.raises(HeadscopeInputError, match=r"rank\(config=...\) with \['n_pairs'\]"):
        headscope.rank(tiny, config=cfg, n_pairs=3)
    # select("causal") is the same call
    c = headscope.selectors.select(tiny, "causal", n_pairs=1, seq_len=64, min_gap=0.0)
    assert torch.equal(a.ie, c.ie) and c.provenance["selector"] == "causal"


def test_loaded_model_conflicts_raise_naming_the_fix(tiny):
    with pytest.raises(HeadscopeInputError, match=r"dtype=torch.bfloat16 but the given model computes in torch.float32"):
        headscope.rank(tiny, dtype=torch.bfloat16, n_pairs=1, seq_len=64)
    if not torch.cuda.is_available():
        with pytest.raises(HeadscopeInputError, match="use device cpu"):
            headscope.rank(tiny, device="cuda", n_pairs=1, seq_len=64)
    from headscope.api import check_loaded_model

    with pytest.raises(HeadscopeInputError, match="device='meta' but the given model is loaded on cpu; drop device="):
        check_loaded_model(tiny, _cfg_on("meta"))
    check_loaded_model(tiny, _cfg_on("cpu"))  # agrees: no error


def _cfg_on(device: str) -> RankConfig:
    cfg = RankConfig()
    object.__setattr__(cfg, "device", device)  # past check_device, to test the model check alone
    return cfg


def test_old_lam_keywords_still_work(tiny, pair):
    from headscope.patching.receivers import receiver_patching

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        old = receiver_patching(tiny, [pair], lam=0.5, direction="denoising", min_gap=0.0, progress=False)
        new = receiver_patching(tiny, [pair], readout=Readout(0.5, "denoising", 0.0), progress=False)
    assert torch.equal(old.ie, new.ie) and old.readout == new.readout and old.lam == 0.5
    assert old.direction == "denoising"
    with pytest.raises(HeadscopeInputError, match="contradicts readout"):
        receiver_patching(tiny, [pair], lam=0.9, readout=Readout(0.5))
