"""Frozen, typed configurations of a ranking: :class:`RankConfig` with its :class:`~headscope.readout.Readout`,
:class:`ScreenConfig` and :class:`FusionConfig`.

Each validates itself once, when made (``__post_init__``, with :mod:`headscope.validate`; a bad value raises
:class:`~headscope.errors.SettingError` naming the setting and the fix), is saved whole in ``ranking.json``'s
provenance (``provenance["config"]``, :meth:`RankConfig.to_dict`), and declares per field what the
``headscope rank`` command needs (flag, type, help: the ``cli`` metadata), from which
:mod:`headscope.cli` generates the command's options (:func:`cli_fields`): one list, not two.
"""

from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from typing import Any, Iterator, Optional, Sequence, Union

from .errors import HeadscopeInputError, InputNotImplementedError, InputTypeError, SettingError
from .readout import Readout
from .validate import check_choice, check_device, check_dtype, check_file, check_int, check_out_dir, check_real, is_int

Verify = Union[int, float, str]
MODES = ("exact", "screen")
SENDER_MODES = ("qkv", "kv", "q")


def opt(default: Any, help: str, flag: Optional[str] = None, cli_type: Any = None, **kw: Any) -> Any:
    """A dataclass field with its command-line option: ``flag`` (default ``--field-name``), ``cli_type``
    (the click/typer type, default the field's), ``help``."""
    meta = {"help": help, "flag": flag, "cli_type": cli_type, **kw}
    if isinstance(default, (list, dict, set)):
        return field(default_factory=lambda: type(default)(default), metadata={"cli": meta})
    return field(default=default, metadata={"cli": meta})


@dataclass(frozen=True)
class ScreenConfig:
    """Settings of the AtP screen (``mode="screen"``; :func:`~headscope.patching.attribution.screen_then_verify`,
    :func:`~headscope.patching.screen.screen_auto`).

    Attributes:
        verify: ``"auto"`` (probe and verify until the top ``top_k`` is certified), a head count or a
            fraction of all heads verified exactly after the AtP screen.
        spot_checks: with a count/fraction ``verify``: random unverified heads patched exactly (count or
            fraction of the rest) to estimate what the screen missed.
        top_k, flag, probe_dtype, probe_margin, verify_cost, block, atp_slack, keep_bytes: the certified
            screen's knobs (see :mod:`headscope.patching.screen`).
    """

    verify: Verify = opt("auto", "screen mode: 'auto' (verify until no unverified head's optimistic score reaches "
                         "the top 10; a heuristic, see docs/engine.md), or a head count / fraction verified exactly "
                         "after the AtP screen, with --spot-checks", cli_type=str, parse="verify")
    spot_checks: Union[int, float] = opt(0.05, "screen mode with a count/fraction --verify: random unverified heads "
                                         "patched exactly to estimate what the screen missed", cli_type=float,
                                         parse="count_or_fraction")
    top_k: int = 10
    flag: float = 0.5
    probe_dtype: str = "bfloat16"
    probe_margin: float = 0.01
    verify_cost: float = 3.0
    block: int = 4
    atp_slack: float = 2.0
    keep_bytes: float = 2e9

    def __post_init__(self) -> None:
        if not isinstance(self.probe_dtype, str):  # a torch.dtype
            object.__setattr__(self, "probe_dtype", str(self.probe_dtype).replace("torch.", ""))
        check_choice("probe_dtype", self.probe_dtype, ("bfloat16", "float16", "float32", "float64"))
        if self.verify != "auto":
            fix = "use auto, a head count or a fraction in (0, 1]"
            if is_int(self.verify):
                check_int("verify", self.verify, lo=1, fix=fix)
            elif isinstance(self.verify, float):
                check_real("verify", self.verify, 0.0, 1.0, lo_open=True, fix=fix)
            else:
                raise SettingError("verify", f"{{setting}} {self.verify!r}: {fix}")
        if is_int(self.spot_checks):
            check_int("spot_checks", self.spot_checks, lo=0)
        else:
            check_real("spot_checks", self.spot_checks, 0.0, 1.0, fix="a count of heads or a fraction of the rest")
        check_int("top_k", self.top_k, lo=1)
        check_int("block", self.block, lo=1)
        check_real("flag", self.flag, 0.0)
        check_real("probe_margin", self.probe_margin, 0.0)
        check_real("verify_cost", self.verify_cost, 0.0, lo_open=True)
        check_real("keep_bytes", self.keep_bytes, 0.0)
        check_real("atp_slack", self.atp_slack)
        if not self.atp_slack >= 1.0:
            raise HeadscopeInputError(
                f"atp_slack={self.atp_slack} must be >= 1 (1 = AtP taken at face value; the default is 2)")

    @property
    def torch_probe_dtype(self) -> Any:
        import torch

        return getattr(torch, self.probe_dtype)

    def check_model(self, geometry: Any) -> None:
        """What needs the model's head count. Raises HeadscopeInputError: a ``verify`` count above it
        (``top_k`` is capped at it by ``screen_then_verify``; ``screen_auto`` refuses a larger one)."""
        n = geometry.n_layers * geometry.n_heads
        if is_int(self.verify):
            check_int("verify", self.verify, lo=1, hi=n, fix="use auto, a head count or a fraction in (0, 1]")


