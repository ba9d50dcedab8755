"""Reference implementations of the custom operators in plain MindSpore ops.

These define the math the kernels must reproduce; they run on every backend,
in graph mode and PyNative, and are the fallback whenever a kernel is
unavailable (see :mod:`ms_deepseek.ops.backend`).
"""

from __future__ import annotations

import mindspore as ms
import numpy as np
from mindspore import nn, ops
from mindspore.common import dtype as mstype

from ms_deepseek.core.errors import UserError

_FLOAT_DTYPES = (mstype.float32, mstype.float16, mstype.bfloat16)


def to_kmajor(topk_ids):
    """[G, T, k] expert ids -> [G, k*T] int32, each group in k-major order (all first choices, then all
    second, ...)."""
    g, t, k = topk_ids.shape
    return topk_ids.astype(mstype.int32).transpose(0, 2, 1).reshape(g, k * t)  # [G, T, k] -> [G, k, T] -> [G, k*T]


def from_kmajor(values, t: int, k: int):
    """[G, k*T] k-major values -> [G, T, k], without gradient (the lookup's outputs are indices)."""
    g = values.shape[0]
    return ops.stop_gradient(values.reshape(g, k, t).transpose(0, 2, 1))  # [G, k*T] -> [G, k, T] -> [G, T, k]


