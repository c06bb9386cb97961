"""Replicated data parallelism: every rank holds the whole student, runs the one-process (fast) step on
its slice of the global batch, and the gradients are summed over ranks through flat buffers.

The one-process step normalizes its loss by the *local* count of real tokens (stage 2: real tokens;
stage 3: kept next-token positions; stage 1: per layer, the local teacher-output variance). The
gradient of the *global* batch loss is a weighted sum of the local gradients, so each rank scales its
gradients by its weight before one SUM all-reduce per bucket:

* stages 2 and 3: ``w_r = n_r / N`` (``n_r`` this rank's count, ``N`` the global one), one weight for
  every parameter (:func:`count_weight`);
* stage 1: the loss is the mean over layers of ``Σ (y_s - y_t)² / Σ (y_t - mean)²`` over real tokens,
  and layer l's term depends only on layer l's attention parameters; with this rank's teacher
  statistics (token count, sum, sum of squared deviations per layer) gathered from every rank, the
  global variance is exact, and layer l's gradients get the weight
  ``w_{r,l} = n_r · var_{r,l} / (N · var_l)`` (:func:`stage1_weights`).

The logged values are summed with the same weights (they ride in the first bucket), so every rank
gets the global loss. After the all-reduce every rank holds the same gradients (a sum is the same
on every rank for NCCL and gloo), and clipping and AdamW keep the replicas equal without broadcasts.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist
from jaxtyping import Bool, Float
from torch import Tensor

from . import parallel
from .stages import loss_token_count

BUCKET_BYTES = 512 * 2**20


def real_count(stage: int, mask: Bool[Tensor, "batch time"]) -> int:
    """The count the one-process step of ``stage`` divides its loss by
    (:func:`headscope.train.stages.loss_token_count`), on the host.

    Raises:
        ValueError: a stage other than 1, 2, 3.
    """
    return int(loss_token_count(stage, mask))


def count_weight(stage: int, local_mask: Bool[Tensor, "local time"], global_mask: Bool[Tensor, "batch time"]) -> float:
    """Stages 2, 3: this rank's weight ``n_r / N`` (0 when the global batch has no counted position,
    where the one-process loss is 0 too)."""
    n, total = real_count(stage, local_mask), real_count(stage, global_mask)
    return n / total if total > 0 else 0.0


def stage1_weights(stats: Float[Tensor, "layer stat"]) -> Float[Tensor, "layer"]:
    """Stage 1: this rank's per-layer weights ``n_r · var_{r,l} / (N · var_l)`` (a collective).

    Args:
        stats: this rank's teacher statistics per layer, ``[n, q, s_0 .. s_{D-1}]`` with n the real
            token count, q the sum of squared deviations of the teacher attention output from its
            local mean (summed over channels) and s the per-channel sums
            (:attr:`headscope.train.fast.FastStep.stats`).

    Both variances are clamped at 1e-12 as in the loss. Returns zeros for a rank without real tokens.
    """
    rank, world = parallel.world_info()
    st = stats.float()
    every = torch.zeros((world,) + tuple(st.shape), dtype=st.dtype, device=st.device)
    every[rank] = st
    parallel.all_sum(every)  # an all-gather through a sum: [world, layer, 2 + D]
    n, q, s = every[..., 0], every[..., 1], every[..., 2:]
    d = s.shape[-1]
    n_all = n.sum(0)  # [layer]
    mu_r = s / n.clamp_min(1.0)[..., None]
    mu = s.sum(0) / n_all.clamp_min(1.0)[..., None]
    ss = q.sum(0) + (n * ((mu_r - mu) ** 2).sum(-1)).sum(0)  # global sum of squared deviations per layer
    var_g = (ss / (n_all * d).clamp_min(1.0)).clamp_min(1e-12)
    n_r, q_r = n[rank], q[rank]
    var_r = (q_r / (n_r * d).clamp_min(1.0)).clamp_min(1e-12)
    w = n_r * var_r / (n_all.clamp_min(1.0) * var_g)
    return torch.where(n_r > 0, w, torch.zeros_like(w))


class GradReducer:
    """Weighted SUM all-reduce of the gradients of replicated parameters, in flat buckets.

    Args:
        params: the trained parameters, the same list in the same order on every rank.
        groups: a group index per parameter (stage 1: the decoder layer), weighted separately;
            default: one group.
        bucket_bytes: the most bytes of one flat buffer (a parameter larger than that gets its own).

    Parameters whose ``.grad`` is None are left out (the same ones on every rank: the ranks run the
    same code on the same model). The buffers are allocated on the first call and reused; the
    gradients are copied in and back (CUDA-graphed gradients keep their storage across replays, and
    eager ones are new tensors each step: copying works for both).

    Raises:
        ValueError: ``groups`` of another length than ``params``.
    """

    def __init__(self, params: Sequence[Tensor], groups: Optional[Sequence[int]] = None, bucket_bytes: int = BUCKET_BYTES):
        self.params = list(params)
        self.groups = [0] * len(self.params) if groups is None else [int(g) for g in groups]
        if len(self.groups) != len(self.params):
            raise ValueError(f"{len(self.groups)} group indices for {len(self.params)} parameters; give one per parameter")
        self.bucket_bytes = int(bucket_bytes)
        self._layout: Optional[tuple] = None  # (which grads were present, buckets)
        self._buckets: list[tuple[Tensor, list[int], list[Tensor]]] = []
        self._n_extra = 0

    def _build(self, present: tuple[bool, ...], extra: Tensor) -> None:
        idx = [i for i, ok in enumerate(present[:-1]) if ok]
        self._n_extra = 0
        buckets: list[list[int]] = []
        size = 0
        for i in idx:
            g = self.params[i].grad
            nbytes = g.numel() * g.element_size()
            same = buckets and self.params[buckets[-1][0]].grad.dtype == g.dtype \
                and self.params[buckets[-1][0]].grad.device == g.device
            if not buckets or not same or size + nbytes > self.bucket_bytes:
                buckets.append([])
                size = 0
            buckets[-1].append(i)
            size += nbytes
        self._buckets = []
        for b, members in enumerate(buckets):
            g0 = self.params[members[0]].grad
            sizes = [self.params[i].grad.numel() for i in members]
            n_extra = extra.numel() if b == 0 and g0.dtype == torch.float32 else 0  # float32 only: exact sums
            buf = torch.empty(sum(sizes) + n_extra, dtype=g0.dtype, device=g0.device)
            views = [v.view(self.params[i].grad.shape) for v, i in zip(buf[: sum(sizes)].split(sizes), members)]
            self._buckets.append((buf, members, views))
            if b == 0:
                self._n_extra = n_extra
        self._layout = present

    def __call__(self, weights: Tensor | float, extra: Float[Tensor, "k"]) -> Float[Tensor, "k"]:
        """Scale every present gradient by its group's weight, sum over ranks (in place in ``.grad``)
        and return the sum over ranks of ``extra`` (the already weighted logged values; float32).

        Args:
            weights: one weight (float or 0-d tensor) for every parameter, or a [n_groups] tensor.
            extra: a few values summed along (float32; no gradient).
        """
        present = tuple(p.grad is not None for p in self.params) + (extra.numel(),)
        if present != self._layout:
            self._build(present, extra)
        per_group = isinstance(weights, Tensor) and weights.dim() == 1
        extra_out: Optional[Tensor] = None
        for b, (buf, members, views) in enumerate(self._buckets):
            grads = [self.params[i].grad for i in members]
            if per_group:
                by: dict[int, list[Tensor]] = {}
                for i, g in zip(members, grads):
                    by.setdefault(self.groups[i], []).append(g)
                for k, gs in by.items():
                    torch._foreach_mul_(gs, weights[k].to(gs[0].dtype))
            elif not (isinstance(weights, float) and weights == 1.0):
                torch._foreach_mul_(grads, weights)
            torch._foreach_copy_(views, grads)
            if b == 0 and self._n_extra:
                buf[len(buf) - self._n_extra:].copy_(extra.reshape(-1))
            if dist.is_initialized() and dist.get_world_size() > 1:
                dist.all_reduce(buf, op=dist.ReduceOp.SUM)
            torch._foreach_copy_(grads, views)
            if b == 0 and self._n_extra:
                extra_out = buf[len(buf) - self._n_extra:].clone()
        if extra_out is None and extra.numel() == 0:
            return extra
        if extra_out is None:  # no float32 gradient bucket: the logged values alone
            extra_out = parallel.all_sum(extra.detach().float().clone())
        return extra_out
