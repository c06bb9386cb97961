"""The one-call entry point: :func:`rank` — one :class:`~headscope.rank_config.RankConfig`, three strategies
(exact, screen, fused) behind it. ``headscope.selectors.select(model, "causal", ...)`` is the same call."""

from __future__ import annotations

import inspect
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from .rank_config import RankConfig
from .model_specs import DEFAULT_MODEL
from .models import LoadedModel, load_model
from .patching.receivers import receiver_patching
from .readout import DEFAULT_LAMBDA, DEFAULT_MIN_GAP, Direction, Readout
from .runtime import __version__
from .scores import Ranking, head_table
from .tasks import make_pairs
from .tasks.base import Pair

#: keywords of :func:`rank` that describe the call, not the ranking (not part of RankConfig)
CALL_ARGS = ("model", "pairs", "out_dir", "progress", "shard", "readout", "config")


def rank(
    model: str | LoadedModel = DEFAULT_MODEL,
    tasks: Sequence[str] = ("niah_single",),
    n_pairs: int = 6,
    seq_len: int = 512,
    seed: int = 0,
    depth: float | Sequence[float] = 0.5,
    lam: float = DEFAULT_LAMBDA,
    direction: Direction = "noising",
    min_gap: float = DEFAULT_MIN_GAP,
    pairs: Sequence[Pair] | None = None,
    out_dir: str | Path | None = None,
    device: str | None = None,
    dtype: torch.dtype | None = None,
    batch_size: int | None = None,
    progress: bool = True,
    task_settings: dict[str, Any] | None = None,
    shard: tuple[int, int] | None = None,
    mode: str = "exact",
    verify: int | float | str = "auto",
    spot_checks: int | float = 0.05,
    senders: bool = False,
    weights: Sequence[float] | dict[str, float] | None = None,
    kappa: str | None = None,
    normalize: str = "max",
    sender_mode: str = "qkv",
    top_k: int = 10,
    max_rounds: int = 3,
    sender_batch_size: int = 16,
    device_map: str | dict[str, Any] | None = None,
    path: str = "auto",
    readout: Readout | None = None,
    config: RankConfig | None = None,
) -> Ranking:
    """Rank every attention head by its causal importance for the given capabilities.

    Receiver activation patching of ``hook_z`` (SPEC.md §4, eq. 10) read out with the λ-decayed logit
    difference over the answer span (eq. 9), averaged over ``n_pairs`` calibration pairs per task.

    Args:
        model: ``"smollm2-135m"`` (default), ``"gemma3-270m"``, a local HF directory, a ``.gguf`` path, a
            cached hub id, or a :class:`~headscope.models.LoadedModel` (then ``device`` / ``dtype`` must
            be None or agree with it).
        config: a :class:`~headscope.rank_config.RankConfig` holding every setting below (then pass none of
            them); or the settings as keywords, each documented on the config part that owns it:
            ``tasks, n_pairs, seq_len, seed, depth, task_settings, mode, path, batch_size, device, dtype,
            device_map`` (:class:`RankConfig`), ``lam, direction, min_gap`` or ``readout``
            (:class:`~headscope.readout.Readout`), ``verify, spot_checks`` (:class:`~headscope.rank_config.ScreenConfig`:
            ``mode="screen"``), ``senders, weights, kappa, normalize, sender_mode, top_k, max_rounds,
            sender_batch_size`` (:class:`~headscope.rank_config.FusionConfig`: senders, κ, several tasks).
        pairs: ready-made pairs (overrides task generation; ``tasks`` then only labels them).
        out_dir: per-item results are written there as they finish (a rerun resumes) and the Ranking
            is saved there at the end (``ranking.json`` keeps the whole config as ``provenance["config"]``).
        shard: ``(rank, world_size)`` of a sharded exact sweep (:mod:`headscope.distributed`; needs
            ``out_dir``); every rank returns the merged Ranking, rank 0 saves it.
        progress: show progress bars.

    Returns:
        Ranking (``.scores`` DataFrame, ``.mask(budget)``, ``.heatmap()``, ``.save(dir)``). Receivers only:
        ``score`` = mean receiver IE; screen: plus ``ie_atp``, ``verified``; fused: plus ``ie_send``,
        ``kappa``, ``s_<capability>`` and the fused ``score`` (SPEC.md §6, eq. 11–12).

    Raises:
        HeadscopeInputError (a ValueError), before the model loads: any bad setting (a
        :class:`~headscope.errors.SettingError` naming it; :class:`~headscope.rank_config.RankConfig` and
        :func:`headscope.rank_config.check_rank_call`), a store of another configuration in ``out_dir``, a
        ``device``/``dtype`` that contradicts a loaded model, settings passed beside ``config``;
        ModelSpecError: a model spec that cannot be loaded; InputNotImplementedError: an unsupported
        combination. After the model loads: HeadscopeInputError for a prompt too short for the task's
        text or too long for the context; GapError: no pair separates a⁺ from a⁻.
    """
    given = {k: v for k, v in locals().items() if k not in CALL_ARGS and not _is_default(k, v)}
    cfg = _config(config, readout, given)
    return run(model, cfg, pairs=pairs, out_dir=out_dir, shard=shard, progress=progress)