@dataclass(frozen=True)
class FusionConfig:
    """Senders, κ and the fusion of several capabilities (SPEC.md §5, §6; eq. 11–12).

    Fusion runs when ``senders`` is set, ``weights`` or ``kappa`` is given, or several tasks are ranked
    (:meth:`active`); ``kappa`` then defaults to ``"focus"``.
    """

    senders: bool = opt(False, "add iterated sender path patching (SPEC.md §5) and fuse", flag="--senders")
    weights: Optional[tuple[float, ...]] = opt(
        None, "capability weight, one per --task in order (default uniform; must sum to 1)", flag="--weight",
        cli_type=list[float], parse="weights")
    kappa: Optional[str] = opt(None, "'focus' (retrieval focus, default when fusing) or 'one' (κ ≡ 1)",
                               cli_type=Optional[str])
    normalize: str = opt("max", "per-capability normalization: max or minmax")
    sender_mode: str = opt("qkv", "receiver inputs patched by senders: qkv, kv or q")
    top_k: int = opt(10, "receivers of the first sender round (top heads by receiver IE)")
    max_rounds: int = opt(3, "sender rounds at most (senders become receivers)")
    sender_batch_size: int = 16

    def __post_init__(self) -> None:
        from .scores import KAPPA, NORMALIZE

        if isinstance(self.weights, dict):
            object.__setattr__(self, "weights", tuple(sorted(self.weights.items())))
        elif self.weights is not None:
            object.__setattr__(self, "weights", tuple(float(w) for w in self.weights))
        if self.kappa is not None:
            check_choice("kappa", self.kappa, KAPPA, "focus = retrieval focus, one = κ ≡ 1")
        check_choice("normalize", self.normalize, NORMALIZE)
        check_choice("sender_mode", self.sender_mode, SENDER_MODES)
        check_int("top_k", self.top_k, lo=1)
        check_int("max_rounds", self.max_rounds, lo=1)
        check_int("sender_batch_size", self.sender_batch_size, lo=1)

    def active(self, tasks: Sequence[str]) -> bool:
        return bool(self.senders) or len(tasks) > 1 or self.weights is not None or self.kappa is not None

    def weight_arg(self) -> Any:
        """``weights`` as :func:`~headscope.scores.check_weights` takes them (a dict given as dict)."""
        w = self.weights
        if w and isinstance(w[0], tuple):
            return dict(w)  # type: ignore[arg-type]
        return None if w is None else list(w)