def check_lookup_args(num_experts, experts_per_rank) -> None:
    for name, value in (("num_experts", num_experts), ("experts_per_rank", experts_per_rank)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise UserError(f"ExpertLookup: {name} must be a positive int, got {value!r}")
    if num_experts % experts_per_rank != 0:
        raise UserError(f"ExpertLookup: experts_per_rank={experts_per_rank} does not divide num_experts={num_experts}")


def check_capacity(capacity) -> None:
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
        raise UserError(f"ExpertLookup: capacity must be an int >= 0, got {capacity!r}")


def check_out_dtype(out_dtype) -> None:
    if out_dtype not in _FLOAT_DTYPES:
        raise UserError(f"FP32Softmax: out_dtype must be float32, float16 or bfloat16, got {out_dtype!r}")


def check_penalty(penalty_value) -> float:
    if isinstance(penalty_value, bool) or not isinstance(penalty_value, (int, float)):
        raise UserError(f"repetition penalty must be a number > 0, got {penalty_value!r}")
    if not penalty_value > 0:  # also rejects NaN
        raise UserError(f"repetition penalty must be > 0, got {penalty_value!r}")
    return float(penalty_value)


def check_penalty_inputs(logits, token_ids) -> None:
    """Shape / range checks for RepetitionPenalty (PyNative: reads the ids on the host)."""
    if logits.ndim != 2:
        raise UserError(f"repetition penalty: logits must be [batch, vocab], got shape {tuple(logits.shape)}")
    if logits.dtype != mstype.float32:
        raise UserError(f"repetition penalty: logits must be float32, got {logits.dtype}")
    if token_ids.dtype not in (mstype.int32, mstype.int64):
        raise UserError(f"repetition penalty: token_ids must be int32 (or int64), got {token_ids.dtype}")
    if token_ids.ndim != 2 or token_ids.shape[0] != logits.shape[0]:
        raise UserError(
            f"repetition penalty: token_ids must be [batch={logits.shape[0]}, length], "
            f"got shape {tuple(token_ids.shape)}"
        )
    if token_ids.shape[1] == 0:
        return
    ids = token_ids.asnumpy()
    vocab = logits.shape[1]
    bad = (ids < 0) | (ids >= vocab)
    if bad.any():
        b, j = (int(v) for v in np.argwhere(bad)[0])
        raise UserError(
            f"repetition penalty: token id {int(ids[b, j])} at [{b}, {j}] is outside the vocabulary [0, {vocab})"
        )


class ExpertLookupReference(nn.Cell):
    """Placement lookup + per-group capacity positions with one-hot cumsum (O(G*T*k*E) int32 memory).

    See :class:`ms_deepseek.ops.ExpertLookup` for the contract (``topk_ids`` [G, T, k]).
    """

    kind = "reference"

    def __init__(self, num_experts: int, experts_per_rank: int):
        super().__init__()
        check_lookup_args(num_experts, experts_per_rank)
        self.num_experts = num_experts
        self.experts_per_rank = experts_per_rank
        self.one = ms.Tensor(1, mstype.int32)
        self.zero = ms.Tensor(0, mstype.int32)

    def construct(self, topk_ids, placement, capacity):
        g, t, k = topk_ids.shape
        ids = topk_ids.astype(mstype.int32)
        # Ids outside [0, E) are not counted and get (-1, -1, -1, 0.0), like the kernels.
        valid = ops.logical_and(ids >= 0, ids < self.num_experts)  # [G, T, k]
        safe = ops.select(valid, ids, ops.zeros_like(ids))  # [G, T, k], in range
        invalid = ops.full_like(ids, -1)
        # Placement lookup: rows of the [E, 2] table gathered by expert id.
        rows = ops.gather(placement, safe.reshape(-1), 0)  # [G*T*k, 2]
        dest_rank = rows[:, 0].reshape(g, t, k)  # [G, T, k]
        local_slot = rows[:, 1].reshape(g, t, k)  # [G, T, k]
        buffer_row = ops.select(valid, dest_rank * self.experts_per_rank + local_slot, invalid)
        dest_rank = ops.select(valid, dest_rank, invalid)

        # Positions per group in k-major order: slot s = j*T + i for (token i, choice j).
        safe_km = to_kmajor(safe)  # [G, k*T]
        valid_km = to_kmajor(valid.astype(mstype.int32))  # [G, k*T] in {0, 1}
        onehot = ops.one_hot(safe_km, self.num_experts, self.one, self.zero) * valid_km.reshape(g, k * t, 1)
        running = ops.cumsum(onehot, 1)  # [G, k*T, E]: inclusive count per expert within the group
        pos_km = ops.gather_elements(running, 2, safe_km.reshape(g, k * t, 1)) - 1  # [G, k*T, 1]
        position = ops.select(valid, from_kmajor(pos_km.reshape(g, k * t), t, k), invalid)  # [G, T, k]
        keep = ops.logical_and(valid, position < capacity).astype(mstype.float32)
        return dest_rank, buffer_row, position, keep


class FP32SoftmaxReference(nn.Cell):
    """Max-subtracted softmax over the last axis in float32, cast to ``out_dtype``."""

    kind = "reference"

    def __init__(self, out_dtype=mstype.float32):
        super().__init__()
        check_out_dtype(out_dtype)
        self.out_dtype = out_dtype

    def construct(self, x):
        x32 = x.astype(mstype.float32)
        shifted = x32 - x32.max(axis=-1, keepdims=True)
        e = ops.exp(shifted)
        y = e / e.sum(axis=-1, keepdims=True)
        return y.astype(self.out_dtype)


class RepetitionPenaltyReference(nn.Cell):
    """HuggingFace repetition penalty: gather the seen logits, rescale, scatter back.

    ``penalty`` is a python float > 0. Ids outside [0, V) are ignored (like the kernels):
    they are sent to a spare column V that is cut off again, so they change nothing.
    """

    kind = "reference"

    def construct(self, logits, token_ids, penalty):
        b, length = token_ids.shape
        if length == 0:
            return logits
        vocab = logits.shape[1]
        ids = token_ids.astype(mstype.int32)
        valid = ops.logical_and(ids >= 0, ids < vocab)  # [B, L]
        ids = ops.select(valid, ids, ops.full_like(ids, vocab))  # [B, L], out-of-range -> spare column V
        padded = ops.concat([logits, ops.zeros((b, 1), logits.dtype)], axis=1)  # [B, V + 1]
        seen = ops.gather_elements(padded, 1, ids)  # [B, L]
        scaled = ops.where(seen < 0, seen * penalty, seen / penalty)  # [B, L], HF rule
        rows = ops.broadcast_to(ops.arange(b, dtype=mstype.int32).reshape(b, 1), (b, length))  # [B, L]
        index = ops.stack([rows, ids], axis=-1)  # [B, L, 2] = (row, token id)
        # Duplicated ids write the same value (gathered before any update), so order does not matter.
        return ops.tensor_scatter_update(padded, index, scaled)[:, :vocab]  # [B, V]


class GroupedMatmulReference(nn.Cell):
    """:class:`ms_deepseek.ops.GroupedMatmul` in plain MindSpore ops: every expert on every row, each row keeping
    its own expert's product (E times the FLOPs of the grouped kernel; the test oracle and the fallback).

    x [M, in], weight [E, out, in], group_list [E] int32 counts -> [M, out]; rows past sum(group_list) give 0."""

    kind = "reference"

    def construct(self, x, weight, group_list):
        m, e = x.shape[0], weight.shape[0]
        ends = ops.cumsum(group_list.astype(mstype.int32), 0)  # [E] exclusive ends of the experts' rows
        starts = ends - group_list.astype(mstype.int32)
        rows = ops.arange(0, m, dtype=mstype.int32).reshape(1, m)  # [1, M]
        mine = ops.logical_and(rows >= starts.reshape(e, 1), rows < ends.reshape(e, 1))  # [E, M]
        every = ops.matmul(x.reshape(1, m, -1), weight.swapaxes(1, 2))  # [1, M, in] @ [E, in, out] -> [E, M, out]
        return (every * ops.stop_gradient(mine.astype(x.dtype)).reshape(e, m, 1)).sum(0)  # [M, out]
