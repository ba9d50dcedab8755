"""What the executor runs for primitives that have no MindSpore CPU kernel.

Our custom operators compile into an Ascend program as ``Custom`` nodes of ``func_type`` aot whose
``func_name`` names the Ascend C kernel (``ms_deepseek/ops/ascend.py``: ``Fp32Softmax(x)`` and
``ExpertLookup(ids_km, placement, capacity, experts_per_rank)``); here they run on the CPU kernels built from
the same tiling (:mod:`ms_deepseek.ops.cpu`), whose parity with the references is tested in ``tests/unit/ops``.
``FlashAttentionScore`` and its gradient (Ascend only) run on a float64 composite of the same math
(:func:`flash_attention`, :func:`flash_attention_grad`): the forward returns the softmax statistics in Ascend's
form, the gradient computes from the statistics and forward output it is given, as the Ascend kernel does, and
refuses ones that do not belong to its q, k, v.

Each reference is ``f(node, inputs) -> output`` with the node's attributes and its evaluated, non-monad inputs.
"""

from __future__ import annotations

import functools
from typing import Tuple

import numpy as np

from ms_deepseek.core.errors import UserError
from ms_deepseek.verification.execute.execution_error import ExecutionError


@functools.lru_cache(maxsize=None)
def _cpu_op(name: str):
    from mindspore.common import dtype as mstype

    from ms_deepseek.ops import build, cpu

    if name == "Fp32Softmax":
        return cpu.custom_op(
            build.build("fp32_softmax"),
            "Fp32SoftmaxCpu",
            out_shape=lambda x, cfg: x,
            out_dtype=lambda x, cfg: mstype.float32,
        )
    if name == "ExpertLookup":
        return cpu.custom_op(
            build.build("expert_lookup"),
            "ExpertLookupCpu",
            out_shape=lambda ids, placement, cfg: (ids, ids, ids, ids),
            out_dtype=lambda ids, placement, cfg: (mstype.int32, mstype.int32, mstype.int32, mstype.float32),
        )
    raise UserError(f"Custom operator {name!r}: the executor has no CPU kernel for it")


def custom(node, args):
    """Our Ascend C ops on their CPU kernels (the schedule's core count and UB size change no result)."""
    from mindspore import Tensor
    from mindspore.common import dtype as mstype

    from ms_deepseek.ops.cpu import DEFAULT_CORE_NUM, DEFAULT_UB_BYTES

    name = node.attrs.get("func_name") or node.attrs.get("reg_op_name")
    if name == "Fp32Softmax":
        cfg = Tensor([DEFAULT_CORE_NUM, DEFAULT_UB_BYTES], mstype.int64)
        return _cpu_op(name)(args[0], cfg)
    if name == "ExpertLookup":
        ids, placement, capacity, per_rank = args
        cfg = Tensor([int(_scalar(capacity)), int(_scalar(per_rank)), DEFAULT_CORE_NUM, DEFAULT_UB_BYTES], mstype.int64)
        return tuple(_cpu_op(name)(ids, placement.astype(mstype.int32), cfg))
    raise UserError(f"Custom operator {name!r}: the executor has no CPU kernel for it")


def _scalar(x):
    from mindspore import Tensor

    return x.asnumpy().item() if isinstance(x, Tensor) else x


def batch_matmul(node, args):
    """``BatchMatMul(x, y, transpose_a, transpose_b)`` with the batch axes broadcast first: Ascend's kernel
    broadcasts [b1, b2, m, k] against [b2, k, n] (the expert buffer against the stacked expert weights), MindSpore's
    CPU kernel refuses operands of different ranks (``batch_mat_mul.cc`` CheckBatchMatmulInputWhetherCanBeBroadcast)."""
    from mindspore import ops

    x, y, transpose_a, transpose_b = args
    batch = np.broadcast_shapes(tuple(x.shape[:-2]), tuple(y.shape[:-2]))
    x = ops.broadcast_to(x, batch + tuple(x.shape[-2:]))
    y = ops.broadcast_to(y, batch + tuple(y.shape[-2:]))
    return ops.BatchMatMul(bool(_scalar(transpose_a)), bool(_scalar(transpose_b)))(x, y)


def softmax_backward(node, args):
    """``SoftmaxBackward(dout, out, dim)`` (Softmax's gradient; no CPU kernel): ``y * (dy - sum(dy * y, dim))``,
    in float32 as the Ascend kernel computes it."""
    from mindspore.common import dtype as mstype

    dout, out, dim = args[0], args[1], int(_scalar(args[2]))
    dy, y = dout.astype(mstype.float32), out.astype(mstype.float32)
    return (y * (dy - (dy * y).sum(axis=dim, keepdims=True))).astype(dout.dtype)