@dataclass(frozen=True)
class RankConfig:
    """Everything that determines a ranking's numbers, validated once, when made.

    Attributes:
        tasks: capability names (:data:`headscope.tasks.TASKS`); n_pairs: pairs per capability; seq_len:
            prompt tokens; seed: seeds the task generators; depth: needle depth(s) in [0, 1];
            task_settings: extra settings of the task generators.
        readout: λ, direction, min_gap (:class:`~headscope.readout.Readout`).
        mode: ``"exact"`` (every head patched) or ``"screen"`` (``screen``'s AtP screen + exact verification).
        path: exact patching path: ``"auto"``, ``"fast"`` or ``"generic"``.
        batch_size: head patches per forward (None: sized to memory).
        device, dtype, device_map: where and how the model is loaded (a spec; a loaded model must agree).
        screen, fusion: :class:`ScreenConfig`, :class:`FusionConfig`.
    """

    tasks: tuple[str, ...] = opt(("niah_single",), "capability (repeatable)", flag="--task", cli_type=list[str],
                                 cli_default=["niah_single"])
    n_pairs: int = opt(6, "calibration pairs per task", flag="--pairs")
    seq_len: int = opt(512, "prompt length in tokens")
    seed: int = opt(0, "seeds the task generators")
    depth: Union[float, tuple[float, ...]] = opt(
        0.5, "needle depth(s), fractions in [0, 1] (repeatable, cycled over pairs)", cli_type=list[float],
        cli_default=[0.5], parse="depth")
    task_settings: Optional[dict[str, Any]] = None
    readout: Readout = field(default_factory=Readout)
    mode: str = opt("exact", "exact (every head patched) or screen (AtP screen + exact verification)")
    path: str = opt("auto", "exact patching path: auto (fast engine where an architecture adapter exists, else the "
                    "TransformerLens bridge's hooks), fast or generic")
    batch_size: Optional[int] = None
    device: Optional[str] = opt(None, "cpu / cuda (default: cuda when available)", cli_type=Optional[str])
    dtype: Optional[str] = opt(None, "float32 / bfloat16 / float16: the model's weights and compute (default "
                               "float32; the readout is float32 either way)", cli_type=Optional[str], parse="dtype")
    device_map: Optional[Any] = opt(None, "auto or balanced: spread a model that does not fit one GPU over all "
                                    "GPUs (layers)", cli_type=Optional[str])
    screen: ScreenConfig = field(default_factory=ScreenConfig)
    fusion: FusionConfig = field(default_factory=FusionConfig)

    def __post_init__(self) -> None:
        tasks = (self.tasks,) if isinstance(self.tasks, str) else tuple(self.tasks)
        object.__setattr__(self, "tasks", tasks)
        if not isinstance(self.depth, (int, float)):
            object.__setattr__(self, "depth", tuple(self.depth))
        if self.dtype is not None:
            check_dtype(self.torch_dtype)
            object.__setattr__(self, "dtype", str(self.torch_dtype).replace("torch.", ""))
        self._validate()

    def _validate(self) -> None:
        """Every setting of this config, alone and together (its parts validated themselves when made); what needs
        the call (pairs, output folder, shards) or the model is :func:`check_rank_call`'s. Runs once, when the
        config is made.

        Raises:
            SettingError (a HeadscopeInputError) naming the setting: any bad value, with the fix in the message.
            InputNotImplementedError: a combination of settings that is not supported.
        """
        from .models import check_device_map
        from .scores import check_weights
        from .tasks import TASKS

        tasks = self.tasks
        check_int("n_pairs", self.n_pairs, fix="need at least one calibration pair per task")
        if self.n_pairs < 1:
            raise SettingError("n_pairs", f"{{setting}}={self.n_pairs}: need at least one calibration pair per task")
        if not tasks:
            raise SettingError("tasks", f"no task given; pass {{setting}} with one of {', '.join(sorted(TASKS))}")
        unknown = [t for t in tasks if not isinstance(t, str) or t not in TASKS]
        if unknown:
            raise SettingError("tasks", f"unknown task(s) {unknown}; available: {', '.join(sorted(TASKS))}")
        if len(set(tasks)) != len(tasks):
            raise SettingError("tasks", f"tasks {list(tasks)} name a capability twice; give each once")
        check_int("seq_len", self.seq_len, lo=16, fix="the prompt needs room for the task's text")
        depths = [self.depth] if isinstance(self.depth, (int, float)) and not isinstance(self.depth, bool) else list(
            self.depth or [])
        if not depths:
            raise SettingError("depth", "{setting}: give at least one needle depth in [0, 1]")
        for d in depths:
            check_real("depth", d, 0.0, 1.0, fix="a needle depth is a fraction of the prompt, 0 = start, 1 = end")
        check_int("seed", self.seed)
        check_choice("mode", self.mode, MODES, "exact patches every head, screen uses the AtP screen")
        check_choice("path", self.path, ("auto", "fast", "generic"))
        if self.batch_size is not None:
            check_int("batch_size", self.batch_size, lo=1)
        fused = self.fused
        if self.mode == "screen" and fused:
            raise InputNotImplementedError("mode='screen' covers the receivers-only ranking; use mode='exact' with fusion")
        if self.device_map is not None and (fused or self.mode != "exact"):
            raise InputNotImplementedError(
                "device_map covers the exact receiver sweep of one task in one process; drop --device-map, or "
                "--mode screen / --senders / several tasks / --devices"
            )
        if fused:
            check_weights(self.fusion.weight_arg(), tasks)
        if self.task_settings:
            if not isinstance(self.task_settings, dict):
                raise InputTypeError(f"task_settings must be a dict, not {type(self.task_settings).__name__}")
            for t in tasks:
                check_task_settings(t, self.task_settings)
        check_device(self.device, "device")
        check_device_map(self.device_map, name="device_map")

    # ---- views
    @property
    def fused(self) -> bool:
        """Whether the fused ranking (senders / κ / several capabilities) runs."""
        return self.fusion.active(self.tasks)

    @property
    def torch_dtype(self) -> Any:
        import torch

        if self.dtype is None or isinstance(self.dtype, torch.dtype):
            return self.dtype
        dt = getattr(torch, str(self.dtype), None)
        if not isinstance(dt, torch.dtype):
            raise HeadscopeInputError(f"dtype={self.dtype!r} is not a torch dtype; use torch.float32 or torch.bfloat16")
        return dt

    def settings(self) -> dict[str, Any]:
        """The task generators' settings (what ``make_pairs`` takes besides the tokenizer)."""
        return {"n_pairs": self.n_pairs, "seq_len": self.seq_len, "seed": self.seed, "depth": self.depth,
                **(self.task_settings or {})}

    def to_dict(self) -> dict[str, Any]:
        """The whole configuration as JSON-able values (what ``ranking.json`` keeps as ``provenance["config"]``)."""
        d = asdict(self)
        d["readout"] = self.readout.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "RankConfig":
        """Inverse of :meth:`to_dict`."""
        d = dict(d)
        d["readout"] = Readout(**d.get("readout", {}))
        d["screen"] = ScreenConfig(**d.get("screen", {}))
        d["fusion"] = FusionConfig(**d.get("fusion", {}))
        return cls(**d)

    def replace(self, **changes: Any) -> "RankConfig":
        return replace(self, **changes)

    @classmethod
    def from_kwargs(cls, **kw: Any) -> "RankConfig":
        """From :func:`headscope.rank`'s flat keywords (``lam``, ``direction``, ``min_gap``, ``verify``,
        ``senders``, ...): each goes to the config part that owns it; unknown names raise TypeError."""
        parts: dict[str, dict[str, Any]] = {"readout": {}, "screen": {}, "fusion": {}, "": {}}
        owner = {"lam": "readout", "direction": "readout", "min_gap": "readout", "verify": "screen",
                 "spot_checks": "screen", **{f.name: "fusion" for f in fields(FusionConfig)}}
        own = {f.name for f in fields(cls)}
        for k, v in kw.items():
            if k in owner:
                parts[owner[k]][k] = v
            elif k in own:
                parts[""][k] = v
            else:
                raise TypeError(f"RankConfig has no setting {k!r}")
        return cls(readout=parts[""].pop("readout", None) or Readout(**parts["readout"]),
                   screen=ScreenConfig(**parts["screen"]), fusion=FusionConfig(**parts["fusion"]), **parts[""])


