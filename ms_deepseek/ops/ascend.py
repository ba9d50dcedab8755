"""Ascend C kernels behind the public operator Cells (Atlas 800T A2 / 910B).

The kernels live in ``ops/<op>/op_host`` + ``ops/<op>/op_kernel`` and are built and
installed on a CANN host with ``ops/build_ascend.sh``, which prints the
``ASCEND_CUSTOM_OPP_PATH`` to export. MindSpore then finds each operator by its
type name through ``ops.Custom("<OpType>", ..., func_type="aot")``, generating the
registration from the installed op info; attributes follow the tensor inputs.

Not exercised on this CPU-only machine (no CANN): the tests for this module are
marked ``ascend``. If the package is not installed for the running SoC (MindSpore's rule,
:func:`installed_op_types`), :func:`make` raises and the backend switch falls back to the
reference with one warning, or stops with one line under ``MS_DEEPSEEK_OPS=kernel``.
"""

from __future__ import annotations

import json
import os
from typing import Optional, Set

from mindspore import nn, ops
from mindspore.common import dtype as mstype

from ms_deepseek.ops import reference

VENDOR = "ms_deepseek"
# The SoCs every OpDef registers (ops/*/op_host/*.cpp AddConfig) and ops/build_ascend.sh accepts.
SUPPORTED_SOCS = ("ascend910b", "ascend910_93")
OP_TYPES = {"expert_lookup": "ExpertLookup", "fp32_softmax": "Fp32Softmax", "repetition_penalty": "RepetitionPenalty"}


def soc_version() -> str:
    """The running SoC as MindSpore names it ('ascend910b' on Atlas 800T A2; '' off Ascend)."""
    from mindspore._c_expression import MSContext

    return MSContext.get_instance().get_ascend_soc_version()


def _vendor_roots():
    """Where MindSpore looks for a custom op, in its order: every ASCEND_CUSTOM_OPP_PATH entry, then
    the vendors that ASCEND_OPP_PATH/vendors/config.ini lists under load_priority (only those)."""
    roots = [p for p in os.environ.get("ASCEND_CUSTOM_OPP_PATH", "").split(":") if p]
    opp = os.environ.get("ASCEND_OPP_PATH")
    config = os.path.join(opp, "vendors", "config.ini") if opp else ""
    if config and os.path.isfile(config):
        with open(config, encoding="utf-8") as f:
            for line in f:
                key, _, value = line.strip().partition("=")
                if key.strip().lower() == "load_priority":
                    roots += [os.path.join(opp, "vendors", v.strip()) for v in value.split(",") if v.strip()]
                    break
    return roots


def installed_op_types(soc: Optional[str] = None) -> Set[str]:
    """Operator types MindSpore can register on ``soc`` (default: the running SoC).

    MindSpore's rule (``mindspore/ops/operations/_custom_ops_utils.py``,
    ``CustomInfoGenerator._get_op_json``): only
    ``<root>/op_impl/ai_core/tbe/config/<soc>/aic-<soc>-ops-info.json`` of the running SoC counts,
    for the roots of :func:`_vendor_roots`; a package built for another SoC is not seen. (MindSpore's dry
    run reports the SoC as '', and looks in ``config/`` for ``aic--ops-info.json``: the same rule.)
    """
    soc = soc_version() if soc is None else soc
    found: Set[str] = set()
    for root in _vendor_roots():
        path = os.path.join(root, "op_impl", "ai_core", "tbe", "config", soc, f"aic-{soc}-ops-info.json")
        try:
            with open(path, encoding="utf-8") as f:
                found.update(json.load(f).keys())
        except (OSError, ValueError):
            continue
    return found


def _require(op_name: str) -> str:
    op_type = OP_TYPES[op_name]
    soc = soc_version()
    if op_type not in installed_op_types(soc):
        if soc and soc not in SUPPORTED_SOCS:
            raise RuntimeError(
                f"Ascend custom operator {op_type} is not available for this SoC ({soc}): the "
                f"operators are built for {' and '.join(SUPPORTED_SOCS)} only"
            )
        raise RuntimeError(
            f"Ascend custom operator {op_type} is not installed for this SoC ({soc or 'unknown'}); run "
            f"ops/build_ascend.sh --soc {soc or '<soc>'} and export ASCEND_CUSTOM_OPP_PATH as it prints"
        )
    return op_type


class ExpertLookupAscend(nn.Cell):
    """:class:`ms_deepseek.ops.ExpertLookup` on the Ascend C kernel (k-major ids, outputs back to [G, T, k])."""

    kind = "ascend"
    strategy_tail = ()  # capacity and experts_per_rank are scalars (op attributes): no strategy
    num_outputs = 4  # dest_rank, buffer_row, position, keep (parallel_plan.custom_shard's outputs_tensor_map)

    def __init__(self, num_experts: int, experts_per_rank: int):
        super().__init__()
        reference.check_lookup_args(num_experts, experts_per_rank)
        self.experts_per_rank = experts_per_rank

        def bprop(ids, placement, capacity, experts_per_rank, out, dout):
            return ops.zeros_like(ids), ops.zeros_like(placement), 0, 0

        self.op = ops.Custom(
            _require("expert_lookup"),
            out_shape=lambda ids, *rest: (ids, ids, ids, ids),
            out_dtype=lambda *args: (mstype.int32, mstype.int32, mstype.int32, mstype.float32),
            func_type="aot",
            bprop=bprop,
        )

    def construct(self, topk_ids, placement, capacity):
        _, t, k = topk_ids.shape
        ids_km = reference.to_kmajor(topk_ids)  # [G, k*T]
        dest, row, pos, keep = self.op(ids_km, placement.astype(mstype.int32), capacity, self.experts_per_rank)
        return (
            reference.from_kmajor(dest, t, k),
            reference.from_kmajor(row, t, k),
            reference.from_kmajor(pos, t, k),
            reference.from_kmajor(keep, t, k),
        )


