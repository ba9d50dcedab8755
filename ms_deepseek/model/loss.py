"""Next-token cross-entropy written so that the vocabulary axis can be split (vocabulary parallel).

``VocabParallelCrossEntropy()(logits [B, T, V] f32, labels [B, T] int) -> scalar``: the mean
next-token cross-entropy over labels != -100, labels aligned with ``input_ids`` (the
HuggingFace convention: position t predicts label t + 1).

Single-device math (no strategies here); every primitive is an attribute so the plan
(``ms_deepseek.parallel_plan.plan``, style ``vocab_cross_entropy``) can split logits [N, V] as
(dp, tp), the layout ``lm_head``'s vocabulary split produces. The pattern is MindFormers'
``CrossEntropyLoss`` (``mindformers/core/loss/loss.py``, ran on 910B), where every op over
the vocabulary axis is one MindSpore can split:

* ``row_max``: ReduceMax over V (partial maxima, all-reduced max) held constant;
* ``sub`` / ``exp`` / ``sum_exp``: the partial sums of exp(logit - max) all-reduced;
* the target logit, in one of two forms chosen by the plan (``split_vocab``):

  - vocabulary not split (``tp == 1`` or ``vocab_parallel: false``; the default, and every shipped recipe
    but one): ``GatherD(logits, 1, labels)`` [N, 1], the logit of the label and nothing else. The
    one-hot form builds a [N, V] float32 tensor per micro-step for this, which MindSpore's level-1
    accounting holds through the backward (``plan --compile --memory``, docs/planner.md);
  - vocabulary split over tp (``split_vocab = True``, set by the plan's ``vocab_cross_entropy`` style):
    ``OneHot(labels)`` [N, V/tp] (each device builds its own vocabulary slice of it) times the logits,
    summed over V (a partial sum all-reduced). ``GatherD`` cannot split its gather axis (MindSpore
    ``frontend/parallel/ops_info/gather_d_info.cc`` ``GatherDInfo::CheckStrategy``: "The dimension of dim
    can not be split"), so on a split vocabulary it would all-gather full-vocabulary fp32 logits.

The next-token shift moves the labels (one int column), not the logits: shifting the logits
(``logits[:, :-1]``) copies a full [N, V] fp32 tensor; here the last position's label is
-100 instead, which gives the same mean and the same gradient (zero on the last position).

Memory per device, with N = B * T local tokens and V/tp local vocabulary, besides the logits:
forward transients ``logits - max`` and its exp (the exp is kept for backward, as any
softmax cross-entropy keeps one [N, V/tp] fp32); on the split-vocabulary path also the one-hot
and its product with the logits (freed after the sum; the one-hot is marked recompute so backward
rebuilds it instead of keeping a second [N, V/tp] fp32 tensor alive, graph mode). The gather path
holds [N, 1] for the target; its backward scatters the [N, 1] gradient into a [N, V] zero tensor
(``GatherDGrad``), which is the logits' gradient anyway.
"""

from __future__ import annotations

import mindspore as ms
from mindspore import Tensor, nn, ops
from mindspore.ops import operations as P

IGNORE_INDEX = -100


class VocabParallelCrossEntropy(nn.Cell):
    def __init__(self, vocab_size: int):
        super().__init__()
        self.vocab_size = vocab_size
        self.row_max = P.ReduceMax(keep_dims=True)
        self.sub = P.Sub()
        self.exp = P.Exp()
        self.sum_exp = P.ReduceSum(keep_dims=False)
        self.log = P.Log()
        self.on_value = Tensor(1.0, ms.float32)
        self.off_value = Tensor(0.0, ms.float32)
        self.set_split_vocab(False)

    def set_split_vocab(self, split: bool) -> None:
        """The target logit's form: the one-hot slice (``True``: the plan's choice when the vocabulary is
        split over tp) or GatherD. The cell then holds only that form's primitives: the plan gives every
        primitive a cell holds a strategy (``sharding.lint``'s coverage rule)."""
        self.split_vocab = bool(split)
        for name in ("onehot", "mul", "pick", "gather_target"):
            self.__dict__.pop(name, None)
            getattr(self, "_primitives", {}).pop(name, None)
        if self.split_vocab:
            self.onehot = P.OneHot()
            self.onehot.recompute()  # rebuilt in backward: no second [N, V] fp32 tensor kept alive
            self.mul = P.Mul()
            self.pick = P.ReduceSum(keep_dims=False)
        else:
            self.gather_target = P.GatherD()

    def construct(self, logits, labels):
        B, T = labels.shape
        flat = logits.reshape(B * T, self.vocab_size)  # [B, T, V] -> [N, V], N = B * T
        # label of position t is the token at t + 1; the last position has none
        last = ops.full((B, 1), IGNORE_INDEX, dtype=ms.int32)
        shifted = ops.concat((labels[:, 1:].astype(ms.int32), last), 1).reshape(-1)  # [B, T] -> [N]
        valid = shifted != IGNORE_INDEX
        safe = ops.select(valid, shifted, ops.zeros_like(shifted))  # [N], ignored rows pick class 0
        if self.split_vocab:
            # constant targets: no backward pass computing a gradient for the one-hot
            target = ops.stop_gradient(self.onehot(safe, self.vocab_size, self.on_value, self.off_value))  # [N, V]
            picked = self.pick(self.mul(flat, target), -1)  # [N]: the target logit
        else:
            picked = self.gather_target(flat, 1, safe.reshape(-1, 1)).reshape(-1)  # [N, 1] -> [N]
        # The target logit first: nothing in the backward needs it, so without this order MindSpore runs it
        # last and the [N, V] float32 logits of every accumulation micro-step stay alive until the step's
        # end (level-1 accounting of v2-lite-lora-1npu: the flat logits' last user was the forward GatherD,
        # after all the backward). ``ops.depend``: ``flat`` is used only after ``picked`` is computed.
        flat = ops.depend(flat, picked)
        # log-sum-exp with the max held constant: the same value and gradient, no backward
        # through the max (whose gradient cancels)
        row_max = ops.stop_gradient(self.row_max(flat, -1))  # [N, 1]
        lse = self.log(self.sum_exp(self.exp(self.sub(flat, row_max)), -1)) + row_max.reshape(-1)  # [N]
        validf = valid.astype(ms.float32)
        return ((lse - picked) * validf).sum() / ops.maximum(validf.sum(), 1.0)
