"""CPU kernels behind the public operator Cells: ``ops.Custom(func_type="aot")`` on g++-built libraries.

Each Cell takes the library path from :func:`ms_deepseek.ops.build.build`. The
kernels walk the same tile schedule as the Ascend kernels; ``core_num`` and
``ub_bytes`` default to the Atlas 800T A2 (910B) values and only change the
schedule, never the result (the tests shrink them to force tail tiles).
"""

from __future__ import annotations

from pathlib import Path

import mindspore as ms
from mindspore import nn, ops
from mindspore.common import dtype as mstype

from ms_deepseek.ops import reference

DEFAULT_CORE_NUM = 48  # msds::kDefaultCoreNum
DEFAULT_UB_BYTES = 196352  # msds::kDefaultUbBytes


def custom_op(lib: Path, func: str, out_shape, out_dtype, bprop=None):
    """``ops.Custom`` over the AOT function ``func`` of the built library ``lib``."""
    return ops.Custom(f"{lib}:{func}", out_shape=out_shape, out_dtype=out_dtype, func_type="aot", bprop=bprop)


class ExpertLookupCpu(nn.Cell):
    """CPU kernel of :class:`ms_deepseek.ops.ExpertLookup` (per-group k-major streams [G, k*T] in, four outputs).

    ``strategy_tail``: the strategies of the op's inputs after the data inputs (the config
    tensor, replicated), which :func:`ms_deepseek.parallel_apply.apply.apply_plan` appends to the
    plan's strategy for this custom op.
    """

    kind = "cpu"
    strategy_tail = ((1,),)
    num_outputs = 4  # dest_rank, buffer_row, position, keep (parallel_plan.custom_shard's outputs_tensor_map)

    def __init__(
        self,
        lib: Path,
        num_experts: int,
        experts_per_rank: int,
        core_num: int = DEFAULT_CORE_NUM,
        ub_bytes: int = DEFAULT_UB_BYTES,
    ):
        super().__init__()
        reference.check_lookup_args(num_experts, experts_per_rank)
        self.lib = Path(lib)
        self.num_experts = num_experts
        self.experts_per_rank = experts_per_rank
        self.core_num = core_num
        self.ub_bytes = ub_bytes

        def bprop(ids, placement, cfg, out, dout):
            # Routing indices are not differentiable.
            return ops.zeros_like(ids), ops.zeros_like(placement), ops.zeros_like(cfg)

        self.op = custom_op(
            self.lib,
            "ExpertLookupCpu",
            out_shape=lambda ids, placement, cfg: (ids, ids, ids, ids),
            out_dtype=lambda ids, placement, cfg: (mstype.int32, mstype.int32, mstype.int32, mstype.float32),
            bprop=bprop,
        )

    def construct(self, topk_ids, placement, capacity):
        _, t, k = topk_ids.shape
        ids_km = reference.to_kmajor(topk_ids)  # [G, k*T]
        cfg = ms.Tensor([capacity, self.experts_per_rank, self.core_num, self.ub_bytes], mstype.int64)
        dest, row, pos, keep = self.op(ids_km, placement.astype(mstype.int32), cfg)
        return (
            reference.from_kmajor(dest, t, k),
            reference.from_kmajor(row, t, k),
            reference.from_kmajor(pos, t, k),
            reference.from_kmajor(keep, t, k),
        )


class FP32SoftmaxCpu(nn.Cell):
    """CPU kernel of :class:`ms_deepseek.ops.FP32Softmax` (forward and backward in double precision)."""

    kind = "cpu"
    strategy_tail = ((1,),)  # the config tensor
    num_outputs = 1

    def __init__(
        self, lib: Path, out_dtype=mstype.float32, core_num: int = DEFAULT_CORE_NUM, ub_bytes: int = DEFAULT_UB_BYTES
    ):
        super().__init__()
        reference.check_out_dtype(out_dtype)
        self.lib = Path(lib)
        self.out_dtype = out_dtype
        self.cfg = ms.Tensor([core_num, ub_bytes], mstype.int64)
        grad = custom_op(
            self.lib, "Fp32SoftmaxGradCpu", out_shape=lambda y, dy, cfg: y, out_dtype=lambda y, dy, cfg: mstype.float32
        )

        def bprop(x, cfg, out, dout):
            dx = grad(out, dout.astype(mstype.float32), cfg)  # dL/dx = y * (dy - sum(dy * y))
            return dx.astype(x.dtype), ops.zeros_like(cfg)

        self.op = custom_op(
            self.lib, "Fp32SoftmaxCpu", out_shape=lambda x, cfg: x, out_dtype=lambda x, cfg: mstype.float32, bprop=bprop
        )

    def construct(self, x):
        y = self.op(x, self.cfg)
        if self.out_dtype != mstype.float32:
            y = y.astype(self.out_dtype)
        return y