def parse_verify(text: str) -> Any:
    """``--verify``: 'auto', a head count or a fraction. Raises HeadscopeInputError naming the forms."""
    if text == "auto":
        return "auto"
    try:
        return int(text) if text.isdigit() else float(text)
    except ValueError:
        raise HeadscopeInputError(f"--verify {text!r}: use auto, a head count or a fraction") from None


def parse_dtype(text: str, name: str = "dtype") -> Any:
    """``--dtype``: the name of a floating-point torch dtype (``bfloat16``, ``torch.float16``) -> that dtype.

    Raises:
        HeadscopeInputError: any other name (the message names the accepted ones).
    """
    import torch

    dt = getattr(torch, str(text).removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype) or not dt.is_floating_point:
        raise HeadscopeInputError(f"{name} {text!r}: use float32, bfloat16 or float16")
    return dt


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


def check_rank_call(cfg: RankConfig, pairs: Any = None, out_dir: Any = None, shard: Any = None,
                    geometry: Any = None) -> None:
    """What a ranking call adds to its config (:func:`headscope.rank`, ``headscope rank``), before the model loads:
    ready-made ``pairs``, the output folder, a shard ``(rank, world_size)`` and, with ``geometry`` (from
    :func:`headscope.models.check_model`), the prompt against the model's context and a ``verify`` count against
    its heads.

    Raises:
        SettingError (a HeadscopeInputError) naming the setting: any bad value, with the fix in the message.
        InputNotImplementedError: a combination of options that is not supported.
    """
    from .tasks.base import Pair

    if shard is not None:
        if cfg.mode == "screen":
            raise InputNotImplementedError("mode='screen' runs in one process; shard exact sweeps instead")
        if cfg.device_map is not None:
            raise InputNotImplementedError(
                "device_map covers the exact receiver sweep of one task in one process; drop --device-map, or "
                "--mode screen / --senders / several tasks / --devices"
            )
        if cfg.fused:
            raise InputNotImplementedError(
                "sharded sweeps (--devices / torchrun) cover the receiver sweep of one task; run fused rankings in "
                "one process"
            )
        if out_dir is None:
            raise SettingError("out_dir", "a sharded sweep needs {setting}: the ranks meet in its store")
        r, w = shard
        check_int("shard world size", w, lo=1)
        check_int("shard rank", r, lo=0, hi=w - 1)
    if geometry is not None:
        if geometry.n_ctx and cfg.seq_len >= geometry.n_ctx:
            raise SettingError(
                "seq_len", f"{{setting}}={cfg.seq_len} leaves no room for the answer: the model's context is "
                f"{geometry.n_ctx} tokens; use a shorter seq_len")
        cfg.screen.check_model(geometry)
    if pairs is not None:
        if cfg.fused and len(cfg.tasks) != 1:
            raise HeadscopeInputError(
                "ready-made pairs label a single task; pass pairs with one task, or let rank generate them"
            )
        pairs = list(pairs)
        if not pairs:
            raise HeadscopeInputError("pairs=[] holds no calibration pair; pass at least one, or pairs=None")
        bad = [i for i, p in enumerate(pairs) if not isinstance(p, Pair)]
        if bad:
            raise InputTypeError(f"pairs {bad[:5]} are not headscope Pair objects; build them with headscope.tasks.Pair")
    if out_dir is not None:
        check_out_dir(out_dir, "out_dir")