class FP32SoftmaxAscend(nn.Cell):
    """Forward on the Ascend C kernel; backward y * (dy - sum(dy * y)) in float32 with built-in ops."""

    kind = "ascend"
    strategy_tail = ()
    num_outputs = 1

    def __init__(self, out_dtype=mstype.float32):
        super().__init__()
        reference.check_out_dtype(out_dtype)
        self.out_dtype = out_dtype

        def bprop(x, out, dout):
            dy = dout.astype(mstype.float32)
            dx = out * (dy - (dy * out).sum(axis=-1, keepdims=True))
            return (dx.astype(x.dtype),)

        self.op = ops.Custom(
            _require("fp32_softmax"),
            out_shape=lambda x: x,
            out_dtype=lambda x: mstype.float32,
            func_type="aot",
            bprop=bprop,
        )

    def construct(self, x):
        y = self.op(x)
        if self.out_dtype != mstype.float32:
            y = y.astype(self.out_dtype)
        return y


class SoftmaxBuiltin(nn.Cell):
    """:class:`ms_deepseek.ops.FP32Softmax` for float32 input on Ascend: MindSpore's own Softmax
    (CANN's kernel) over the last axis, then ``out_dtype``. Needs no custom operator package.

    ``op`` is a plain primitive: the parallel plan's softmax rules shard it like the custom op
    (``ms_deepseek.parallel_plan.plan``), with an ordinary strategy (``activation_info.cc``)."""

    kind = "builtin"

    def __init__(self, out_dtype=mstype.float32):
        super().__init__()
        reference.check_out_dtype(out_dtype)
        self.out_dtype = out_dtype
        self.op = ops.Softmax(axis=-1)

    def construct(self, x):
        y = self.op(x.astype(mstype.float32))
        if self.out_dtype != mstype.float32:
            y = y.astype(self.out_dtype)
        return y


class RepetitionPenaltyAscend(nn.Cell):
    """:class:`ms_deepseek.ops.RepetitionPenalty` on the Ascend C kernel (the penalty is a float attribute)."""

    kind = "ascend"

    def __init__(self):
        super().__init__()
        self.op = ops.Custom(
            _require("repetition_penalty"),
            out_shape=lambda logits, *rest: logits,
            out_dtype=lambda logits, *rest: logits,
            func_type="aot",
        )

    def construct(self, logits, token_ids, penalty):
        # The kernel takes the penalty (a python float) as a float attribute.
        return self.op(logits, token_ids.astype(mstype.int32), penalty)


def make(op_name: str, **kwargs):
    cls = {
        "expert_lookup": ExpertLookupAscend,
        "fp32_softmax": FP32SoftmaxAscend,
        "repetition_penalty": RepetitionPenaltyAscend,
    }[op_name]
    return cls(**kwargs)


class GroupedMatmulBuiltin(nn.Cell):
    """:class:`ms_deepseek.ops.GroupedMatmul` on Ascend: MindSpore's own ``GroupedMatmulV4``
    (``mindspore.ops.auto_generate``), which runs CANN's ``aclnnGroupedMatmulV4``
    (``mindspore/ops/kernel/ascend/opapi/aclnn/grouped_matmul_v4_aclnn_kernel.h``; the older ``GroupedMatmul``
    primitive runs ``aclnnGroupedMatmulV3``, ``grouped_matmul_aclnn_kernel.h``, with cumulative group lists). Its constraints, from the
    primitive's docstring (``gen_ops_def.py`` ``grouped_matmul_v4``) and CANN's ``aclnnGroupedMatmulV4.md``:
    one tensor per list (``split_item=3``), grouping on the M axis (``group_type=0``), ``group_list`` int64 [E]
    of per-expert row counts (``group_list_type=1``; 0 would mean a cumulative sum), x [M, in] and weight
    [E, in, out] (our stacked [E, out, in] is transposed: V4 has no transpose flag), float16 / bfloat16 /
    float32 with no bias, scale or antiquant inputs; the counts must sum to at most M (the MoE passes exactly M).
    Its gradient is MindSpore's bprop ``REG_BPROP_BUILDER("GroupedMatmulV4")`` (``grad_math_ops.cc``,
    ``GmmV2Backward``: dx by a grouped matmul with the transposed weights, dw per group)."""

    kind = "builtin"

    def __init__(self):
        super().__init__()
        from mindspore.ops.auto_generate import GroupedMatmulV4

        self.op = GroupedMatmulV4()

    def construct(self, x, weight, group_list):
        out = self.op(
            [x],
            [weight.swapaxes(1, 2)],  # [E, out, in] -> [E, in, out]
            None,
            None,
            None,
            None,
            None,
            None,
            group_list.astype(mstype.int64),
            split_item=3,
            group_type=0,
            group_list_type=1,
        )
        return out[0]