class RepetitionPenaltyCpu(nn.Cell):
    """CPU kernel of :class:`ms_deepseek.ops.RepetitionPenalty` (inputs validated by the caller)."""

    kind = "cpu"

    def __init__(self, lib: Path, core_num: int = DEFAULT_CORE_NUM, ub_bytes: int = DEFAULT_UB_BYTES):
        super().__init__()
        self.lib = Path(lib)
        self.cfg = ms.Tensor([core_num, ub_bytes], mstype.int64)
        self.op = custom_op(
            self.lib,
            "RepetitionPenaltyCpu",
            out_shape=lambda logits, ids, p, cfg: logits,
            out_dtype=lambda logits, ids, p, cfg: logits,
        )

    def construct(self, logits, token_ids, penalty):
        # penalty: python float (validated by the public Cell)
        return self.op(logits, token_ids.astype(mstype.int32), ms.Tensor([penalty], mstype.float32), self.cfg)


class GroupedMatmulCpu(nn.Cell):
    """CPU kernel of :class:`ms_deepseek.ops.GroupedMatmul` (float32; oneDNN's sgemm per expert block) with its
    gradient: dx = the grouped product with the untransposed weights, dw[e] = dy_e^T x_e."""

    kind = "cpu"

    def __init__(self, lib: Path):
        super().__init__()
        self.lib = Path(lib)
        rows_shape = lambda x, w, g: (x[0], w[1])  # noqa: E731 - y_e = x_e w_e^T: [M, out]
        f32 = lambda *args: mstype.float32  # noqa: E731
        input_grad = custom_op(self.lib, "GroupedMatmulNnCpu", out_shape=lambda dy, w, g: (dy[0], w[2]), out_dtype=f32)
        weight_grad = custom_op(
            self.lib, "GroupedMatmulWeightGradCpu", out_shape=lambda dy, x, g: (g[0], dy[1], x[1]), out_dtype=f32
        )

        def bprop(x, weight, group_list, out, dout):
            dout = dout.astype(mstype.float32)
            return input_grad(dout, weight, group_list), weight_grad(dout, x, group_list), ops.zeros_like(group_list)

        self.op = custom_op(self.lib, "GroupedMatmulNtCpu", out_shape=rows_shape, out_dtype=f32, bprop=bprop)

    def construct(self, x, weight, group_list):
        return self.op(x.astype(mstype.float32), weight.astype(mstype.float32), group_list.astype(mstype.int32))


class GroupedSwigluCpu(nn.Cell):
    """CPU kernel of :class:`ms_deepseek.ops.GroupedSwiglu`: the gather of the sorted rows, the three grouped
    matmuls, the SwiGLU and the routing weights' combine in one call (float32), and its gradient in one more (the
    gate and up products and the rows' outputs are kept; each token's k row gradients are summed in the kernel)."""

    kind = "cpu"

    def __init__(self, lib: Path):
        super().__init__()
        self.lib = Path(lib)
        grad = custom_op(
            self.lib,
            "GroupedSwigluGradCpu",
            out_shape=lambda dy, t, o, wg, wu, wd, gate, up, y, g, w: (t, wg, wu, wd, w),
            out_dtype=lambda *args: (mstype.float32,) * 5,
        )

        def bprop(tokens, order, wg, wu, wd, group_list, weight, out, dout):  # noqa: PLR0913 - the op's inputs, out, dout
            d = grad(
                dout[0].astype(mstype.float32), tokens, order, wg, wu, wd, out[1], out[2], out[3], group_list, weight
            )
            return d[0], ops.zeros_like(order), d[1], d[2], d[3], ops.zeros_like(group_list), d[4]

        self.op = custom_op(
            self.lib,
            "GroupedSwigluCpu",
            out_shape=lambda t, o, wg, wu, wd, g, w: (t, (o[0], wg[1]), (o[0], wg[1]), (o[0], t[1])),
            out_dtype=lambda *args: (mstype.float32,) * 4,
            bprop=bprop,
        )

    def construct(self, tokens, order, w_gate, w_up, w_down, group_list, weight):
        f32, i32 = mstype.float32, mstype.int32
        out = self.op(
            tokens.astype(f32),
            order.astype(i32),
            w_gate.astype(f32),
            w_up.astype(f32),
            w_down.astype(f32),
            group_list.astype(i32),
            weight.astype(f32),
        )
        return out[0]
