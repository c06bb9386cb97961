"""Per-device memory of a conversion stage, computed before any model loads (issue 63, item 2).

:func:`plan_memory` adds up, in bytes per device, what a stage of the three-stage transfer holds
(SPEC.md §9; :mod:`headscope.train.trainer`):

* **student parameters**: the teacher's parameters with every attention module replaced by the
  head-wise hybrid's (:func:`hybrid_attention_params`: q / o for every head, k / v for the FA heads'
  KV groups, per GDN head its own k / v rows, a, β (with bias), decay and dt; γ per head; q/k norms where
  the teacher has them; the FA gate and the GDN short convolution when on), stored in ``master`` precision;
* **gradients** of the trained parameters (stage 1: the attention modules, or with ``new_params_only``
  the parameters the hybrid initializes instead of copying: a, β, decay, dt, γ, FA gate, convolution:
  :data:`headscope.train.stages.NEW_PARAMETERS`, what ``TrainConfig.new_params_only`` trains),
  in ``master`` precision;
* **optimizer states**: AdamW's two moments per trained parameter, fp32 (4 + 4 bytes), bf16 (2 + 2)
  or 8-bit (1 + 1, plus a 4-byte scale per 2,048-value block of each);
* **teacher weights** (stages 1 and 2): every parameter in ``teacher_dtype``, on every device (the
  trainer does not shard the teacher);
* **activations**: an estimate, per token and layer, of what autograd keeps for the backward in bf16
  training with flash attention and fla's chunked GDN kernel (no T² score matrix, no per-chunk d × d
  state), the residual stream in fp32 (:func:`activation_bytes_per_token`); with activation
  checkpointing only each layer's input plus one layer's activations during its recomputation; stage 1
  adds every teacher layer's attention input (normalized, in ``teacher_dtype``: an RMSNorm is no autocast
  op) and output (bf16), stage 2 the teacher's final hidden states (``teacher_dtype``);
* **loss chunk**: the fast step's LM head + loss over ``loss_chunk`` rows at a time
  (:mod:`headscope.train.fused_loss`): fp32 logits of the chunk, the teacher's too in stage 2, and their
  gradient; under FSDP2, which runs the plain step, the same for every row of the batch at once;
* **gathered** (FSDP2 over N devices): the full parameters and gradients of two decoder-layer units in
  flight (stage 1: attention modules) and, in stages 2–3, of the root (embeddings, final norm, LM head:
  FSDP2 keeps the root gathered from forward to backward), in ``master`` precision (the trainer sets no
  FSDP2 mixed-precision policy), on top of the 1/N shards of parameters, gradients and optimizer states.
  Stage 1 shards only the attention modules; the rest of the student is replicated.
  With ``cpu_offload`` (FSDP2's ``CPUOffloadPolicy``) the shards live in host memory (``host``) and the
  device holds what is gathered.

Of the options, ``activation_checkpointing``, ``new_params_only``, ``teacher_dtype``, ``devices`` /
``data_parallel`` and fp32 ``master`` / ``optimizer`` are what :class:`~headscope.train.TrainConfig` runs (``headscope
convert``'s flags of the same names); bf16 master weights, bf16 or 8-bit AdamW states and CPU offload are planned only
(docs/conversion.md#memory-plan says why).

Parameter, gradient and optimizer bytes are exact for one device (checked against a trained tiny
model's tensors, ``tests/test_memory_plan.py``); shards are counted as 1/N of the total (FSDP2 pads each
parameter's first dimension to a multiple of N: at most N − 1 rows more per parameter). Activations are
an estimate: at the SmolLM2-135M shape (64 × 512 rows, 34 FA heads) the plan's totals are 0.83× (stage 1),
0.98× (stage 2) and 0.92× (stage 3) of the peaks the fast step reached on an H200
(``benchmarks/results/h200_train.json``; ``tests/test_memory_plan.py``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Optional, Sequence

from ..errors import HeadscopeInputError

GiB = 2**30
CHUNK = 64  # fla's GDN chunk length (HybridOptions.chunk_size)
_DTYPE_BYTES = {"fp32": 4, "bf16": 2}
_OPTIM_BYTES = {"fp32": 8.0, "bf16": 4.0, "8bit": 2.0 + 2 * 4 / 2048}


@dataclass(frozen=True)
class ModelShape:
    """The dimensions of a Llama / Qwen3 decoder a memory plan needs.

    Attributes:
        name: a label.
        vocab, hidden, intermediate, layers, heads, kv_heads, head_dim: the transformers config's
            ``vocab_size``, ``hidden_size``, ``intermediate_size``, ``num_hidden_layers``,
            ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``.
        tied: ``tie_word_embeddings`` (one matrix for embeddings and LM head).
        qk_norm: per-head RMSNorm of q and k (Qwen3).
    Biases on the attention projections (Qwen2, Llama with ``attention_bias``) are not modelled:
    :meth:`from_config` refuses them.
    """

    name: str
    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool = False
    qk_norm: bool = False

    @classmethod
    def from_config(cls, cfg: Any, name: str = "") -> "ModelShape":
        """From a transformers config (Llama, Qwen3, Mistral and the like).

        Raises:
            HeadscopeInputError: attention projections with biases (Qwen2, ``attention_bias``).
        """
        mtype = str(getattr(cfg, "model_type", ""))
        if mtype == "qwen2" or getattr(cfg, "attention_bias", False):
            raise HeadscopeInputError(f"{mtype}: attention biases are not in the memory plan; plan a Llama / Qwen3 shape")
        heads = int(cfg.num_attention_heads)
        d = getattr(cfg, "head_dim", None) or int(cfg.hidden_size) // heads
        return cls(
            name=name or str(getattr(cfg, "model_type", "model")), vocab=int(cfg.vocab_size),
            hidden=int(cfg.hidden_size), intermediate=int(cfg.intermediate_size), layers=int(cfg.num_hidden_layers),
            heads=heads, kv_heads=int(getattr(cfg, "num_key_value_heads", None) or heads), head_dim=int(d),
            tied=bool(getattr(cfg, "tie_word_embeddings", False)), qk_norm=mtype == "qwen3",
        )

    def attention_params(self) -> int:
        """Parameters of one teacher attention module (q, k, v, o, q/k norms)."""
        h, d, H, KV = self.hidden, self.head_dim, self.heads, self.kv_heads
        return 2 * H * d * h + 2 * KV * d * h + (2 * d if self.qk_norm else 0)

    def layer_params(self) -> int:
        """Parameters of one teacher decoder layer (attention, SwiGLU MLP, two RMSNorms)."""
        return self.attention_params() + 3 * self.hidden * self.intermediate + 2 * self.hidden

    def root_params(self) -> int:
        """Embeddings, LM head (once when tied) and the final norm."""
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    def teacher_params(self) -> int:
        return self.layers * self.layer_params() + self.root_params()


# the two shapes of issue 63 (their published config.json values; nothing is downloaded)
KNOWN_SHAPES: dict[str, ModelShape] = {
    "qwen3-1.7b": ModelShape("qwen3-1.7b", vocab=151936, hidden=2048, intermediate=6144, layers=28, heads=16,
                             kv_heads=8, head_dim=128, tied=True, qk_norm=True),
    "llama-3.1-8b": ModelShape("llama-3.1-8b", vocab=128256, hidden=4096, intermediate=14336, layers=32, heads=32,
                               kv_heads=8, head_dim=128, tied=False),
    "smollm2-135m": ModelShape("smollm2-135m", vocab=49152, hidden=576, intermediate=1536, layers=30, heads=9,
                               kv_heads=3, head_dim=64, tied=True),
}


@dataclass(frozen=True)
class LayerHeads:
    """One layer's FA heads for the plan: how many, and how many KV groups they span."""

    n_fa: int
    n_fa_kv: int


