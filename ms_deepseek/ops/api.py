"""Public operator Cells; each holds the implementation chosen by the backend switch."""

from __future__ import annotations

from mindspore import nn, ops
from mindspore.common import dtype as mstype

from ms_deepseek.core.errors import UserError
from ms_deepseek.ops import backend, reference


class ExpertLookup(nn.Cell):
    """Expert placement lookup and capacity positions for MoE dispatch.

    ``dest_rank, buffer_row, position, keep = lookup(topk_ids, placement, capacity)``

    * ``topk_ids`` [G, T, k] int32 expert ids of G token groups (one per data-parallel
      rank; [T, k] is one group); ``placement`` [E, 2] int32 (column 0: EP rank owning
      the expert, column 1: its local slot on that rank); ``capacity``: python int >= 0
      (static, per expert and group).
    * ``dest_rank`` [G, T, k] int32; ``buffer_row`` [G, T, k] int32 = rank * E_local + slot;
      ``position`` [G, T, k] int32: index of this (token, choice) in its expert's buffer
      of its group, assigned in k-major order within the group (all first choices in
      token order, then all second choices, ...), so a token's first choice is dropped
      last; ``keep`` [G, T, k] float32: 1.0 if ``position < capacity`` else 0.0.
    * Groups are independent: the op on group g alone ([1, T, k]) gives exactly row g of
      the op on all groups, which is what a device computes under the strategy
      ((dp, 1, 1), (1, 1)).
    * An id outside [0, E) is not counted and gets (-1, -1, -1, 0.0): no kernel reads or
      writes out of bounds (the same on the reference, CPU and Ascend kernels).

    Integer outputs carry no gradient. Works in graph mode and PyNative.
    """

    def __init__(self, num_experts: int, experts_per_rank: int):
        super().__init__()
        reference.check_lookup_args(num_experts, experts_per_rank)
        self.num_experts = num_experts
        self.experts_per_rank = experts_per_rank
        self.impl = backend.make("expert_lookup", num_experts=num_experts, experts_per_rank=experts_per_rank)

    def set_experts_per_rank(self, experts_per_rank: int) -> None:
        """Change E_local in place (the parallel plan's E / ep), keeping the op and its strategy."""
        reference.check_lookup_args(self.num_experts, experts_per_rank)
        self.experts_per_rank = experts_per_rank
        self.impl.experts_per_rank = experts_per_rank  # every impl reads it when it runs / compiles

    def __call__(self, topk_ids, placement, capacity):
        # PyNative entry: check the python arguments here (inside a compiled graph the
        # enclosing Cell inlines construct() and capacity is a compile-time constant).
        reference.check_capacity(capacity)
        if placement.shape != (self.num_experts, 2):
            raise UserError(
                f"ExpertLookup: placement must have shape ({self.num_experts}, 2), got {tuple(placement.shape)}"
            )
        if topk_ids.ndim not in (2, 3):
            raise UserError(
                f"ExpertLookup: topk_ids must be [groups, tokens, k] (or [tokens, k]), "
                f"got shape {tuple(topk_ids.shape)}"
            )
        return super().__call__(topk_ids, placement, capacity)

    def construct(self, topk_ids, placement, capacity):
        if topk_ids.ndim == 2:  # one group: [T, k] -> [1, T, k] and back
            t, k = topk_ids.shape
            outs = self.impl(topk_ids.reshape(1, t, k), placement, capacity)
            return tuple(o.reshape(t, k) for o in outs)
        return self.impl(topk_ids, placement, capacity)


class FP32Softmax(nn.Cell):
    """Softmax over the last axis computed in float32 (max-subtracted), cast to ``out_dtype``.

    Accepts float32 / float16 / bfloat16 input; differentiable.

    ``float32_input=True`` (the caller only ever passes float32: the router's logits, the attention
    scores, see ``ms_deepseek.model.mla.MLAttention.__init__`` for the evidence): on
    Ascend the op is CANN's own Softmax (``ops.Softmax``, ``impl.kind == "builtin"``), since the
    kernel's only gain there, computing 16-bit inputs in float32, does not apply; on CPU the
    kernel stays, measurably more accurate than MindSpore's CPU Softmax
    (``tests/unit/ops/test_ops_kernels.py``, ``test_softmax_cpu_more_accurate_than_mindspore_builtin``).
    """

    def __init__(self, out_dtype=mstype.float32, float32_input: bool = False):
        super().__init__()
        reference.check_out_dtype(out_dtype)
        self.out_dtype = out_dtype
        if float32_input and backend.choose("fp32_softmax") == "ascend":
            from ms_deepseek.ops.ascend import SoftmaxBuiltin

            self.impl = SoftmaxBuiltin(out_dtype=out_dtype)
        else:
            self.impl = backend.make("fp32_softmax", out_dtype=out_dtype)

    def construct(self, x):
        return self.impl(x)


class RepetitionPenalty(nn.Cell):
    """HuggingFace repetition penalty on [B, V] float32 logits (PyNative, used by generation).

    Every id present in ``token_ids[b]`` ([B, L] int32, L may be 0, duplicates allowed)
    has ``logits[b, id]`` divided by ``penalty_value`` if positive, multiplied if not.
    ``penalty_value <= 0`` or ids outside [0, V) raise :class:`~ms_deepseek.core.errors.UserError`
    when called from Python (PyNative: the ids are read on the host). Inside a compiled graph,
    where no host check runs, ids outside [0, V) are ignored (no logit changes for them) by the
    reference, the CPU and the Ascend kernels alike. Never part of a sharded training graph, so it
    carries no parallel attributes (:mod:`ms_deepseek.parallel_plan.custom_shard`).
    """

    def __init__(self):
        super().__init__()
        self.impl = backend.make("repetition_penalty")

    def __call__(self, logits, token_ids, penalty_value):
        # Host-side validation (reads the ids), then the operator itself.
        penalty = reference.check_penalty(penalty_value)
        reference.check_penalty_inputs(logits, token_ids)
        if token_ids.shape[1] == 0:
            return logits
        return self.impl(logits, token_ids, penalty)

    def construct(self, logits, token_ids, penalty_value):  # pragma: no cover - __call__ is the entry
        return self.impl(logits, token_ids, penalty_value)