# ---------------------------------------------------------------------------------------- the CLI view
#: the readout's fields as ``headscope rank`` options (Readout lives in readout.py, beside eq. 9 and 10)
READOUT_CLI = {
    "lam": {"help": "decay λ of the span readout (eq. 9)", "flag": "--lambda"},
    "direction": {"help": "noising (default) or denoising"},
    "min_gap": {"help": "skip pairs whose |m(x) - m(x')| is below this (logits)"},
}


@dataclass(frozen=True)
class CliField:
    """One ``headscope rank`` option generated from a config field: ``path`` (e.g. ``("readout", "lam")``),
    flag, type, default, help and how the typed value is parsed (``parse``)."""

    path: tuple[str, ...]
    flag: str
    type: Any
    default: Any
    help: str
    parse: Optional[str] = None

    @property
    def name(self) -> str:
        return "_".join(self.path) if self.path[0] in ("readout", "screen", "fusion") else self.path[-1]


def cli_fields() -> Iterator[CliField]:
    """The options of ``headscope rank`` that configure the ranking, from the fields of :class:`RankConfig`,
    :class:`~headscope.readout.Readout`, :class:`ScreenConfig` and :class:`FusionConfig` that carry ``cli`` metadata."""
    ro = {f.name: f for f in fields(Readout)}
    for name, meta in READOUT_CLI.items():
        f = ro[name]
        yield CliField(("readout", name), meta.get("flag") or "--" + name.replace("_", "-"), type(f.default),
                       f.default, meta["help"])
    for prefix, cls in (("", RankConfig), ("screen", ScreenConfig), ("fusion", FusionConfig)):
        for f in fields(cls):
            meta = f.metadata.get("cli")
            if meta is None:
                continue
            default = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
            yield CliField(
                (prefix, f.name) if prefix else (f.name,), meta["flag"] or "--" + f.name.replace("_", "-"),
                meta["cli_type"] or type(default), meta.get("cli_default", default), meta["help"], meta.get("parse"),
            )


def cli_names() -> dict[str, str]:
    """The ``headscope rank`` flag of each setting a :class:`~headscope.errors.SettingError` can name
    (``{"n_pairs": "--pairs", "lam": "--lambda", ...}``)."""
    return {**{cf.path[-1]: cf.flag for cf in cli_fields()}, "out_dir": "--out", "model": "--model"}


def config_from_cli(values: dict[str, Any]) -> dict[str, Any]:
    """Flat :func:`headscope.rank` keywords from the generated options' values (keyed by
    :attr:`CliField.name`), parsed (``--verify`` text, one ``--depth`` as a float, no ``--weight`` as None,
    ``--dtype`` as a torch dtype).

    Raises:
        HeadscopeInputError: a ``--verify`` that is neither auto, a count nor a fraction; a ``--dtype`` that is
            not a floating-point torch dtype.
    """
    out: dict[str, Any] = {}
    for cf in cli_fields():
        v = values[cf.name]
        if cf.parse == "verify":
            v = parse_verify(v)
        elif cf.parse == "count_or_fraction":
            v = int(v) if v >= 1 else v
        elif cf.parse == "dtype":
            v = None if v is None else parse_dtype(v, cf.flag)
        elif cf.parse == "depth":
            v = v[0] if len(v) == 1 else tuple(v)
        elif cf.parse == "weights":
            v = list(v) if v else None
        elif isinstance(v, list):
            v = tuple(v)
        out[cf.path[-1]] = v
    return out