def check_call(model: str | LoadedModel, cfg: RankConfig, pairs: Sequence[Pair] | None = None,
               out_dir: str | Path | None = None, shard: tuple[int, int] | None = None,
               on_geometry: Callable[[Any], None] | None = None) -> Any:
    """Every check of a ranking call that its config (validated when made) does not hold, once, before the model
    loads: the model spec (its geometry from its config or GGUF metadata), the call with the config
    (:func:`~headscope.rank_config.check_rank_call`), a loaded model against the config's device / dtype, the store in
    ``out_dir``; then ``on_geometry(geometry)`` (a caller's own checks that need the model's shape) where the
    geometry is known. Returns the geometry (None where the spec's config cannot be read before loading).

    Raises:
        HeadscopeInputError: as :func:`rank`, before the model loads.
    """
    from .rank_config import check_rank_call
    from .models import check_model
    from .patching.store import check_rank_store

    geometry = check_model(model)
    check_rank_call(cfg, pairs, out_dir, shard, geometry)
    check_loaded_model(model, cfg)
    if pairs is None:
        check_rank_store(out_dir, cfg.tasks, cfg.fused, model, cfg.settings(), cfg.readout.lam, cfg.readout.direction)
    if on_geometry is not None and geometry is not None:
        on_geometry(geometry)
    return geometry


def run(model: str | LoadedModel, cfg: RankConfig, pairs: Sequence[Pair] | None = None,
        out_dir: str | Path | None = None, shard: tuple[int, int] | None = None, progress: bool = True,
        on_geometry: Callable[[Any], None] | None = None) -> Ranking:
    """:func:`rank` with a ready :class:`~headscope.rank_config.RankConfig`: check the call (:func:`check_call`, once),
    load, run the strategy, save. ``on_geometry``: see :func:`check_call` (called after loading where the geometry
    was unknown before)."""
    geometry = check_call(model, cfg, pairs, out_dir, shard, on_geometry)
    t0 = time.time()
    lm = load_model(model, device=cfg.device, dtype=cfg.torch_dtype or torch.float32,
                    device_map=cfg.device_map if not cfg.fused else None)
    if on_geometry is not None and geometry is None:
        on_geometry(lm.geometry)
    strategy = STRATEGIES["fused" if cfg.fused else cfg.mode]
    df, ie, prov, extras = strategy(lm, cfg, pairs, out_dir, shard, progress)
    df, prov = _hybrid_kinds(lm, df, prov)
    settings = cfg.settings()
    provenance: dict[str, Any] = {
        "headscope_version": __version__, **lm.provenance(), "tasks": list(cfg.tasks), "task_settings": settings,
        "seed": cfg.seed, "direction": cfg.readout.direction, "lambda": cfg.readout.lam,
        "min_gap": cfg.readout.min_gap, **prov, "config": cfg.to_dict(), "seconds": round(time.time() - t0, 1),
    }
    ranking = Ranking(df, lm.geometry.to_dict(), provenance, ie, extras)
    if out_dir is not None and (shard is None or shard[0] == 0):
        ranking.save(out_dir)
    return ranking