# FlashAttentionScore's trailing (former __init__) inputs, in order (gen_ops_prim.FlashAttentionScore)
_FA_ATTRS = (
    "head_num",
    "keep_prob",
    "scale_value",
    "pre_tokens",
    "next_tokens",
    "inner_precise",
    "input_layout",
    "sparse_mode",
)
_BNSD = 1  # input_layout enum (mindspore.ops._utils.arg_handler.str_to_enum: BSH 0, BNSD 1, SBH 2, BSND 3, TND 4)


def _fa_attrs(args) -> dict:
    attrs = dict(zip(_FA_ATTRS, (_scalar(a) for a in args[-len(_FA_ATTRS) :])))
    if attrs["input_layout"] != _BNSD or attrs["keep_prob"] != 1.0:
        raise UserError(
            "FlashAttentionScore: the executor's reference covers the model's use only (input_layout BNSD, "
            f"keep_prob 1), got {attrs}"
        )
    if attrs["sparse_mode"] not in (0, 2, 3):
        raise UserError(f"FlashAttentionScore: sparse_mode {attrs['sparse_mode']} is not covered by the reference")
    return attrs


def _fa_scores(q: np.ndarray, k: np.ndarray, attrs: dict, mask) -> Tuple[np.ndarray, np.ndarray]:
    """scale * q k^T, float64 [B, N, S, T], and which keys each query may not see (True = hidden)."""
    scores = np.einsum("bnsd,bntd->bnst", q, k) * attrs["scale_value"]
    s, t = scores.shape[-2:]
    if attrs["sparse_mode"] in (2, 3):  # causal from the top left (2) or bottom right (3) corner
        shift = 0 if attrs["sparse_mode"] == 2 else t - s
        hidden = np.arange(t)[None, :] > np.arange(s)[:, None] + shift
    elif mask is not None:  # sparse_mode 0: the mask as given (1 = masked), broadcast to [B, N, S, T]
        hidden = mask.asnumpy().astype(bool)
    else:
        hidden = np.zeros((s, t), bool)
    return scores, np.broadcast_to(hidden, scores.shape)


