"""Argument checks that run before any work (issue #19).

Every entry point (the ``headscope`` commands, :func:`headscope.rank`, :func:`headscope.selectors.select`,
:func:`headscope.hybridize`, :func:`headscope.ablate`, ...) calls these helpers first, so that a bad
argument, a missing file or an unmet precondition is reported in seconds, before a model is loaded,
data are sampled or a sweep starts. Every helper raises :class:`~headscope.errors.HeadscopeInputError`
(or one of its variants in :mod:`headscope.errors`) with a message that names the fix.

What needs the model's geometry (a budget of 300 heads, a mask of another model, a prompt longer
than the context) is judged from the model's config without loading weights: ``config.json`` of a
local directory or of a cached hub id, or the metadata of a GGUF file (:func:`model_geometry`).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import struct
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional, Sequence

from .errors import (
    HeadscopeInputError,
    InputFileNotFoundError,
    InputNotImplementedError,
    InputTypeError,
)

DIRECTIONS = ("noising", "denoising")
MODES = ("exact", "screen")
SENDER_MODES = ("qkv", "kv", "q")
FIGURE_FORMATS = ("html", "png", "svg", "pdf")


# ---------------------------------------------------------------------------------------- scalars
def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) or type(v).__name__.startswith(("int", "uint"))


def check_int(name: str, value: Any, lo: Optional[int] = None, hi: Optional[int] = None, fix: str = "") -> int:
    """``value`` as an int within [lo, hi]. Raises HeadscopeInputError naming ``name`` and ``fix``."""
    tail = f"; {fix}" if fix else ""
    if not _is_int(value):
        raise HeadscopeInputError(f"{name}={value!r} must be a whole number{tail}")
    v = int(value)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else (f"<= {hi}" if lo is None else f"in {lo}..{hi}")
        raise HeadscopeInputError(f"{name}={v} must be {rng}{tail}")
    return v


def check_real(
    name: str, value: Any, lo: Optional[float] = None, hi: Optional[float] = None,
    lo_open: bool = False, hi_open: bool = False, fix: str = "",
) -> float:
    """``value`` as a finite float in the interval (``lo_open``/``hi_open`` exclude the ends).

    Raises:
        HeadscopeInputError: not a number, NaN/inf, or outside the interval (names ``fix``).
    """
    tail = f"; {fix}" if fix else ""
    try:
        if isinstance(value, (bool, str)):
            raise TypeError
        x = float(value)
    except (TypeError, ValueError):
        raise HeadscopeInputError(f"{name}={value!r} must be a number{tail}") from None
    bad_lo = lo is not None and (x <= lo if lo_open else x < lo)
    bad_hi = hi is not None and (x >= hi if hi_open else x > hi)
    if not math.isfinite(x) or bad_lo or bad_hi:
        left = "-inf" if lo is None else f"{'(' if lo_open else '['}{lo:g}"
        right = "inf)" if hi is None else f"{hi:g}{')' if hi_open else ']'}"
        if lo is None:
            left = "(-inf"
        raise HeadscopeInputError(f"{name}={value!r} must lie in {left}, {right}{tail}")
    return x


def check_choice(name: str, value: Any, choices: Sequence[Any], fix: str = "") -> Any:
    """``value`` if it is one of ``choices``. Raises HeadscopeInputError listing them."""
    if value not in tuple(choices):
        tail = f"; {fix}" if fix else ""
        raise HeadscopeInputError(f"{name}={value!r} is not one of {', '.join(map(str, choices))}{tail}")
    return value


# ---------------------------------------------------------------------------------------- devices
def check_device(device: Any, name: str = "device") -> None:
    """A device headscope can run on: cpu, cuda[:N] on a machine with that GPU, or mps when available.

    Raises:
        HeadscopeInputError: an unknown device string, CUDA on a machine without it, a GPU index
            past the visible GPUs.
    """
    if device is None:
        return
    import torch

    try:
        d = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise HeadscopeInputError(f"{name} {device!r} is not a device; use cpu, cuda or cuda:N") from None
    if d.type == "cpu":
        return
    if d.type == "cuda":
        if not torch.cuda.is_available():
            why = "this PyTorch is built without CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
            raise HeadscopeInputError(
                f"{name} {device!r}: {why}; use {name} cpu (or leave {name} out: cuda is used when available)"
            )
        n = torch.cuda.device_count()
        if d.index is not None and d.index >= n:
            raise HeadscopeInputError(f"{name} {device!r}: only {n} GPU(s) are visible (cuda:0..cuda:{n - 1})")
        return
    if d.type == "mps":
        if not torch.backends.mps.is_available():
            raise HeadscopeInputError(f"{name} 'mps' is not available on this machine; use {name} cpu")
        return
    raise HeadscopeInputError(f"{name} {device!r}: headscope runs on cpu or cuda (or mps)")


def check_dtype(dtype: Any) -> None:
    """Raises HeadscopeInputError unless ``dtype`` is a floating-point ``torch.dtype``."""
    import torch

    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise HeadscopeInputError(f"dtype={dtype!r}: pass torch.float32 (default), torch.bfloat16 or torch.float16")


def check_device_map(device_map: Any, devices: int = 1, name: str = "device_map") -> None:
    """A known device-map name or a {module: device} dict, accelerate installed, one process.

    Raises:
        HeadscopeInputError: an unknown name, with ``devices`` > 1, or accelerate missing.
    """
    if device_map is None:
        return
    from .models import DEVICE_MAPS

    if devices > 1:
        raise HeadscopeInputError(
            "--device-map spreads one model over the GPUs; --devices shards the sweep: use one of them"
        )
    if isinstance(device_map, str):
        check_choice(name, device_map, DEVICE_MAPS, "or pass a {module name: device} dict")
    elif not isinstance(device_map, dict):
        raise HeadscopeInputError(f"{name}={device_map!r}: use one of {DEVICE_MAPS} or a {{module: device}} dict")
    if importlib.util.find_spec("accelerate") is None:
        raise HeadscopeInputError(f"{name} needs accelerate: pip install 'headscope[scale]' (or accelerate)")


# ---------------------------------------------------------------------------------------- paths
def check_out_dir(path: Any, name: str = "out") -> Path:
    """An output directory that exists or can be created (no file in its way, writable).

    Raises:
        HeadscopeInputError: ``path`` (or one of its parents) is a file, or the place is not writable.
    """
    p = Path(path).expanduser()
    if p.exists() and not p.is_dir():
        raise HeadscopeInputError(f"{name} {p} is a file, not a directory; pass a directory path (created when missing)")
    a = p
    while not a.exists() and a != a.parent:
        a = a.parent
    if a.exists() and not a.is_dir():
        raise HeadscopeInputError(f"{name} {p}: {a} is a file, so the directory cannot be created; pass another path")
    if a.exists() and not os.access(a, os.W_OK | os.X_OK):
        raise HeadscopeInputError(f"{name} {p}: {a} is not writable; pass a directory you can write to")
    return p


def check_file(path: Any, what: str, fix: str) -> Path:
    """An existing regular file. Raises InputFileNotFoundError / HeadscopeInputError naming ``fix``."""
    p = Path(path).expanduser()
    if not p.exists():
        raise InputFileNotFoundError(f"{what} {p} does not exist; {fix}")
    if not p.is_file():
        raise HeadscopeInputError(f"{what} {p} is a directory, not a file; {fix}")
    return p


# ---------------------------------------------------------------------------------------- models
def _geometry(cfg: dict[str, Any]) -> Any:
    from .models import geometry_of

    cfg = cfg if "num_attention_heads" in cfg else cfg.get("text_config") or {}
    try:
        return geometry_of(SimpleNamespace(**cfg))
    except (AttributeError, TypeError, ValueError, ZeroDivisionError):
        return None


def config_geometry(path: Any) -> Any:
    """Geometry from a transformers ``config.json`` (None when it cannot be read)."""
    try:
        return _geometry(json.loads(Path(path).read_text()))
    except (OSError, ValueError):
        return None


_GGUF_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def _gguf_value(f: Any, t: int) -> Any:
    """One GGUF metadata value; arrays are skipped (None)."""
    if t in _GGUF_SCALAR:
        fmt = _GGUF_SCALAR[t]
        return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]
    if t == 8:
        (n,) = struct.unpack("<Q", f.read(8))
        return f.read(n).decode("utf-8", "replace")
    if t == 9:
        et, n = struct.unpack("<IQ", f.read(12))
        if et in _GGUF_SCALAR:
            f.seek(n * struct.calcsize(_GGUF_SCALAR[et]), 1)
        else:
            for _ in range(n):
                _gguf_value(f, et)
        return None
    raise ValueError(f"unknown GGUF value type {t}")


def gguf_geometry(path: Any) -> Any:
    """Geometry from a GGUF file's metadata, read without its tensors (None when unreadable)."""
    from .models import Geometry

    try:
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                return None
            (version,) = struct.unpack("<I", f.read(4))
            if version < 2:
                return None
            _, n_kv = struct.unpack("<QQ", f.read(16))
            meta: dict[str, Any] = {}
            for _ in range(n_kv):
                (n,) = struct.unpack("<Q", f.read(8))
                key = f.read(n).decode("utf-8", "replace")
                (t,) = struct.unpack("<I", f.read(4))
                meta[key] = _gguf_value(f, t)
        arch = meta["general.architecture"]
        g = {k: meta.get(f"{arch}.{k}") for k in ("block_count", "attention.head_count", "attention.head_count_kv",
                                                  "embedding_length", "context_length", "attention.key_length")}
        n_heads = int(g["attention.head_count"])
        return Geometry(
            n_layers=int(g["block_count"]), n_heads=n_heads, n_kv_heads=int(g["attention.head_count_kv"] or n_heads),
            d_head=int(g["attention.key_length"] or int(g["embedding_length"]) // n_heads),
            d_model=int(g["embedding_length"]), n_ctx=int(g["context_length"] or 0),
        )
    except (OSError, ValueError, KeyError, TypeError, struct.error, ZeroDivisionError):
        return None


def _cached_hub_config(repo_id: str) -> Optional[str]:
    try:
        from huggingface_hub import try_to_load_from_cache

        hit = try_to_load_from_cache(repo_id, "config.json")
    except Exception:  # an invalid repo id: not in the cache either
        return None
    return hit if isinstance(hit, str) else None


def check_model(spec: Any, name: str = "model") -> Any:
    """Resolve a model spec without loading it -> its Geometry (None where the config is unreadable).

    Raises:
        ModelSpecError (a HeadscopeInputError): unknown spec, missing GGUF / directory / config.json,
            a hub id that is not in the local Hugging Face cache.
        InputTypeError: ``spec`` is neither a spec string, a path nor a LoadedModel.
    """
    from .models import LoadedModel, ModelSpecError, _resolve

    if isinstance(spec, LoadedModel):
        return spec.geometry
    if not isinstance(spec, (str, os.PathLike)):
        raise InputTypeError(f"{name} must be a model spec (name, directory, .gguf path, hub id) or a LoadedModel, "
                             f"not {type(spec).__name__}")
    path, kw, _ = _resolve(spec)
    if "gguf_file" in kw:
        return gguf_geometry(Path(path) / kw["gguf_file"])
    if kw.get("local_files_only"):
        cfg = _cached_hub_config(path)
        if cfg is None:
            raise ModelSpecError(
                f"{str(spec)!r} is not in the local Hugging Face cache and headscope never downloads: download it "
                "yourself (huggingface-cli download ...) or pass a local model directory / .gguf path"
            )
        return config_geometry(cfg)
    return config_geometry(Path(path) / "config.json")


# ---------------------------------------------------------------------------------------- budgets
def check_budget(budget: Any, geometry: Any = None, min_per_layer: int = 1, name: str = "budget") -> Optional[int]:
    """The syntax of a budget, and with ``geometry`` its head count and ``min_per_layer`` -> K or None.

    Raises:
        HeadscopeInputError: a malformed budget, a count outside the model, a ratio leaving no FA
            head, a fraction outside (0, 1], or a budget too small for ``min_per_layer`` per layer.
    """
    from .masks import parse_budget

    mpl_name = "--min-per-layer" if name.startswith("--") else "min_per_layer"
    check_int(mpl_name, min_per_layer, lo=0)
    if geometry is None:
        parse_budget(budget, 10**9)  # syntax only: 'lots', '7:0', a fraction above 1
        return None
    k = parse_budget(budget, geometry.n_total)
    if min_per_layer > geometry.n_heads:
        raise HeadscopeInputError(
            f"{mpl_name}={min_per_layer} is more than the {geometry.n_heads} heads of a layer; lower {mpl_name}"
        )
    if min_per_layer * geometry.n_layers > k:
        raise HeadscopeInputError(
            f"budget of {k} FA heads cannot give {min_per_layer} head(s) to each of {geometry.n_layers} layers; "
            f"raise {name} or lower {mpl_name}"
        )
    return k


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

    from .tasks import TASKS

    params = [p for p in inspect.signature(TASKS[task]).parameters if p != "tokenizer"]
    bad = sorted(k for k in settings if k not in params)
    if bad:
        raise HeadscopeInputError(f"{name} {bad} are not settings of task {task!r}; its settings are {params}")
    if settings.get("corpus"):
        check_file(settings["corpus"], "filler corpus", "pass a UTF-8 text file or None")


def check_rank_args(
    *, tasks: Any = ("niah_single",), n_pairs: Any = 6, seq_len: Any = 512, seed: Any = 0, depth: Any = 0.5,
    lam: Any = 0.9, direction: Any = "noising", min_gap: Any = 0.1, pairs: Any = None, out_dir: Any = None,
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
    from .scores import KAPPA, NORMALIZE, check_weights
    from .tasks import TASKS
    from .tasks.base import Pair

    check_int(f("n_pairs"), n_pairs, fix="need at least one calibration pair per task")
    if n_pairs < 1:
        raise HeadscopeInputError(f"{f('n_pairs')}={n_pairs}: need at least one calibration pair per task")
    tasks = (tasks,) if isinstance(tasks, str) else tuple(tasks)
    if not tasks:
        raise HeadscopeInputError(f"no task given; pass {f('tasks')} with one of {', '.join(sorted(TASKS))}")
    unknown = [t for t in tasks if t not in TASKS]
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
        if verify != "auto":
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
    if fusion:
        check_weights(weights, tasks)
        check_choice(f("kappa"), kappa or "focus", KAPPA, "focus = retrieval focus, one = κ ≡ 1")
        check_choice(f("normalize"), normalize, NORMALIZE)
        if pairs is not None and len(tasks) != 1:
            raise HeadscopeInputError(
                "ready-made pairs label a single task; pass pairs with one task, or let rank generate them"
            )
    if senders:
        check_choice(f("sender_mode"), sender_mode, SENDER_MODES)
        check_int(f("top_k"), top_k, lo=1)
        check_int(f("max_rounds"), max_rounds, lo=1)
        check_int(f("sender_batch_size"), sender_batch_size, lo=1)
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
        diff = [k for k, v in want.items() if k in old and old[k] != v]
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
    from .scores import Ranking

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

    from .selectors import SELECTORS

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
    from .masks import HeadMask

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
            or invalid hybrid option, a sliding-window model.
    """
    from .hybrid.config import HybridOptions
    from .hybrid.convert import _FAMILIES, HybridLlamaForCausalLM, HybridQwen3ForCausalLM

    if not any(type(model) is k for k in _FAMILIES):
        if isinstance(model, (HybridLlamaForCausalLM, HybridQwen3ForCausalLM)):
            raise InputTypeError("this model is already a head-wise hybrid; hybridize its teacher instead")
        raise InputTypeError(
            f"hybridize supports {[c.__name__ for c in _FAMILIES]}, got {type(model).__name__}; "
            "load the model with AutoModelForCausalLM"
        )
    m = as_mask(mask)
    cfg = model.config
    m.check_geometry(cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads)
    mpl = int(m.meta.get("min_per_layer", 0) or 0) if min_per_layer is None else min_per_layer
    check_int("min_per_layer", mpl, lo=0)
    check_mask_layers(m, mpl)
    try:
        HybridOptions.from_dict(options)
    except (TypeError, ValueError) as e:
        raise HeadscopeInputError(str(e)) from e
    if getattr(cfg, "use_sliding_window", False):
        raise HeadscopeInputError("sliding-window attention layers are not supported; load the model without sliding window")
    return m
