"""Frozen, typed configurations of a ranking: :class:`RankConfig` with its :class:`~headscope.readout.Readout`,
:class:`ScreenConfig` and :class:`FusionConfig`.

Each validates itself once, when made (:func:`check_rank_args`, :mod:`headscope.validate`; a bad value raises
:class:`~headscope.errors.HeadscopeInputError` naming the fix), is saved whole in ``ranking.json``'s
provenance (``provenance["config"]``, :meth:`RankConfig.to_dict`), and declares per field what the
``headscope rank`` command needs (flag, type, help: the ``cli`` metadata), from which
:mod:`headscope.cli` generates the command's options (:func:`cli_fields`): one list, not two.
"""

from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from typing import Any, Iterator, Optional, Sequence, Union

from .errors import HeadscopeInputError, InputNotImplementedError, InputTypeError
from .readout import DEFAULT_LAMBDA, DEFAULT_MIN_GAP, DIRECTIONS, Readout
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
                raise HeadscopeInputError(f"verify {self.verify!r}: {fix}")
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
        if isinstance(self.verify, int) and not isinstance(self.verify, bool) and self.verify > n:
            raise HeadscopeInputError(f"verify={self.verify} must be within 1..{n} (the model's heads)")


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
    """Everything that determines a ranking's numbers, validated once (:func:`check_rank_args`).

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
        check_choice("path", self.path, ("auto", "fast", "generic"))
        check_rank_args(**self.check_args())

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

    def check_args(self, **call: Any) -> dict[str, Any]:
        """Keyword arguments of :func:`check_rank_args` for this config (plus ``call``:
        pairs, out_dir, shard, geometry, cli)."""
        s, f = self.screen, self.fusion
        return dict(
            tasks=self.tasks, n_pairs=self.n_pairs, seq_len=self.seq_len, seed=self.seed, depth=self.depth,
            lam=self.readout.lam, direction=self.readout.direction, min_gap=self.readout.min_gap,
            device=self.device, dtype=self.torch_dtype, batch_size=self.batch_size,
            task_settings=self.task_settings, mode=self.mode, verify=s.verify, spot_checks=s.spot_checks,
            senders=f.senders, weights=f.weight_arg(), kappa=f.kappa, normalize=f.normalize,
            sender_mode=f.sender_mode, top_k=f.top_k, max_rounds=f.max_rounds,
            sender_batch_size=f.sender_batch_size, device_map=self.device_map, **call,
        )

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


# ---------------------------------------------------------------------------------------- the checks of a ranking
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


def check_rank_args(
    *, tasks: Any = ("niah_single",), n_pairs: Any = 6, seq_len: Any = 512, seed: Any = 0, depth: Any = 0.5,
    lam: Any = DEFAULT_LAMBDA, direction: Any = "noising", min_gap: Any = DEFAULT_MIN_GAP, pairs: Any = None, out_dir: Any = None,
    device: Any = None, dtype: Any = None, batch_size: Any = None, task_settings: Any = None, shard: Any = None,
    mode: Any = "exact", verify: Any = "auto", spot_checks: Any = 0.05, senders: bool = False, weights: Any = None,
    kappa: Any = None, normalize: Any = "max", sender_mode: Any = "qkv", top_k: Any = 10, max_rounds: Any = 3,
    sender_batch_size: Any = 16, device_map: Any = None, geometry: Any = None, cli: bool = False,
) -> tuple[str, ...]:
    """Every argument of :func:`headscope.rank` (and ``headscope rank``), before the model loads.

    ``geometry`` (from :func:`headscope.models.check_model`) adds the checks that need the model's shape (the prompt
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
        if is_int(verify):
            check_int(f("verify"), verify, lo=1, hi=geometry.n_total if geometry else None, fix=fix)
        elif isinstance(verify, float):
            check_real(f("verify"), verify, 0.0, 1.0, lo_open=True, fix=fix)
        else:
            raise HeadscopeInputError(f"{f('verify')} {verify!r}: {fix}")
    if is_int(spot_checks):
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
    from .models import check_device_map

    check_device_map(device_map, name=f("device_map"))
    if out_dir is not None:
        check_out_dir(out_dir, f("out_dir"))
    return tasks


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