def _fa_statistics(scores: np.ndarray, hidden: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """Each query's row max over the keys it sees and the row sum of exp(score - max), [B, N, S, 1] (a row that
    sees no key: max -inf, sum 0)."""
    row_max = np.where(hidden, -np.inf, scores).max(axis=-1, keepdims=True)
    shifted = np.where(hidden, -np.inf, scores - np.where(np.isfinite(row_max), row_max, 0.0))
    return row_max, np.exp(shifted).sum(axis=-1, keepdims=True)


def _fa_probabilities(scores, hidden, row_max, row_sum) -> np.ndarray:
    """P = exp(score - max) / sum over the visible keys, 0 where hidden (or where a row sees nothing)."""
    safe_max = np.where(np.isfinite(row_max), row_max, 0.0)
    safe_sum = np.where(row_sum > 0, row_sum, 1.0)
    return np.where(hidden, 0.0, np.exp(np.where(hidden, 0.0, scores - safe_max)) / safe_sum)


# FlashAttentionScore's softmax_max / softmax_sum: [B, N, S, 8] float32 (gen_ops_prim.FlashAttentionScore, Outputs;
# CANN FlashAttentionScoreGrad: "softmaxMax / softmaxSum: [B, N, S, 8]"): one 32-byte block of float32 per row, the
# row's value repeated (Ascend C SoftmaxFlash: the max and sum tensors' last axis is fixed at 32 bytes)
_STAT_REPEAT = 8


def _as_stat(x: np.ndarray) -> np.ndarray:
    return np.repeat(x, _STAT_REPEAT, axis=-1).astype(np.float32)


def flash_attention(node, args):
    """``FlashAttentionScore(q, k, v, pse, drop_mask, padding_mask, atten_mask, prefix, actual_seq_qlen,
    actual_seq_kvlen, head_num, keep_prob, scale_value, pre_tokens, next_tokens, inner_precise, input_layout,
    sparse_mode)`` -> (softmax_max, softmax_sum, softmax_out, attention_out): the attention in float64, with the
    row max of the scaled scores and the row sum of exp(scores - max) as Ascend returns them ([B, N, S, 8] float32),
    which the gradient reads."""
    from mindspore import Tensor

    q, k, v, mask = args[0], args[1], args[2], args[6]
    attrs = _fa_attrs(args)
    q64, k64, v64 = (t.asnumpy().astype(np.float64) for t in (q, k, v))
    scores, hidden = _fa_scores(q64, k64, attrs, mask)
    row_max, row_sum = _fa_statistics(scores, hidden)
    out = np.einsum("bnst,bntd->bnsd", _fa_probabilities(scores, hidden, row_max, row_sum), v64)
    return (
        Tensor(_as_stat(row_max)),
        Tensor(_as_stat(row_sum)),
        Tensor(np.zeros((0,), np.float32)),
        Tensor(out.astype(q.asnumpy().dtype)),
    )


# a unit of rounding per dtype (numpy's finfo does not know bfloat16); a given input may differ from the
# recomputation by the rounding of its own dtype at its largest value, a few units of it
_EPS = {"float64": 2.0**-52, "float32": 2.0**-23, "float16": 2.0**-10, "bfloat16": 2.0**-7}
_ROUNDING_UNITS = 8


def _check_given(node, name: str, given: np.ndarray, own: np.ndarray, dtype) -> None:
    """A given forward quantity against the recomputation from the call's own q, k, v: beyond a few units of its
    dtype's rounding at the quantity's largest value it belongs to another call (another micro-batch, layer or
    step), and a gradient computed from it would be wrong while looking plausible."""
    finite = np.isfinite(own)
    scale = float(np.max(np.abs(own[finite]))) if finite.any() else 0.0
    tolerance = _ROUNDING_UNITS * _EPS[str(np.dtype(dtype))] * scale
    same_inf = np.array_equal(np.isfinite(given), finite)
    with np.errstate(invalid="ignore"):  # -inf - -inf in a row that sees no key, masked out
        diff = float(np.max(np.abs(np.where(finite, given - own, 0.0)))) if finite.any() else 0.0
    if not same_inf or not diff <= tolerance:
        raise ExecutionError(
            f"FlashAttentionScoreGrad at {node.scope or node.output}: its input {name} disagrees with the forward "
            f"recomputed from its q, k, v (largest difference {diff:.3g}, tolerance {tolerance:.3g}): the "
            "statistics of another forward call"
        )


def flash_attention_grad(node, args):
    """``FlashAttentionScoreGrad(q, k, v, dy, pse, drop_mask, padding_mask, atten_mask, softmax_max, softmax_sum,
    softmax_in, attention_in, prefix, actual_seq_qlen, actual_seq_kvlen, <the forward's attributes>)`` ->
    (dq, dk, dv, dpse), float64, from the given forward statistics as the Ascend kernel computes it (CANN
    ``FlashAttentionScoreGrad``: P recomputed from q, k and softmax_max / softmax_sum, D = rowsum(dy *
    attention_in), dS = P (dP - D)): P = exp(scale q k^T - max) / sum over the visible keys, dv = P^T dy,
    dP = dy v^T, dq = scale dS k, dk = scale dS^T q. The given softmax_max, softmax_sum and attention_in are
    checked against the forward recomputed from q, k, v first (:func:`_check_given`)."""
    from mindspore import Tensor

    q, k, v, dy, mask = args[0], args[1], args[2], args[3], args[7]
    given_max, given_sum, attention_in = args[8], args[9], args[11]
    for name, given in (("softmax_max", given_max), ("softmax_sum", given_sum), ("attention_in", attention_in)):
        if not isinstance(given, Tensor):
            raise ExecutionError(f"FlashAttentionScoreGrad at {node.scope or node.output}: no {name} input")
    attrs = _fa_attrs(args)
    q64, k64, v64, dy64 = (t.asnumpy().astype(np.float64) for t in (q, k, v, dy))
    scores, hidden = _fa_scores(q64, k64, attrs, mask)
    own_max, own_sum = _fa_statistics(scores, hidden)
    own_out = np.einsum("bnst,bntd->bnsd", _fa_probabilities(scores, hidden, own_max, own_sum), v64)
    stat_max, stat_sum = given_max.asnumpy().astype(np.float64), given_sum.asnumpy().astype(np.float64)
    out = attention_in.asnumpy()
    _check_given(node, "softmax_max", stat_max, np.broadcast_to(own_max, stat_max.shape), np.float32)
    _check_given(node, "softmax_sum", stat_sum, np.broadcast_to(own_sum, stat_sum.shape), np.float32)
    _check_given(node, "attention_in", out.astype(np.float64), own_out, out.dtype)
    p = _fa_probabilities(scores, hidden, stat_max[..., :1], stat_sum[..., :1])
    dv = np.einsum("bnst,bnsd->bntd", p, dy64)
    dp = np.einsum("bnsd,bntd->bnst", dy64, v64)
    ds = p * (dp - (dy64 * out.astype(np.float64)).sum(axis=-1, keepdims=True))
    dq = np.einsum("bnst,bntd->bnsd", ds, k64) * attrs["scale_value"]
    dk = np.einsum("bnst,bnsd->bntd", ds, q64) * attrs["scale_value"]
    dtype = q.asnumpy().dtype
    return (Tensor(dq.astype(dtype)), Tensor(dk.astype(dtype)), Tensor(dv.astype(dtype)), Tensor(np.zeros((0,), dtype)))


REFERENCES = {
    "FlashAttentionScore": flash_attention,
    "FlashAttentionScoreGrad": flash_attention_grad,
    "SoftmaxBackward": softmax_backward,
    "Custom": custom,
    "BatchMatMul": batch_matmul,
}
