"""Checks of the arguments of headscope's entry points (issue #19): :func:`headscope.rank` and
``headscope rank`` (with a rerun's store), ``headscope anatomy``, :func:`headscope.selectors.select`,
:func:`headscope.hybridize`. Each raises :class:`~headscope.errors.HeadscopeInputError` (or a variant)
naming the fix, before a model loads."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Any, Optional, Sequence

from ..errors import HeadscopeInputError, InputNotImplementedError, InputTypeError
from ..runtime import config_diff
from ..readout import DEFAULT_LAMBDA, DEFAULT_MIN_GAP
from .core import (
    _is_int,
    check_choice,
    check_device,
    check_device_map,
    check_dtype,
    check_file,
    check_int,
    check_model,
    check_out_dir,
    check_real,
)

DIRECTIONS = ("noising", "denoising")
MODES = ("exact", "screen")
SENDER_MODES = ("qkv", "kv", "q")
FIGURE_FORMATS = ("html", "png", "svg", "pdf")


# ---------------------------------------------------------------------------------------- rank
_CLI = {"lam": "--lambda", "n_pairs": "--pairs", "tasks": "--task", "weights": "--weight", "out_dir": "--out"}


def _namer(cli: bool) -> Any:
    return (lambda n: _CLI.get(n, "--" + n.replace("_", "-"))) if cli else (lambda n: n)


def parse_verify(text: str) -> Any:
    """``--verify``: 'auto', a head count or a fraction. Raises HeadscopeInputError naming the forms."""
    if text == "auto":
        return "auto"
    try:
        return int(text) if text.isdigit() else float(text)
    except ValueError:
        raise HeadscopeInputError(f"--verify {text!r}: use auto, a head count or a fraction") from None


def check_task_settings(task: str, settings: dict[str, Any], name: str = "task_settings") -> None:
    """Every key is a parameter of the task generator; a ``corpus`` file exists.

    Raises:
        HeadscopeInputError: an unknown setting (the message lists the accepted ones); a missing corpus.
    """
    import inspect

    from ..tasks import TASKS

    params = [p for p in inspect.signature(TASKS[task]).parameters if p != "tokenizer"]
    bad = sorted(k for k in settings if k not in params)
    if bad:
        raise HeadscopeInputError(f"{name} {bad} are not settings of task {task!r}; its settings are {params}")
    if settings.get("corpus"):
        check_file(settings["corpus"], "filler corpus", "pass a UTF-8 text file or None")


def check_rank_args(
    *, tasks: Any = ("niah_single",), n_pairs: Any = 6, seq_len: Any = 512, seed: Any = 0, depth: Any = 0.5,
    lam: Any = DEFAULT_LAMBDA, direction: Any = "noising", min_gap: Any = DEFAULT_MIN_GAP, pairs: Any = None, out_dir: Any = None,
    device: Any = None, dtype: Any = None, batch_size: Any = None, task_settings: Any = None, shard: Any = None,
    mode: Any = "exact", verify: Any = "auto", spot_checks: Any = 0.05, senders: bool = False, weights: Any = None,
    kappa: Any = None, normalize: Any = "max", sender_mode: Any = "qkv", top_k: Any = 10, max_rounds: Any = 3,
    sender_batch_size: Any = 16, device_map: Any = None, geometry: Any = None, cli: bool = False,
) -> tuple[str, ...]:
    """Every argument of :func:`headscope.rank` (and ``headscope rank``), before the model loads.

    ``geometry`` (from :func:`check_model`) adds the checks that need the model's shape (the prompt
    against its context). ``cli`` names the command-line flags in the messages. Returns the tasks.

    Raises:
        HeadscopeInputError: any bad value, with the fix in the message.
        InputNotImplementedError: a combination of options that is not supported.
    """
    f = _namer(cli)
    from ..scores import KAPPA, NORMALIZE, check_weights
    from ..tasks import TASKS
    from ..tasks.base import Pair

    check_int(f("n_pairs"), n_pairs, fix="need at least one calibration pair per task")
    if n_pairs < 1:
        raise HeadscopeInputError(f"{f('n_pairs')}={n_pairs}: need at least one calibration pair per task")
    tasks = (tasks,) if isinstance(tasks, str) else tuple(tasks)
    if not tasks:
        raise HeadscopeInputError(f"no task given; pass {f('tasks')} with one of {', '.join(sorted(TASKS))}")
    unknown = [t for t in tasks if not isinstance(t, str) or t not in TASKS]
    if unknown:
        raise HeadscopeInputError(f"unknown task(s) {unknown}; available: {', '.join(sorted(TASKS))}")
    if len(set(tasks)) != len(tasks):
        raise HeadscopeInputError(f"tasks {list(tasks)} name a capability twice; give each once")
    check_int(f("seq_len"), seq_len, lo=16, fix="the prompt needs room for the task's text")
    if geometry is not None and geometry.n_ctx and seq_len >= geometry.n_ctx:
        raise HeadscopeInputError(
            f"{f('seq_len')}={seq_len} leaves no room for the answer: the model's context is {geometry.n_ctx} "
            "tokens; use a shorter seq_len"
        )
    depths = [depth] if isinstance(depth, (int, float)) and not isinstance(depth, bool) else list(depth or [])
    if not depths:
        raise HeadscopeInputError(f"{f('depth')}: give at least one needle depth in [0, 1]")
    for d in depths:
        check_real(f("depth"), d, 0.0, 1.0, fix="a needle depth is a fraction of the prompt, 0 = start, 1 = end")
    check_int(f("seed"), seed)
    check_real(f("lam"), lam, 0.0, 1.0, lo_open=True, fix="λ weighs answer token j by λ^j; 0.9 is the default")
    check_choice(f("direction"), direction, DIRECTIONS)
    check_real(f("min_gap"), min_gap, 0.0, fix="it is a logit difference; 0 keeps every pair")
    check_choice(f("mode"), mode, MODES, "exact patches every head, screen uses the AtP screen")
    if batch_size is not None:
        check_int(f("batch_size"), batch_size, lo=1)
    fusion = bool(senders) or len(tasks) > 1 or weights is not None or kappa is not None
    if mode == "screen":
        if fusion:
            raise InputNotImplementedError("mode='screen' covers the receivers-only ranking; use mode='exact' with fusion")
        if shard is not None:
            raise InputNotImplementedError("mode='screen' runs in one process; shard exact sweeps instead")
    if verify != "auto":  # checked in every mode: a typo is not silently ignored
        fix = "use auto, a head count or a fraction in (0, 1]"
        if _is_int(verify):
            check_int(f("verify"), verify, lo=1, hi=geometry.n_total if geometry else None, fix=fix)
        elif isinstance(verify, float):
            check_real(f("verify"), verify, 0.0, 1.0, lo_open=True, fix=fix)
        else:
            raise HeadscopeInputError(f"{f('verify')} {verify!r}: {fix}")
    if _is_int(spot_checks):
        check_int(f("spot_checks"), spot_checks, lo=0)
    else:
        check_real(f("spot_checks"), spot_checks, 0.0, 1.0, fix="a count of heads or a fraction of the rest")
    if device_map is not None and (fusion or mode != "exact" or shard is not None):
        raise InputNotImplementedError(
            "device_map covers the exact receiver sweep of one task in one process; drop --device-map, or "
            "--mode screen / --senders / several tasks / --devices"
        )
    if fusion and shard is not None:
        raise InputNotImplementedError(
            "sharded sweeps (--devices / torchrun) cover the receiver sweep of one task; run fused rankings in one process"
        )
    if shard is not None:
        if out_dir is None:
            raise HeadscopeInputError("a sharded sweep needs out_dir: the ranks meet in its store")
        r, w = shard
        check_int("shard world size", w, lo=1)
        check_int("shard rank", r, lo=0, hi=w - 1)
    # every option is checked, also those this run does not use (a typo is not silently ignored)
    if kappa is not None:
        check_choice(f("kappa"), kappa, KAPPA, "focus = retrieval focus, one = κ ≡ 1")
    check_choice(f("normalize"), normalize, NORMALIZE)
    check_choice(f("sender_mode"), sender_mode, SENDER_MODES)
    check_int(f("top_k"), top_k, lo=1)
    check_int(f("max_rounds"), max_rounds, lo=1)
    check_int(f("sender_batch_size"), sender_batch_size, lo=1)
    if fusion:
        check_weights(weights, tasks)
        if pairs is not None and len(tasks) != 1:
            raise HeadscopeInputError(
                "ready-made pairs label a single task; pass pairs with one task, or let rank generate them"
            )
    if pairs is not None:
        pairs = list(pairs)
        if not pairs:
            raise HeadscopeInputError("pairs=[] holds no calibration pair; pass at least one, or pairs=None")
        bad = [i for i, p in enumerate(pairs) if not isinstance(p, Pair)]
        if bad:
            raise InputTypeError(f"pairs {bad[:5]} are not headscope Pair objects; build them with headscope.tasks.Pair")
    if task_settings:
        if not isinstance(task_settings, dict):
            raise InputTypeError(f"task_settings must be a dict, not {type(task_settings).__name__}")
        for t in tasks:
            check_task_settings(t, task_settings)
    check_device(device, f("device"))
    if dtype is not None:
        check_dtype(dtype)
    check_device_map(device_map, name=f("device_map"))
    if out_dir is not None:
        check_out_dir(out_dir, f("out_dir"))
    return tasks


def check_rank_store(out_dir: Any, tasks: Sequence[str], fused: bool, spec: Any, settings: dict[str, Any],
                     lam: float, direction: str) -> None:
    """A rerun into ``out_dir`` resumes only a store of the same configuration: compare what is known
    before the model loads (tasks, task settings, λ, direction, model spec) with the stored config.

    Raises:
        HeadscopeInputError: the stored configuration differs (the message lists the keys).
    """
    if out_dir is None or not isinstance(spec, (str, os.PathLike)):
        return
    want = json.loads(json.dumps({"settings": settings, "lam": lam, "direction": direction}, default=str))
    for t in tasks:
        sub = Path(out_dir) / (t if fused else "") / "receivers" / "config.json"
        try:
            old = json.loads(sub.read_text())
        except (OSError, ValueError):
            continue
        diff = config_diff(old, want, keys=[k for k in want if k in old])
        if old.get("tasks") not in (None, [t] if fused else list(tasks)):
            diff.append("tasks")
        if isinstance(old.get("model"), dict) and old["model"].get("model_spec") not in (None, str(spec)):
            diff.append("model")
        if diff:
            raise HeadscopeInputError(
                f"{sub.parent} holds results of another configuration (differs in: {', '.join(sorted(diff))}); "
                "use a new output directory or delete this one"
            )


# ---------------------------------------------------------------------------------------- anatomy
def check_figure_formats(formats: Sequence[str]) -> None:
    """Known formats; a static one (png, svg, pdf) needs kaleido and a Chrome/Chromium.

    Raises:
        HeadscopeInputError: an unknown format, or no way to export static images.
    """
    formats = list(formats)
    if not formats:
        raise HeadscopeInputError("--format: give at least one of html, png")
    for fmt in formats:
        check_choice("--format", fmt, FIGURE_FORMATS)
    if any(fmt != "html" for fmt in formats):
        fix = "or write html only (--format html)"
        if importlib.util.find_spec("kaleido") is None:
            raise HeadscopeInputError(f"static figures (png) need kaleido: pip install kaleido, {fix}")
        try:
            from choreographer.browsers.chromium import Chromium

            found = Chromium.find_browser(skip_local=False)
        except Exception:  # another kaleido: let the export itself decide
            return
        if not found:
            raise HeadscopeInputError(
                f"static figures (png) need Chrome or Chromium: `apt-get install chromium` or `plotly_get_chrome`, {fix}"
            )


def check_anatomy_args(run_dir: Any, out: Any, threshold: Any, boot: Any, formats: Sequence[str], use_model: bool,
                       device: Any, seed: Any = 0) -> tuple[Any, Any]:
    """``headscope anatomy``: the run directory, the output place, the numbers and, with the model, that
    the run's model and pairs can be re-created. Returns (Ranking, model spec or None).

    Raises:
        HeadscopeInputError (InputFileNotFoundError): a missing or broken run directory, a bad value,
            a run whose model or pairs cannot be re-created (then ``--no-model`` is the fix).
    """
    from ..scores import Ranking

    r = Ranking.load(run_dir)
    check_real("--threshold", threshold, 0.0, fix="IE above it marks a head critical")
    check_int("--boot", boot, lo=1)
    check_int("--seed", seed)
    check_figure_formats(formats)
    check_out_dir(out, "--out")
    cols = [c for c in r.scores.columns if c in ("ie_recv", "score") or c.startswith("s_")]
    if not cols:
        raise HeadscopeInputError(f"{run_dir}/scores.csv has none of the columns ie_recv, score, s_<capability>; "
                                  "is it a table written by headscope rank?")
    if not use_model:
        return r, None
    p = r.provenance
    spec = p.get("model_spec") or p.get("model") or "smollm2-135m"
    try:
        g = check_model(spec, "the run's model")
    except HeadscopeInputError as e:
        raise HeadscopeInputError(f"{e} (the run's model cannot be loaded: pass --no-model to skip DLA and cosine)") from e
    if g is not None and (g.n_layers, g.n_heads) != (r.n_layers, r.n_heads):
        raise HeadscopeInputError(
            f"the run's model spec {spec!r} now names a model of {g.n_layers}x{g.n_heads} heads, the run has "
            f"{r.n_layers}x{r.n_heads}; pass --no-model"
        )
    tasks, settings = p.get("tasks"), p.get("task_settings")
    if not tasks or settings is None or len(tasks) != 1:
        raise HeadscopeInputError(
            "the run's provenance does not say how its single task's pairs were generated (several tasks or "
            "ready-made pairs); pass --no-model"
        )
    check_device(device, "--device")
    return r, spec


# ---------------------------------------------------------------------------------------- select
def check_select_args(model: Any, method: Any, settings: dict[str, Any]) -> None:
    """:func:`headscope.selectors.select`: the method, its settings and the model spec.

    Raises:
        HeadscopeInputError: unknown method, a setting the selector does not take (the message lists
            the accepted ones), a value outside a ``Literal`` choice or a bad count / depth / length.
    """
    import inspect
    import typing

    from ..selectors import SELECTORS

    if method not in SELECTORS:
        raise HeadscopeInputError(f"unknown selector {method!r}; available: {', '.join(SELECTORS)}")
    fn = SELECTORS[method]
    params = inspect.signature(fn).parameters
    if method == "causal":
        import headscope.api as api

        ok = [k for k in inspect.signature(api.rank).parameters if k != "model"]
        bad = [k for k in settings if k not in ok]
        if bad:
            raise HeadscopeInputError(f"selector 'causal' does not take {bad}; its settings are {ok}")
        keys = set(inspect.signature(check_rank_args).parameters)
        check_rank_args(**{k: v for k, v in settings.items() if k in keys})
    elif not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        bad = [k for k in settings if k not in params or k == "model"]
        if bad:
            ok = [k for k in params if k != "model"]
            raise HeadscopeInputError(f"selector {method!r} does not take {bad}; its settings are {ok}")
    try:
        hints = typing.get_type_hints(fn)
    except Exception:
        hints = {}
    for k, v in settings.items():
        if typing.get_origin(hints.get(k)) is typing.Literal:
            check_choice(k, v, typing.get_args(hints[k]))
    for k in ("n_prompts", "steps", "n_bands"):
        if k in settings:
            check_int(k, settings[k], lo=1)
    if "seq_lens" in settings:
        for L in [settings["seq_lens"]] if _is_int(settings["seq_lens"]) else list(settings["seq_lens"]):
            check_int("seq_lens", L, lo=16)
    if "depths" in settings:
        ds = settings["depths"]
        for d in [ds] if isinstance(ds, (int, float)) else list(ds):
            check_real("depths", d, 0.0, 1.0, fix="depths are fractions of the prompt")
    check_model(model)


# ---------------------------------------------------------------------------------------- masks / hybrid
def check_mask_layers(mask: Any, min_per_layer: int) -> None:
    """Every layer of ``mask`` keeps at least ``min_per_layer`` FA heads. Raises HeadscopeInputError."""
    short = [(layer, len(hs)) for layer, hs in enumerate(mask.fa_heads) if len(hs) < min_per_layer]
    if short:
        raise HeadscopeInputError(
            f"layers {[s[0] for s in short]} have fewer than min_per_layer={min_per_layer} FA heads "
            f"(counts {[s[1] for s in short]}); select the mask with HeadMask.select(..., min_per_layer="
            f"{min_per_layer}) or pass min_per_layer=0"
        )


def as_mask(mask: Any) -> Any:
    """A HeadMask from a HeadMask, its dict or a JSON path. Raises InputTypeError / HeadscopeInputError."""
    from ..masks import HeadMask

    if isinstance(mask, HeadMask):
        return mask
    if isinstance(mask, dict):
        return HeadMask.from_dict(mask)
    if isinstance(mask, (str, os.PathLike)):
        return HeadMask.from_json(mask)
    raise InputTypeError(f"mask must be a HeadMask, its dict or a JSON path, not {type(mask).__name__}")


def check_hybridize_args(model: Any, mask: Any, min_per_layer: Optional[int], options: dict[str, Any]) -> Any:
    """:func:`headscope.hybridize` before any weight is copied -> the HeadMask.

    Raises:
        InputTypeError: ``model`` is not a supported family (or already a hybrid); ``mask`` of an
            unknown type.
        HeadscopeInputError: a mask of another geometry, a layer below ``min_per_layer``, an unknown
            or invalid hybrid option.
    """
    from ..hybrid.config import HybridOptions
    from ..hybrid.convert import unsupported_reason

    why = unsupported_reason(model)
    if why is not None:
        raise InputTypeError(why)
    m = as_mask(mask)
    cfg = model.config
    H = cfg.num_attention_heads
    m.check_geometry(cfg.num_hidden_layers, H, getattr(cfg, "num_key_value_heads", None) or H)
    mpl = int(m.meta.get("min_per_layer", 0) or 0) if min_per_layer is None else min_per_layer
    check_int("min_per_layer", mpl, lo=0)
    check_mask_layers(m, mpl)
    try:
        HybridOptions.from_dict(options)
    except (TypeError, ValueError) as e:
        raise HeadscopeInputError(str(e)) from e
    return m
