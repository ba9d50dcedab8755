"""Learning-rate schedules: the math in plain Python, and graph-mode Cells that match it.

Step numbering: optimizer step ``s`` runs from 1 to ``total_steps``. The optimizer's
``global_step`` counts steps already done, so it asks the schedule for step
``global_step + 1`` (see :class:`NextStep`); step 1 of a warmup therefore trains with
``lr / warmup_steps``, never with 0.

* ``cosine``: linear warmup to ``lr`` over ``warmup_steps``, then a half cosine from
  ``lr`` down to ``min_lr`` at ``total_steps``.
* ``step``: the DeepSeek-V2 paper's schedule: linear warmup, then ``lr`` multiplied by
  ``decay_factor`` (0.316) once past each milestone (60% and 90% of the steps).
* ``constant``: linear warmup, then ``lr``.

All three Cells are here, and none branches on a tensor: a Python ``if`` on the step in graph mode is control
flow, which splits the compiled step into several kernel graphs (MindFormers' ``CosineWithWarmUpLR`` does
``if global_step >= decay_steps: ...``). Under a pipeline the step's side-effect ordering (``UpdateState``)
then carries activations of every micro-batch out of the forward and backward kernel graph, held until the
optimizer's graph runs: most of stage 0's peak on ``v2-sft-64npu`` in MindSpore's level-1 accounting
(docs/measurements.md). The cosine Cell computes MindFormers' formula with selects,
and a test holds it to ``CosineWithWarmUpLR`` step by step.
"""

from __future__ import annotations

import math
from typing import Sequence

import mindspore as ms
from mindspore import nn, ops
from mindspore.common import dtype as mstype
from mindspore.nn.learning_rate_schedule import LearningRateSchedule


def milestone_steps(total_steps: int, milestones: Sequence[float]) -> list[int]:
    """Fractions of the run -> the last step trained at the previous rate (decay applies after it)."""
    return [int(round(f * total_steps)) for f in milestones]


def lr_at(
    step: int,
    *,
    schedule: str,
    lr: float,
    total_steps: int,
    warmup_steps: int = 0,
    min_lr: float = 0.0,
    milestones: Sequence[float] = (0.6, 0.9),
    decay_factor: float = 0.316,
) -> float:
    """Learning rate of optimizer step ``step`` (1-based)."""
    if warmup_steps > 0 and step < warmup_steps:
        return lr * step / warmup_steps
    if schedule == "constant":
        return lr
    if schedule == "step":
        passed = sum(1 for b in milestone_steps(total_steps, milestones) if step > b)
        return lr * decay_factor**passed
    if schedule == "cosine":
        if step >= total_steps:
            return min_lr
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"unknown schedule {schedule!r}")


class NextStep(LearningRateSchedule):
    """Evaluates ``inner`` at ``global_step + 1``: the step about to be taken."""

    def __init__(self, inner: nn.Cell):
        super().__init__()
        self.inner = inner

    def construct(self, global_step):
        return self.inner(global_step + 1)


class WarmupStepDecayLR(LearningRateSchedule):
    """Linear warmup, then ``lr * decay_factor ** (number of milestones passed)``.

    Input: the 1-based step (int Tensor). Milestones are absolute step numbers; the
    decay applies to steps strictly after each one.
    """

    def __init__(self, lr: float, warmup_steps: int, boundaries: Sequence[int], decay_factor: float):
        super().__init__()
        self.lr = float(lr)
        self.warmup = float(warmup_steps)
        self.boundaries = ms.Tensor([float(b) for b in boundaries] or [float("inf")], mstype.float32)
        self.log_factor = float(math.log(decay_factor))

    def construct(self, step):
        s = ops.cast(step, mstype.float32).reshape(())
        passed = ops.cast(s > self.boundaries, mstype.float32).sum()
        # decay_factor ** passed, as exp(passed * log(factor)) (no integer pow kernel needed)
        decayed = self.lr * ops.exp(passed * self.log_factor)
        if self.warmup > 0:
            warm = self.lr * s / self.warmup
            return ops.select(s < self.warmup, warm, decayed)
        return decayed


class WarmupCosineLR(LearningRateSchedule):
    """Linear warmup from 0, then a half cosine from ``lr`` to ``min_lr`` at ``total_steps`` and ``min_lr`` after:
    MindFormers' ``CosineWithWarmUpLR`` (num_cycles 0.5, warmup_lr_init 0, decay over ``total_steps``), written
    with selects instead of its branches (module docstring). Input: the 1-based step (int Tensor)."""

    def __init__(self, lr: float, warmup_steps: int, total_steps: int, min_lr: float):
        super().__init__()
        self.lr, self.min_lr = float(lr), float(min_lr)
        self.warmup = float(warmup_steps)
        self.total = float(total_steps)
        self.cosine_steps = float(max(1, total_steps - warmup_steps))

    def construct(self, step):
        s = ops.cast(step, mstype.float32).reshape(())
        progress = (s - self.warmup) / self.cosine_steps
        percent = ops.maximum(0.5 * (1.0 + ops.cos(math.pi * progress)), 0.0)
        lr = self.min_lr + (self.lr - self.min_lr) * percent
        if self.warmup > 0:
            lr = ops.select(s < self.warmup, self.lr * s / self.warmup, lr)
        return ops.select(s >= self.total, s * 0.0 + self.min_lr, lr)


class WarmupConstantLR(LearningRateSchedule):
    def __init__(self, lr: float, warmup_steps: int):
        super().__init__()
        self.lr = float(lr)
        self.warmup = float(warmup_steps)

    def construct(self, step):
        s = ops.cast(step, mstype.float32).reshape(())
        if self.warmup > 0:
            return ops.select(s < self.warmup, self.lr * s / self.warmup, s * 0.0 + self.lr)
        return s * 0.0 + self.lr