class GroupedMatmul(nn.Cell):
    """Grouped matmul over rows sorted by expert: ``y = gmm(x, weight, group_list)``.

    * ``x`` [M, in]; ``weight`` [E, out, in] (the stacked expert layout); ``group_list`` [E] integer row counts
      per expert (not cumulative), summing to at most M; rows of expert e are ``x[sum(group_list[:e]) :
      sum(group_list[:e+1])]`` and give ``y = x_e @ weight[e]^T``; rows past the sum give 0 (CPU and reference).
    * Differentiable in x and weight (dx by the grouped product with the untransposed weights,
      dw[e] = dy_e^T x_e); shapes are static, so it compiles in graph mode.

    Implementations (``impl.kind``): on Ascend MindSpore's own ``GroupedMatmulV4`` (``"builtin"``, see
    :class:`ms_deepseek.ops.ascend.GroupedMatmulBuiltin`); on CPU the C++ kernel ``ops/grouped_matmul``
    (``"cpu"``, float32, oneDNN's sgemm per expert block); ``MS_DEEPSEEK_OPS=reference`` or a kernel that does
    not build: every expert on every row, masked (``"reference"``, E times the FLOPs).
    """

    def __init__(self):
        super().__init__()
        self.impl = _grouped_matmul_impl()

    def construct(self, x, weight, group_list):
        return self.impl(x, weight, group_list)


def _grouped_matmul_impl():
    if backend.forced_reference():
        return reference.GroupedMatmulReference()
    target = backend.device_target()
    if target == "Ascend":
        from ms_deepseek.ops.ascend import GroupedMatmulBuiltin

        return GroupedMatmulBuiltin()
    if target == "CPU":
        from ms_deepseek.ops import build, cpu

        try:
            return cpu.GroupedMatmulCpu(build.build("grouped_matmul"))
        except build.KernelBuildError as exc:
            first_line = str(exc).strip().splitlines()[0]
            backend.warn_once("grouped_matmul", f"cpu kernel unavailable ({first_line}); using the reference")
    return reference.GroupedMatmulReference()


class GroupedSwiglu(nn.Cell):
    """Every expert's SwiGLU MLP on the routed copies of the tokens, combined with the routing weights: ``out =
    swiglu(tokens, order, w_gate, w_up, w_down, group_list, weight)``.

    ``tokens`` [N, H]; ``order`` [S] int32, S = N * k: the slot ``s = token * k + choice`` at each position of the
    rows sorted by expert (a permutation), so row p is ``tokens[order[p] // k]``; ``w_gate`` / ``w_up`` [E, I, H],
    ``w_down`` [E, H, I] (the stacked layouts); ``group_list`` [E] row counts; ``weight`` [N, k] the routing
    weights -> ``out`` [N, H] float32, ``out[n] = sum_j weight[n, j] * y[n * k + j]`` with ``y[s]`` the SwiGLU of
    slot s's expert on its token. Differentiable in tokens, the expert weights and ``weight``.
    On CPU one C++ call for the forward and one for the gradient (``impl.kind == "cpu"``); elsewhere, or when that
    kernel does not build, gathers, three :class:`GroupedMatmul` calls, MindSpore's SiLU and the weighted sum
    (``"composed"``)."""

    def __init__(self):
        super().__init__()
        self.impl = _grouped_swiglu_impl()

    def construct(self, tokens, order, w_gate, w_up, w_down, group_list, weight):
        return self.impl(tokens, order, w_gate, w_up, w_down, group_list, weight)


class GroupedSwigluComposed(nn.Cell):
    """:class:`GroupedSwiglu` as a gather of the sorted rows, three grouped matmuls and SiLU, the gather back
    to slot order and the weighted sum over each token's k slots (Ascend, and the CPU fallback)."""

    kind = "composed"

    def __init__(self):
        super().__init__()
        self.gmm = GroupedMatmul()
        self.inverse_sort = ops.Sort()

    def construct(self, tokens, order, w_gate, w_up, w_down, group_list, weight):
        n, k = tokens.shape[0], order.shape[0] // tokens.shape[0]
        x = ops.gather(tokens, ops.floor_div(order, k), 0)  # [S, H] sorted by expert
        gate = self.gmm(x, w_gate, group_list)
        up = self.gmm(x, w_up, group_list)
        y = self.gmm((ops.silu(gate) * up).astype(x.dtype), w_down, group_list)  # [S, H] sorted
        inverse = ops.stop_gradient(self.inverse_sort(order)[1])  # the sorted position of each slot
        back = ops.gather(y, inverse, 0).reshape(n, k, -1)  # [N, k, H] in slot order
        return (back.astype(mstype.float32) * weight.astype(mstype.float32).reshape(n, k, 1)).sum(1)  # [N, H]


def _grouped_swiglu_impl():
    if not backend.forced_reference() and backend.device_target() == "CPU":
        from ms_deepseek.ops import build, cpu

        try:
            return cpu.GroupedSwigluCpu(build.build("grouped_matmul"))
        except build.KernelBuildError as exc:
            first_line = str(exc).strip().splitlines()[0]
            backend.warn_once("grouped_matmul", f"cpu kernel unavailable ({first_line}); using the reference")
    return GroupedSwigluComposed()