def layer_heads(shape: ModelShape, fa: Any) -> list[LayerHeads]:
    """Per layer (FA heads, their KV groups) from a :class:`headscope.HeadMask` (exact), or from a share of
    the heads (a float in (0, 1], e.g. 0.125 for 7:1): round(share · heads) FA heads per layer, at least one,
    spread over as many KV groups as they can span (the most parameters for that count).

    Raises:
        HeadscopeInputError: a share outside (0, 1]; a mask of another shape.
    """
    if hasattr(fa, "fa_heads"):
        if (fa.n_layers, fa.n_heads, fa.n_kv_heads) != (shape.layers, shape.heads, shape.kv_heads):
            raise HeadscopeInputError(f"the mask is for {fa.n_layers} layers x {fa.n_heads} heads ({fa.n_kv_heads} KV), "
                                      f"the model has {shape.layers} x {shape.heads} ({shape.kv_heads}): use its own mask")
        g = shape.heads // shape.kv_heads
        return [LayerHeads(len(h), len({x // g for x in h})) for h in fa.fa_heads]
    share = float(fa)
    if not 0 < share <= 1:
        raise HeadscopeInputError(f"FA share {share} must lie in (0, 1] (0.125 is 7:1)")
    n = max(1, round(share * shape.heads))
    return [LayerHeads(n, min(n, shape.kv_heads))] * shape.layers


def hybrid_attention_params(shape: ModelShape, heads: LayerHeads, fa_gate: bool = True, gdn_conv: int = 0,
                            fusion: str = "rmsnorm") -> dict[str, int]:
    """Parameters of one hybrid attention module (:class:`headscope.hybrid.layer.HeadwiseHybridAttention`),
    split into ``copied`` (initialized from the teacher: q, o, the FA heads' k / v, the GDN heads' k / v
    rows, q/k norms) and ``new`` (initialized by the hybrid: a, β and its bias, decay, dt, γ, FA gate,
    short convolution). ``fa_gate`` / ``gdn_conv`` / ``fusion``: the :class:`headscope.hybrid.HybridOptions`
    of the same names (``headscope convert``'s defaults: FA gate on, no convolution, RMSNorm fusion)."""
    h, d, H = shape.hidden, shape.head_dim, shape.heads
    n_fa, n_kv, n_gdn = heads.n_fa, heads.n_fa_kv, shape.heads - heads.n_fa
    copied = 2 * H * d * h + 2 * n_kv * d * h + 2 * n_gdn * d * h + (2 * d if shape.qk_norm else 0)
    new = 2 * n_gdn * h + n_gdn + 2 * n_gdn if n_gdn else 0  # a, β (+ bias), A_log, dt_bias
    new += H * d if fusion == "rmsnorm" else 0
    new += n_fa * d * h + n_fa * d if fa_gate and n_fa else 0
    new += 3 * n_gdn * d * gdn_conv
    return {"copied": copied, "new": new}


def activation_bytes_per_token(shape: ModelShape, heads: LayerHeads, mlp: bool = True) -> int:
    """Bytes autograd keeps per token for one student layer in bf16 training (the estimate of the module
    docstring): the residual stream and the normalized input of each RMSNorm in fp32 (4 + 4 bytes per
    channel, a 4-byte rstd); the projections' bf16 input (2 per channel); per FA head its q and its KV
    groups' k, v (bf16) and flash attention's log-sum-exp (fp32); per GDN head its q, k, v (bf16), gate and
    β (fp32) and fla's per-chunk block row (64 fp32 values); the bf16 input of o_proj (every head); the MLP's
    gate, up, activation and product (bf16, 4 × intermediate). ``mlp=False``: the attention half only
    (stage 1 trains the attention modules on the teacher's inputs)."""
    h, d, H = shape.hidden, shape.head_dim, shape.heads
    n_gdn = H - heads.n_fa
    attn = 8 * h + 4 + 2 * h
    attn += 2 * d * (heads.n_fa + 2 * heads.n_fa_kv) + 4 * heads.n_fa
    attn += n_gdn * (2 * 3 * d + 4 * 2 + 4 * CHUNK)
    attn += 2 * H * d
    if not mlp:
        return attn
    return attn + 8 * h + 4 + 2 * h + 2 * 4 * shape.intermediate


@dataclass(frozen=True)
class MemoryOptions:
    """How a stage would run (:func:`plan_memory`).

    Attributes:
        devices: GPUs training together.
        data_parallel: with ``devices`` > 1: ``"fsdp"`` (FSDP2 shards; the default for a plan: what fits) or
            ``"ddp"`` (every device holds everything).
        master: ``"fp32"`` (fp32 master weights and gradients, bf16 autocast: the trainer's) or ``"bf16"``.
        optimizer: AdamW state precision: ``"fp32"``, ``"bf16"`` or ``"8bit"`` (blockwise, e.g. bitsandbytes).
        activation_checkpointing: keep only each layer's input; recompute the layer in the backward.
        new_params_only: stage 1 trains only the parameters the hybrid initializes (not the copied q/k/v/o).
        cpu_offload: FSDP2's CPU offload: parameter, gradient and optimizer shards in host memory.
        teacher_dtype: ``"bf16"`` or ``"fp32"``.
        loss_chunk: rows per LM-head chunk of the fast step (``TrainConfig.loss_chunk``).
        fa_gate, gdn_conv, fusion: the hybrid options that change the parameter count.
    """

    devices: int = 1
    data_parallel: str = "fsdp"
    master: str = "fp32"
    optimizer: str = "fp32"
    activation_checkpointing: bool = False
    new_params_only: bool = False
    cpu_offload: bool = False
    teacher_dtype: str = "bf16"
    loss_chunk: int = 4096
    fa_gate: bool = True
    gdn_conv: int = 0
    fusion: str = "rmsnorm"

    def __post_init__(self) -> None:
        """Raises HeadscopeInputError for a setting outside its choices."""
        from ..validate import check_choice

        if self.devices < 1 or self.loss_chunk < 1 or self.gdn_conv < 0:
            raise HeadscopeInputError(f"devices ({self.devices}) and loss_chunk ({self.loss_chunk}) must be >= 1, "
                                      f"gdn_conv ({self.gdn_conv}) >= 0")
        check_choice("data_parallel", self.data_parallel, ("fsdp", "ddp"))
        check_choice("master", self.master, tuple(_DTYPE_BYTES))
        check_choice("optimizer", self.optimizer, tuple(_OPTIM_BYTES))
        check_choice("teacher_dtype", self.teacher_dtype, tuple(_DTYPE_BYTES))
        check_choice("fusion", self.fusion, ("rmsnorm", "none"))
        if self.cpu_offload and not (self.devices > 1 and self.data_parallel == "fsdp"):
            raise HeadscopeInputError("cpu_offload is FSDP2's: use it with devices > 1 and data_parallel='fsdp'")


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes per device of one stage (see the module docstring); ``host``: bytes in host memory per device
    (CPU offload). ``counts``: the parameter counts behind them."""

    stage: int
    rows: int
    seq_len: int
    options: MemoryOptions
    params: int
    grads: int
    optimizer: int
    teacher: int
    activations: int
    loss_chunk: int
    gathered: int
    host: int
    counts: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        """Bytes on each device."""
        return self.params + self.grads + self.optimizer + self.teacher + self.activations + self.loss_chunk + self.gathered

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "total": self.total}

    def table(self) -> list[tuple[str, float]]:
        """(part, GiB) rows, the total last."""
        parts = ("params", "grads", "optimizer", "teacher", "activations", "loss_chunk", "gathered")
        rows = [(p, getattr(self, p) / GiB) for p in parts]
        if self.host:
            rows.append(("host (offloaded)", self.host / GiB))
        return rows + [("total per device", self.total / GiB)]


def plan_memory(shape: ModelShape, stage: int, rows: int, seq_len: int, fa: Any = 0.125,
                options: Optional[MemoryOptions] = None) -> MemoryPlan:
    """Bytes per device of ``stage`` (1, 2, 3) for a student of ``shape`` with the FA heads ``fa`` (a
    :class:`headscope.HeadMask` or a share of the heads, :func:`layer_heads`), training ``rows`` rows of
    ``seq_len`` tokens per device per step, under ``options``.

    Raises:
        HeadscopeInputError: a stage other than 1-3, rows or seq_len < 1, a bad mask or share.
    """
    from .stage_checks import check_stage

    check_stage(stage)
    if rows < 1 or seq_len < 1:
        raise HeadscopeInputError(f"rows ({rows}) and seq_len ({seq_len}) must be >= 1")
    o = options or MemoryOptions()
    per_layer = layer_heads(shape, fa)
    attn = [hybrid_attention_params(shape, lh, o.fa_gate, o.gdn_conv, o.fusion) for lh in per_layer]
    attn_total = sum(a["copied"] + a["new"] for a in attn)
    student = shape.teacher_params() - shape.layers * shape.attention_params() + attn_total
    if stage == 1:
        trained = sum(a["new"] for a in attn) if o.new_params_only else attn_total
    else:
        trained = student
    w = _DTYPE_BYTES[o.master]
    n = o.devices if o.data_parallel == "fsdp" else 1  # the shard count
    tokens = rows * seq_len
    # activations
    body = [activation_bytes_per_token(shape, lh, mlp=stage != 1) for lh in per_layer]
    if o.activation_checkpointing:
        act = tokens * (shape.layers * 4 * shape.hidden + max(body))
    else:
        act = tokens * sum(body)
    t_bytes = _DTYPE_BYTES[o.teacher_dtype]  # the teacher's normalized hidden states are in its own dtype
    if stage == 1:  # the teacher's attention inputs (its dtype) and outputs (bf16 under autocast) of every layer
        act += tokens * shape.layers * (t_bytes + 2) * shape.hidden
    elif stage == 2:  # the teacher's final hidden states (its dtype) for the KL chunks
        act += tokens * t_bytes * shape.hidden
    act += tokens * 4 * shape.hidden  # the embeddings' output / the final norm (fp32)
    plain = n > 1  # FSDP2 runs the plain step: the whole batch's logits at once
    chunk = 0 if stage == 1 else (tokens if plain else min(o.loss_chunk, tokens)) * shape.vocab * 4 * (3 if stage == 2 else 2)
    # sharded state
    params, grads, optim = student * w, trained * w, math.ceil(trained * _OPTIM_BYTES[o.optimizer])
    gathered = 0
    if n > 1:
        # stage 1 shards only the attention modules (train/parallel.shard_student); the frozen rest is replicated
        sharded = attn_total if stage == 1 else student
        params = (student - sharded) * w + sharded * w // n
        grads, optim = grads // n, optim // n
        layer_unit = max(a["copied"] + a["new"] for a in attn)
        if stage != 1:
            layer_unit += shape.layer_params() - shape.attention_params()
        gathered = 2 * layer_unit * w * 2  # two layer units in flight, their full parameters and gradients
        if stage != 1:
            gathered += shape.root_params() * w * 2  # the root stays gathered from forward to backward
    host = 0
    if o.cpu_offload:
        host, params, grads, optim = params + grads + optim, 0, 0, 0
    teacher = shape.teacher_params() * _DTYPE_BYTES[o.teacher_dtype] if stage in (1, 2) else 0
    counts = {"teacher": shape.teacher_params(), "student": student, "trained": trained,
              "hybrid_attention": attn_total, "new": sum(a["new"] for a in attn)}
    return MemoryPlan(stage, rows, seq_len, o, params, grads, optim, teacher, act, chunk, gathered, host, counts)


def plan_table(shape: ModelShape, stages: Sequence[int], rows: dict[int, tuple[int, int]], fa: Any,
               options: MemoryOptions) -> str:
    """A plain-text table of :func:`plan_memory` for ``stages`` (``rows[stage]`` = (rows per device,
    tokens per row)), GiB per device, one column per stage."""
    plans = [plan_memory(shape, s, *rows[s], fa=fa, options=options) for s in stages]
    names = [name for name, _ in plans[0].table()]
    head = ["GiB per device"] + [f"stage {p.stage} ({p.rows} x {p.seq_len})" for p in plans]
    body = [[name] + [f"{dict(p.table()).get(name, 0.0):.2f}" for p in plans] for name in names]
    widths = [max(len(r[i]) for r in [head] + body) for i in range(len(head))]
    line = lambda r: "  ".join(c.ljust(widths[0]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(r))  # noqa: E731
    o = options
    setting = (f"{shape.name}: {plans[0].counts['teacher'] / 1e9:.2f}B teacher, {plans[0].counts['student'] / 1e9:.2f}B "
               f"student; {o.devices} device(s){' ' + o.data_parallel if o.devices > 1 else ''}, master {o.master}, "
               f"AdamW states {o.optimizer}, teacher {o.teacher_dtype}"
               + (", activation checkpointing" if o.activation_checkpointing else "")
               + (", stage 1 new parameters only" if o.new_params_only else "")
               + (", CPU offload" if o.cpu_offload else ""))
    return "\n".join([setting, line(head), *(line(r) for r in body)])


def shape_of(model: str) -> ModelShape:
    """A :class:`ModelShape` from a name in :data:`KNOWN_SHAPES` or a local ``config.json`` / model directory
    (read with transformers' ``AutoConfig``; nothing is downloaded).

    Raises:
        HeadscopeInputError: neither a known name nor an existing local path; a config the plan cannot model.
    """
    from pathlib import Path

    if model.lower() in KNOWN_SHAPES:
        return KNOWN_SHAPES[model.lower()]
    p = Path(model)
    if not p.exists():
        raise HeadscopeInputError(f"{model!r} is neither a known shape ({', '.join(KNOWN_SHAPES)}) nor a local "
                                  "config.json or model directory")
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(p if p.is_dir() else p.parent), local_files_only=True)
    return ModelShape.from_config(getattr(cfg, "text_config", cfg), name=p.name)
