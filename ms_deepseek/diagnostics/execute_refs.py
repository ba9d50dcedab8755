"""What the executor runs for primitives that have no MindSpore CPU kernel.

Our custom operators compile into an Ascend program as ``Custom`` nodes of ``func_type`` aot whose
``func_name`` names the Ascend C kernel (``ms_deepseek/ops/ascend.py``: ``Fp32Softmax(x)`` and
``ExpertLookup(ids_km, placement, capacity, experts_per_rank)``); here they run on the CPU kernels built from
the same tiling (:mod:`ms_deepseek.ops.cpu`), whose parity with the references is tested in ``tests/unit/ops``.
``FlashAttentionScore`` and its gradient (Ascend only) run on a float32 composite of the same math
(:func:`flash_attention`), tested against an independent numpy attention.

Each reference is ``f(node, inputs) -> output`` with the node's attributes and its evaluated, non-monad inputs.
"""

from __future__ import annotations

import functools

import numpy as np

from ms_deepseek.core.errors import UserError


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


def _fa_probabilities(q: np.ndarray, k: np.ndarray, attrs: dict, mask) -> np.ndarray:
    """softmax(scale * q k^T) over the keys a query may see, float64: [B, N, S, S]."""
    scores = np.einsum("bnsd,bntd->bnst", q, k) * attrs["scale_value"]
    s, t = scores.shape[-2:]
    if attrs["sparse_mode"] in (2, 3):  # causal from the top left (2) or bottom right (3) corner
        shift = 0 if attrs["sparse_mode"] == 2 else t - s
        hidden = np.arange(t)[None, :] > np.arange(s)[:, None] + shift
    elif mask is not None:  # sparse_mode 0: the mask as given (1 = masked), broadcast to [B, N, S, T]
        hidden = np.broadcast_to(mask.asnumpy().astype(bool), scores.shape)
    else:
        hidden = np.zeros((s, t), bool)
    scores = np.where(hidden, -np.inf, scores)
    scores = scores - scores.max(axis=-1, keepdims=True)
    p = np.exp(scores)
    return p / p.sum(axis=-1, keepdims=True)


def flash_attention(node, args):
    """``FlashAttentionScore(q, k, v, pse, drop_mask, padding_mask, atten_mask, prefix, actual_seq_qlen,
    actual_seq_kvlen, head_num, keep_prob, scale_value, pre_tokens, next_tokens, inner_precise, input_layout,
    sparse_mode)`` -> (softmax_max, softmax_sum, softmax_out, attention_out): the attention in float64, its row
    max and row sum as Ascend returns them ([B, N, S, 8] float32, the value repeated); the model uses the output
    only, and the gradient below recomputes the probabilities."""
    from mindspore import Tensor

    q, k, v, mask = args[0], args[1], args[2], args[6]
    attrs = _fa_attrs(args)
    q64, k64, v64 = (t.asnumpy().astype(np.float64) for t in (q, k, v))
    p = _fa_probabilities(q64, k64, attrs, mask)
    out = np.einsum("bnst,bntd->bnsd", p, v64)
    stat = np.zeros(q.shape[:3] + (8,), np.float32)
    return (Tensor(stat), Tensor(stat), Tensor(np.zeros((0,), np.float32)), Tensor(out.astype(q.asnumpy().dtype)))


def flash_attention_grad(node, args):
    """``FlashAttentionScoreGrad(q, k, v, dy, pse, drop_mask, padding_mask, atten_mask, softmax_max, softmax_sum,
    softmax_in, attention_in, prefix, actual_seq_qlen, actual_seq_kvlen, <the forward's attributes>)`` ->
    (dq, dk, dv, dpse), float64: dv = P^T dy, dP = dy v^T, dS = P (dP - rowsum(dP P)), dq = scale dS k,
    dk = scale dS^T q."""
    from mindspore import Tensor

    q, k, v, dy, mask = args[0], args[1], args[2], args[3], args[7]
    attrs = _fa_attrs(args)
    q64, k64, v64, dy64 = (t.asnumpy().astype(np.float64) for t in (q, k, v, dy))
    p = _fa_probabilities(q64, k64, attrs, mask)
    dv = np.einsum("bnst,bnsd->bntd", p, dy64)
    dp = np.einsum("bnsd,bntd->bnst", dy64, v64)
    ds = p * (dp - (dp * p).sum(axis=-1, keepdims=True))
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