def _hybrid_kinds(lm: LoadedModel, df: Any, prov: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """For a head-wise hybrid (a converted model), the score table with a ``kind`` column (``"fa"`` / ``"gdn"``, after
    ``kv_group``) and ``"hybrid": True`` in the provenance, as :func:`headscope.analysis.student_anatomy.rank_heads` writes
    them; any other model's unchanged."""
    from .patching.hybrid_engine import head_kinds, is_hybrid

    if not is_hybrid(lm.hf_model) or "kind" in df.columns:
        return df, prov
    kinds = head_kinds(lm.hf_model)
    df = df.copy()
    df.insert(int(df.columns.get_loc("kv_group")) + 1 if "kv_group" in df.columns else 2, "kind",
              [kinds[int(layer)][int(h)] for layer, h in zip(df["layer"], df["head"])])
    return df, {**prov, "hybrid": True}


# ---- the config of a call --------------------------------------------------------------------------
_DEFAULTS: dict[str, Any] = {}


def _is_default(name: str, value: Any) -> bool:
    if not _DEFAULTS:
        _DEFAULTS.update({k: p.default for k, p in inspect.signature(rank).parameters.items()})
    d = _DEFAULTS.get(name, inspect.Parameter.empty)
    return value is d or (type(value) is type(d) and value == d)


def _config(config: RankConfig | None, readout: Readout | None, given: dict[str, Any]) -> RankConfig:
    """The RankConfig of a :func:`rank` call: ``config``, or one built from the keywords given.

    Raises:
        HeadscopeInputError: ``config`` together with other settings, or a ``readout`` that contradicts
            ``lam`` / ``direction`` / ``min_gap``.
    """
    from .errors import HeadscopeInputError, InputTypeError

    if config is not None:
        if not isinstance(config, RankConfig):
            raise InputTypeError(f"config must be a headscope.RankConfig, not {type(config).__name__}")
        extra = sorted(given) + (["readout"] if readout is not None else [])
        if extra:
            raise HeadscopeInputError(f"rank(config=...) with {extra} as well: put them into the config "
                                      "(config.replace(...)) or drop config")
        return config
    ro = Readout.resolve(readout, *(given.pop(k, None) for k in ("lam", "direction", "min_gap")))
    return RankConfig.from_kwargs(readout=ro, **given)


def check_loaded_model(model: Any, cfg: RankConfig) -> None:
    """A :class:`LoadedModel` is used as it is: a ``device`` or ``dtype`` that contradicts it raises.

    Raises:
        HeadscopeInputError: naming the model's device / dtype and the fix.
    """
    from .errors import HeadscopeInputError
    from .runtime import same_device

    if not isinstance(model, LoadedModel):
        return
    if cfg.device is not None and cfg.device_map is None and not same_device(cfg.device, model.device):
        raise HeadscopeInputError(
            f"device={cfg.device!r} but the given model is loaded on {model.device}; drop device= (the model is "
            f"used where it is), or load it there: headscope.load_model(spec, device={cfg.device!r})")
    if cfg.torch_dtype is not None and cfg.torch_dtype != model.dtype:
        raise HeadscopeInputError(
            f"dtype={cfg.torch_dtype} but the given model computes in {model.dtype}; drop dtype=, or load it in "
            f"that dtype: headscope.load_model(spec, dtype={cfg.torch_dtype})")


# ---- strategies: (model, config, pairs, out_dir, shard, progress) -> (table, ie, provenance, extras) ----
Result = tuple[Any, torch.Tensor, dict[str, Any], dict[str, Any]]


def _store(lm: LoadedModel, cfg: RankConfig, tasks: Sequence[str]) -> dict[str, Any]:
    # the device is left out: items computed on cuda:0 and cuda:1 (or resumed elsewhere) may mix
    return {"model": {k: v for k, v in lm.provenance().items() if k != "device"}, "tasks": list(tasks),
            "settings": cfg.settings()}


def _pairs(lm: LoadedModel, cfg: RankConfig, task: str, pairs: Sequence[Pair] | None) -> list[Pair]:
    return list(pairs) if pairs is not None else make_pairs(task, lm.tokenizer, **cfg.settings())


def _receiver_prov(res: Any, pairs: Sequence[Pair]) -> dict[str, Any]:
    return {"n_pairs": len(pairs), "pair_lengths": [p.length for p in pairs], "skipped_pairs": res.skipped,
            "m_clean": res.m_clean.tolist(), "m_corrupt": res.m_corrupt.tolist()}


def rank_exact(lm: LoadedModel, cfg: RankConfig, pairs: Any, out_dir: Any, shard: Any, progress: bool) -> Result:
    """Exact receiver patching of every head (SPEC.md §4)."""
    ps = _pairs(lm, cfg, cfg.tasks[0], pairs)
    res = receiver_patching(lm, ps, readout=cfg.readout, batch_size=cfg.batch_size, progress=progress, shard=shard,
                            store_dir=str(out_dir) if out_dir is not None else None,
                            store_config=_store(lm, cfg, cfg.tasks), path=cfg.path)
    prov = {**_receiver_prov(res, ps), "patching": "hook_z, all positions, exact", "path": res.path,
            "score": "ie_recv (mean over pairs)"}
    return head_table(res.ie, lm.geometry.n_kv_heads), res.ie, prov, {}


def rank_screen(lm: LoadedModel, cfg: RankConfig, pairs: Any, out_dir: Any, shard: Any, progress: bool) -> Result:
    """AtP screen, then exact verification (:func:`~headscope.patching.attribution.screen_then_verify`)."""
    from .patching.screen import screen_then_verify

    ps = _pairs(lm, cfg, cfg.tasks[0], pairs)
    s = cfg.screen
    scr = screen_then_verify(lm, ps, verify=s.verify, spot_checks=s.spot_checks, seed=cfg.seed, readout=cfg.readout,
                             batch_size=cfg.batch_size, store_dir=str(out_dir) if out_dir is not None else None,
                             store_config=_store(lm, cfg, cfg.tasks), progress=progress, screen=s)
    res = scr.exact
    df = head_table(scr.ie, lm.geometry.n_kv_heads)
    atp = scr.atp[res.used].double().mean(0).numpy()
    df["ie_atp"] = atp[df["layer"], df["head"]]
    exact_set = set(scr.verified) | set(scr.spot_checked)
    df["verified"] = [(int(a), int(b)) in exact_set for a, b in zip(df["layer"], df["head"])]
    prov = {**_receiver_prov(res, ps), "score": "ie_recv (mean over pairs)",
            "patching": "hook_z, all positions: AtP screen, exact for verified + spot-checked heads",
            "screen": {"verified": len(scr.verified), "spot_checked": len(scr.spot_checked),
                       "spot_hits": scr.spot_hits, "missed_estimate": scr.missed_estimate,
                       "missed_upper95": scr.missed_upper95, "threshold": scr.threshold}}
    return df, scr.ie, prov, {}


def rank_fused(lm: LoadedModel, cfg: RankConfig, pairs: Any, out_dir: Any, shard: Any, progress: bool) -> Result:
    """Receivers, senders, κ and fusion over several capabilities (SPEC.md §5, §6)."""
    from .analysis.kappa import retrieval_focus
    from .patching.senders import iterate_senders
    from .scores import check_weights, fused_table

    f = cfg.fusion
    weights, kappa = check_weights(f.weight_arg(), cfg.tasks), f.kappa or "focus"
    per_task: dict[str, dict[str, Any]] = {}
    prov_tasks: dict[str, Any] = {}
    rounds: dict[str, Any] = {}
    for task in cfg.tasks:
        ps = _pairs(lm, cfg, task, pairs)
        sub = str(Path(out_dir) / task) if out_dir is not None else None
        store_cfg = _store(lm, cfg, [task])
        res = receiver_patching(lm, ps, readout=cfg.readout, batch_size=cfg.batch_size, store_dir=sub,
                                store_config=store_cfg, progress=progress)
        used = [ps[i] for i in res.used]
        ie_send = None
        if f.senders:
            it = iterate_senders(lm, used, torch.nanmean(res.ie.double(), 0), top_k=f.top_k, max_rounds=f.max_rounds,
                                 mode=f.sender_mode, readout=cfg.readout, batch_size=f.sender_batch_size,
                                 store_dir=sub, store_config={**store_cfg, "used_pairs": res.used}, progress=progress)
            ie_send = it.ie_send
            rounds[task] = {"converged": it.converged, "n_rounds": len(it.rounds), "rounds": [
                {"round": r["round"], "receivers": r["receivers"], "top": r["top"],
                 "ie_send_max": float(r["ie_send"].max())} for r in it.rounds]}
        kap = retrieval_focus(lm, used) if kappa == "focus" else None
        per_task[task] = {"ie": res.ie, "ie_send": ie_send, "kappa": kap}
        prov_tasks[task] = _receiver_prov(res, ps)
    df = fused_table(per_task, lm.geometry.n_kv_heads, weights, f.normalize)
    term = "max(ie_recv, ie_send)" if f.senders else "ie_recv"
    prov = {
        "n_pairs": sum(v["n_pairs"] for v in prov_tasks.values()), "patching": "hook_z, all positions, exact",
        "score": f"fused S = sum_c w_c * norm_{f.normalize}({term} * kappa_{kappa})", "weights": weights,
        "kappa": kappa, "normalize": f.normalize, "per_task": prov_tasks,
        "senders": {"mode": f.sender_mode, "top_k": f.top_k, "max_rounds": f.max_rounds} if f.senders else None,
        # aggregate fields of the receivers-only provenance, kept for tools that read them
        "m_clean": [m for v in prov_tasks.values() for m in v["m_clean"]],
        "m_corrupt": [m for v in prov_tasks.values() for m in v["m_corrupt"]],
        "skipped_pairs": {t: v["skipped_pairs"] for t, v in prov_tasks.items()},
    }
    ie = torch.cat([d["ie"] for d in per_task.values()])
    return df, ie, prov, ({"sender_rounds": rounds} if f.senders else {})


#: the ranking strategies behind :func:`rank`, by ``mode`` ("fused" whenever fusion is active)
STRATEGIES: dict[str, Callable[..., Result]] = {"exact": rank_exact, "screen": rank_screen, "fused": rank_fused}
