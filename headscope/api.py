"""The one-call entry point: :func:`rank`."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Sequence

import torch

from . import __version__
from .models import DEFAULT_MODEL, LoadedModel, load_model
from .patching.receivers import DEFAULT_MIN_GAP, Direction, receiver_patching
from .readout import DEFAULT_LAMBDA
from .scores import Ranking, head_table
from .tasks import make_pairs
from .tasks.base import Pair


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
    dtype: torch.dtype = torch.float32,
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
) -> Ranking:
    """Rank every attention head by its causal importance for the given capabilities.

    Receiver activation patching of ``hook_z`` (SPEC.md §4, eq. 10) with the λ-decayed logit
    difference over the answer span (eq. 9), averaged over ``n_pairs`` calibration pairs.

    Args:
        model: ``"smollm2-135m"`` (default), a local HF directory, a ``.gguf`` path, a cached hub
            id, or a :class:`~headscope.models.LoadedModel`.
        tasks: capability names from :data:`headscope.tasks.TASKS`.
        n_pairs: calibration pairs per capability (>= 1).
        seq_len: prompt length in tokens; depth: needle depth (fraction, or a list cycled).
        seed: seeds the task generators.
        lam: λ of the readout; direction: "noising" (default) or "denoising".
        min_gap: pairs with |m(x) − m(x')| below this (logits) are skipped and reported.
        pairs: ready-made pairs (overrides task generation; ``tasks`` then only labels them).
        out_dir: if given, per-pair results are written there as they finish (a rerun resumes)
            and the Ranking is saved there at the end.
        mode: ``"exact"`` (default: exact patching of every head) or ``"screen"`` (attribution
            patching of every head, then exact patching: with ``verify="auto"`` (default) layer /
            KV-group / head probes and exact verification until no unverified head's optimistic score
            reaches the top 10 (a heuristic stopping rule, not a proof), see
            :func:`headscope.patching.attribution.screen_auto`; with a count or fraction, the AtP top
            ``verify`` heads plus ``spot_checks`` random others; columns ``ie_atp`` and ``verified``
            are added; receivers-only path).
        shard: ``(rank, world_size)`` of a sharded sweep (see :mod:`headscope.distributed`;
            needs ``out_dir``); every rank returns the merged Ranking, rank 0 saves it.
        senders: add sender path patching (SPEC.md §5), iterated from the top ``top_k`` receivers
            for at most ``max_rounds`` rounds, patching the receivers' ``sender_mode`` inputs
            ("qkv" default, "kv", "q"); ``sender_batch_size`` senders per forward.
        weights: capability weights w_c (sequence in task order or dict; default uniform; must
            sum to 1). kappa: "focus" (retrieval focus, SPEC.md §6) or "one" (κ ≡ 1).
        normalize: ŝ per capability, "max" (default) or "minmax".
        path: patching path of exact mode: ``"auto"`` (the fast engine where an architecture adapter
            exists and passes its self-check, else the generic TransformerLens-bridge path),
            ``"fast"`` or ``"generic"``; the provenance records which ran.
        device_map: spread the model's layers over devices ("auto", "balanced", or a {module name:
            device} dict; needs accelerate) for a model that does not fit one GPU; the patching
            engine runs each layer on its device (exact receiver sweeps in one process).

    Fusion (SPEC.md §6, eq. 11–12) is used when ``senders`` is set, several tasks are given, or
    ``weights``/``kappa`` is passed: then ``kappa`` defaults to "focus" and the table gains
    ``ie_send``, ``kappa``, one ``s_<capability>`` per task and the fused ``score``. A single task
    without these options keeps the receivers-only score (``score`` = mean receiver IE).

    Returns:
        Ranking (``.scores`` DataFrame, ``.mask(budget)``, ``.heatmap()``, ``.save(dir)``).

    Raises:
        HeadscopeInputError (a ValueError), before the model loads: any bad argument (n_pairs < 1,
        unknown task, depth outside [0, 1], λ outside (0, 1], unknown direction / mode / kappa,
        weights not summing to 1, unknown task settings, CUDA on a machine without it, an output
        path that is a file, a store of another configuration in ``out_dir``; see
        :func:`headscope.checks.check_rank_args`); ModelSpecError (one of them): unknown model spec,
        missing GGUF, uncached hub id. InputNotImplementedError: an unsupported combination of
        options. After the model loads: HeadscopeInputError for a prompt too short for the task's
        text or too long for the context; GapError: no pair separates a⁺ from a⁻.
    """
    from .checks import check_model, check_rank_args, check_rank_store
    from .errors import HeadscopeInputError

    # every argument before the model loads: a typo costs seconds, not a model load and a sweep
    tasks = check_rank_args(
        tasks=tasks, n_pairs=n_pairs, seq_len=seq_len, seed=seed, depth=depth, lam=lam, direction=direction,
        min_gap=min_gap, pairs=pairs, out_dir=out_dir, device=device, dtype=dtype, batch_size=batch_size,
        task_settings=task_settings, shard=shard, mode=mode, verify=verify, spot_checks=spot_checks, senders=senders,
        weights=weights, kappa=kappa, normalize=normalize, sender_mode=sender_mode, top_k=top_k,
        max_rounds=max_rounds, sender_batch_size=sender_batch_size, device_map=device_map, geometry=check_model(model),
    )
    fusion = senders or len(tasks) > 1 or weights is not None or kappa is not None
    if pairs is None:
        check_rank_store(out_dir, tasks, fusion, model,
                         {"n_pairs": n_pairs, "seq_len": seq_len, "seed": seed, "depth": depth, **(task_settings or {})},
                         lam, direction)
    if fusion:
        from .scores import check_weights

        w = check_weights(weights, tasks)
        kappa = kappa or "focus"
        return _rank_fused(
            model, tasks, w, kappa, normalize, senders, sender_mode, top_k, max_rounds, sender_batch_size,
            n_pairs=n_pairs, seq_len=seq_len, seed=seed, depth=depth, lam=lam, direction=direction,
            min_gap=min_gap, pairs=pairs, out_dir=out_dir, device=device, dtype=dtype, batch_size=batch_size,
            progress=progress, task_settings=task_settings,
        )
    t0 = time.time()
    lm = load_model(model, device=device, dtype=dtype, device_map=device_map)
    settings = {"n_pairs": n_pairs, "seq_len": seq_len, "seed": seed, "depth": depth, **(task_settings or {})}
    if pairs is None:
        pairs = make_pairs(tasks[0], lm.tokenizer, **settings)
    prov: dict[str, Any] = {
        "headscope_version": __version__,
        **lm.provenance(),
        "tasks": list(tasks),
        "task_settings": settings,
        "n_pairs": len(pairs),
        "seed": seed,
        "direction": direction,
        "lambda": lam,
        "min_gap": min_gap,
        "patching": "hook_z, all positions, exact",
        "score": "ie_recv (mean over pairs)",
        "pair_lengths": [p.length for p in pairs],
    }
    common = dict(
        lam=lam,
        direction=direction,
        min_gap=min_gap,
        batch_size=batch_size,
        store_dir=str(out_dir) if out_dir is not None else None,
        # the device is left out: items computed on cuda:0 and cuda:1 (or resumed elsewhere) may mix
        store_config={"model": {k: v for k, v in lm.provenance().items() if k != "device"},
                      "tasks": list(tasks), "settings": settings},
        progress=progress,
    )
    if mode == "screen":
        from .patching.attribution import screen_then_verify

        scr = screen_then_verify(lm, pairs, verify=verify, spot_checks=spot_checks, seed=seed, **common)
        res = scr.exact
        res.ie = scr.ie
        df = head_table(res.ie, lm.geometry.n_kv_heads)
        atp = scr.atp[res.used].double().mean(0).numpy()
        df["ie_atp"] = atp[df["layer"], df["head"]]
        exact_set = set(scr.verified) | set(scr.spot_checked)
        df["verified"] = [(int(a), int(b)) in exact_set for a, b in zip(df["layer"], df["head"])]
        prov["patching"] = "hook_z, all positions: AtP screen, exact for verified + spot-checked heads"
        prov["screen"] = {
            "verified": len(scr.verified),
            "spot_checked": len(scr.spot_checked),
            "spot_hits": scr.spot_hits,
            "missed_estimate": scr.missed_estimate,
            "missed_upper95": scr.missed_upper95,
            "threshold": scr.threshold,
        }
    else:
        if path not in ("auto", "fast", "generic"):
            raise HeadscopeInputError(f"path={path!r}: use 'auto', 'fast' or 'generic'")
        res = receiver_patching(lm, pairs, shard=shard, path=path, **common)  # type: ignore[arg-type]
        df = head_table(res.ie, lm.geometry.n_kv_heads)
        prov["path"] = res.path
    prov["skipped_pairs"] = res.skipped
    prov["m_clean"] = res.m_clean.tolist()
    prov["m_corrupt"] = res.m_corrupt.tolist()
    prov["seconds"] = round(time.time() - t0, 1)
    ranking = Ranking(df, lm.geometry.to_dict(), prov, res.ie)
    if out_dir is not None and (shard is None or shard[0] == 0):
        ranking.save(out_dir)
    return ranking


def _rank_fused(
    model: str | LoadedModel,
    tasks: tuple[str, ...],
    weights: dict[str, float],
    kappa: str,
    normalize: str,
    senders: bool,
    sender_mode: str,
    top_k: int,
    max_rounds: int,
    sender_batch_size: int,
    *,
    n_pairs: int,
    seq_len: int,
    seed: int,
    depth: float | Sequence[float],
    lam: float,
    direction: Direction,
    min_gap: float,
    pairs: Sequence[Pair] | None,
    out_dir: str | Path | None,
    device: str | None,
    dtype: torch.dtype,
    batch_size: int | None,
    progress: bool,
    task_settings: dict[str, Any] | None,
) -> Ranking:
    """Receivers, senders, κ and fusion over several capabilities (SPEC.md §5, §6)."""
    from .patching.senders import iterate_senders
    from .scores import fused_table, retrieval_focus

    t0 = time.time()
    lm = load_model(model, device=device, dtype=dtype)
    settings = {"n_pairs": n_pairs, "seq_len": seq_len, "seed": seed, "depth": depth, **(task_settings or {})}
    per_task: dict[str, dict[str, Any]] = {}
    prov_tasks: dict[str, Any] = {}
    rounds_out: dict[str, Any] = {}
    all_ie = []
    for task in tasks:
        tpairs = list(pairs) if pairs is not None else make_pairs(task, lm.tokenizer, **settings)
        sub = str(Path(out_dir) / task) if out_dir is not None else None
        store_cfg = {"model": {k: v for k, v in lm.provenance().items() if k != "device"},
                     "tasks": [task], "settings": settings}
        res = receiver_patching(
            lm, tpairs, lam=lam, direction=direction, min_gap=min_gap, batch_size=batch_size,
            store_dir=sub, store_config=store_cfg, progress=progress,
        )
        used = [tpairs[i] for i in res.used]
        recv_mean = torch.nanmean(res.ie.double(), 0)
        ie_send = None
        if senders:
            it = iterate_senders(
                lm, used, recv_mean, top_k=top_k, max_rounds=max_rounds, mode=sender_mode, lam=lam,
                min_gap=min_gap, batch_size=sender_batch_size, store_dir=sub,
                store_config={**store_cfg, "used_pairs": res.used}, progress=progress,
            )
            ie_send = it.ie_send
            rounds_out[task] = {
                "converged": it.converged,
                "n_rounds": len(it.rounds),
                "rounds": [
                    {"round": r["round"], "receivers": r["receivers"], "top": r["top"],
                     "ie_send_max": float(r["ie_send"].max())}
                    for r in it.rounds
                ],
            }
        kap = retrieval_focus(lm, used) if kappa == "focus" else None
        per_task[task] = {"ie": res.ie, "ie_send": ie_send, "kappa": kap}
        all_ie.append(res.ie)
        prov_tasks[task] = {
            "n_pairs": len(tpairs),
            "skipped_pairs": res.skipped,
            "m_clean": res.m_clean.tolist(),
            "m_corrupt": res.m_corrupt.tolist(),
            "pair_lengths": [p.length for p in tpairs],
        }
    df = fused_table(per_task, lm.geometry.n_kv_heads, weights, normalize)
    prov: dict[str, Any] = {
        "headscope_version": __version__,
        **lm.provenance(),
        "tasks": list(tasks),
        "task_settings": settings,
        "n_pairs": sum(v["n_pairs"] for v in prov_tasks.values()),
        "seed": seed,
        "direction": direction,
        "lambda": lam,
        "min_gap": min_gap,
        "patching": "hook_z, all positions, exact",
        "score": (
            f"fused S = sum_c w_c * norm_{normalize}(max(ie_recv, ie_send) * kappa_{kappa})"
            if senders else f"fused S = sum_c w_c * norm_{normalize}(ie_recv * kappa_{kappa})"
        ),
        "weights": weights,
        "kappa": kappa,
        "normalize": normalize,
        "senders": {"mode": sender_mode, "top_k": top_k, "max_rounds": max_rounds} if senders else None,
        "per_task": prov_tasks,
        # aggregate fields of the receivers-only provenance, kept for tools that read them
        "m_clean": [m for v in prov_tasks.values() for m in v["m_clean"]],
        "m_corrupt": [m for v in prov_tasks.values() for m in v["m_corrupt"]],
        "skipped_pairs": {t: v["skipped_pairs"] for t, v in prov_tasks.items()},
    }
    prov["seconds"] = round(time.time() - t0, 1)
    extras = {"sender_rounds": rounds_out} if senders else {}
    ranking = Ranking(df, lm.geometry.to_dict(), prov, torch.cat(all_ie), extras)
    if out_dir is not None:
        ranking.save(out_dir)
    return ranking
