"""DeepSeekMoE layer: router, per-group capacity dispatch, stacked routed experts, shared experts.

Expert parallelism follows MindFormers' MoE v1 / ``MoEV2`` pattern (``mindformers/modules/
transformer/moe.py``: ``TopkRouterV2`` + ``MoEV2``, used by ``research/deepseek2``, which ran
on 910B under SEMI_AUTO_PARALLEL): tokens stay on their data-parallel rank, every index is
computed per rank on local tokens, and the only traffic is the dp -> ep exchange of the
capacity buffer, a transpose whose layout changes from dp-split to ep-split, which MindSpore
lowers to an AllToAll under ``enable_alltoall``. We chose it over the newer MindFormers
``Morph(...)`` + explicit AlltoAllV + GroupedMatmul design because it keeps static shapes
(graph mode, CPU and Ascend run the same math), needs no Ascend-only kernels and keeps the
model single-device math with the split left to the plan (``parallel_plan/plan.py``).

Shapes (G = ``groups``, the plan's dp, 1 unless :func:`ms_deepseek.parallel_apply.apply.apply_plan`
sets it; N = B*T/G local tokens; batch rows are rank-major because the batch axis is split
by dp; C = :func:`ms_deepseek.config.dispatch_shapes.capacity` per group):

1. router on the local tokens ``[G*N, H]`` -> ``topk_idx`` ``[G, N, k]`` and weights;
2. ``ExpertLookup`` per group: buffer row (placement table ``expert_placement`` [E, 2] =
   EP rank, local slot) and the position in that expert's buffer of its group, k-major so
   a token's first choice is dropped last; ``keep`` marks positions < C;
3. ``dispatch_index`` ``[G, E, C]`` (which local token fills each slot, N = zero row) from a
   per-group sort of float32 keys ``[G, E, k*N]`` (``TopkRouterV2``'s sort indexing), then
   the dispatch is a LOCAL Gather with batch dims: ``[G, N+1, H]`` -> ``[G, E, C, H]``;
4. dp -> ep exchange (MindFormers ``MoEV2._ffn_forward``): ``[G, E, C, H]`` viewed
   ``[G/ep, ep, E, C, H]`` (group g = u*ep + e, ep the inner factor:
   :func:`ms_deepseek.parallel_plan.ranks.exchange_view`), transposed (0, 2, 1, 3, 4) to
   ``[G/ep, E, ep, C, H]`` and read as the 4-D expert input ``[G/ep, E, ep*C, H]``. The
   transpose's input is split (G/ep, 1, ep, 1, 1) while the view arrives (G/ep, ep, 1, 1, 1):
   that layout change is one AllToAll inside each ep group of consecutive data-parallel
   ranks {u*ep + e : e} (inside one node on Ascend: HCCS, not RoCE);
5. experts: batched matmuls of the 4-D input on stacked weights [E, out, in] (E split by ep,
   I by tp; the expert matmuls split ((G/ep, ep, 1, 1), (ep, tp, 1)), MindFormers
   ``llama_layer.py`` ``_shard_semi_auto_parallel``, so the device matrix is (G/ep, ep, ..., tp));
6. the same exchange back (``from_experts``, AllToAll at its input) -> ``[G, E*C, H]`` split by dp, and a LOCAL
   combine Gather with batch dims at ``row*C + position`` (dropped choices read slot 0 with
   weight 0) -> ``[G, N, k, H]``, mixed with the routing weights.

No Concat over a split axis (the zero row is appended on the unsplit token axis), no
replicated [E*C, H] table. With G = 1 (single device, evaluation) this is exactly the
unsharded math; without a capacity factor, or in evaluation, C = N (dropless).

Primitives (for the parallel plan): ``experts.gate_bmm``, ``experts.up_bmm``,
``experts.down_bmm``, ``pad_tokens``, ``slot_sort``, ``dispatch_gather``, ``to_experts``,
``from_experts``, ``combine_gather``, and the lookup's custom op ``lookup.impl.op``.
"""

from __future__ import annotations

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops
from mindspore.common.initializer import Normal, initializer
from mindspore.ops.auto_generate import SiLU

from ms_deepseek.config import dispatch_shapes
from ms_deepseek.config.model import DeepseekV2Config
from ms_deepseek.core.errors import UserError
from ms_deepseek.model.layers import MLP, to_ms_dtype
from ms_deepseek.model.router import Router
from ms_deepseek.ops import ExpertLookup, GroupedMatmul, GroupedSwiglu
from ms_deepseek.ops.backend import device_target
from ms_deepseek.parallel_plan.ranks import exchange_view


def default_placement(num_experts: int, ep: int) -> np.ndarray:
    """Contiguous blocks: expert e -> (rank e // E_local, slot e % E_local). [E, 2] int32."""
    per_rank = num_experts // ep
    experts = np.arange(num_experts, dtype=np.int32)
    return np.stack([experts // per_rank, experts % per_rank], axis=1).astype(np.int32)


class StackedWeight(nn.Cell):
    """Holds one stacked expert projection ``weight`` [E, out, in] (a Cell so the name ends in ``.weight``)."""

    def __init__(self, shape, std: float, dtype):
        super().__init__()
        self.weight = Parameter(initializer(Normal(std), shape, dtype), name="weight")
        self._init_adapter_slots()

    def _init_adapter_slots(self) -> None:
        """The optional stacked LoRA adapter (ms_deepseek.model.lora.add_adapters): A [E, r, in], B [E, out, r],
        and base + scaling * adapter on [D, E, C, out] as named ops the plan gives the experts' split."""
        self.lora_A = None
        self.lora_B = None
        self.lora_scaling = 0.0
        self.lora_dropout = None
        self.lora_scale = ops.Mul()
        self.lora_add = ops.Add()

    def project(self, x, bmm, lora_a_bmm, lora_b_bmm, cdt, broadcast: bool):
        """x [D, E, C, in] -> [D, E, C, out] through the stacked weight (+ its adapter, same batched matmuls)."""
        return stacked_project(self, self.weight.astype(cdt), x, bmm, lora_a_bmm, lora_b_bmm, cdt, broadcast)

    def rows(self, idx, cdt):
        """The weights of the experts ``idx`` [n] -> [n, out, in] (a decode step reads only its chosen experts)."""
        return ops.gather(self.weight, idx, 0).astype(cdt)

    def dense(self, cdt):
        """The stacked weight [E, out, in] in the compute dtype."""
        return self.weight.astype(cdt)

    def grouped(self, x, group_list, gmm, cdt):
        """x [M, in] sorted by expert -> [M, out] through the stacked weight (+ its adapter) by the grouped matmul."""
        return grouped_project(self, self.weight.astype(cdt), x, group_list, gmm, cdt)


def grouped_project(holder, weight, x, group_list, gmm, cdt):
    """The dropless path's :func:`stacked_project`: x [M, in] (rows sorted by expert, ``group_list`` [E] counts)
    -> [M, out] float32 through ``weight`` [E, out, in] and ``holder``'s adapter, if any, each factor of the
    adapter one more grouped matmul on the same rows (A [E, r, in], B [E, out, r])."""
    y = gmm(x, weight, group_list)  # [M, out]
    if holder.lora_A is not None:
        h = x if holder.lora_dropout is None else holder.lora_dropout(x)
        h = gmm(h, holder.lora_A.weight.astype(cdt), group_list).astype(cdt)  # [M, r]
        delta = gmm(h, holder.lora_B.weight.astype(cdt), group_list)  # [M, out]
        y = y + delta * holder.lora_scaling
    return y


def stacked_project(holder, weight, x, bmm, lora_a_bmm, lora_b_bmm, cdt, broadcast: bool):
    """x [D, E, C, in] -> [D, E, C, out] through ``weight`` [E, out, in] in the compute dtype ``cdt`` and ``holder``'s
    adapter, if any (StackedWeight, and model/quant.py's QuantStackedWeight with its dequantised weight)."""
    y = bmm(x, _batched(weight, x, broadcast))  # [D, E, C, out]
    if holder.lora_A is not None:
        h = x if holder.lora_dropout is None else holder.lora_dropout(x)
        h = lora_a_bmm(h, _batched(holder.lora_A.weight.astype(cdt), h, broadcast))  # [D, E, C, r]
        # named ops on the expert rows: one the plan does not name would take semi_auto's default split of its
        # first axis (D = dp/ep, often 1) and MindSpore would gather the whole expert buffer for it (level 1
        # of v2-lora-16npu)
        delta = lora_b_bmm(h, _batched(holder.lora_B.weight.astype(cdt), h, broadcast))  # [D, E, C, out]
        y = holder.lora_add(y, holder.lora_scale(delta, holder.lora_scaling))
    return y


def _batched(w, x, broadcast: bool):
    """A stacked weight [E, out, in] for BatchMatMul with x [D, E, C, in]: as it is where BatchMatMul
    broadcasts batch axes (Ascend, MindFormers' 4-D expert input against 3-D weights), else expanded to
    [D, E, out, in] (MindSpore's CPU/GPU BatchMatMul needs equal batch axes: ``ops/infer/batch_mat_mul.cc``
    ``CheckBatchMatmulInputWhetherCanBeBroadcast``; the gradient sums over D as the broadcast does)."""
    if not broadcast:
        return w
    return ops.broadcast_to(w.reshape((1,) + tuple(w.shape)), (x.shape[0],) + tuple(w.shape))


class RoutedExperts(nn.Cell):
    """E SwiGLU experts with stacked weights [E, out, in] (HF per-expert weights, stacked in order)."""

    def __init__(self, cfg: DeepseekV2Config):
        super().__init__()
        E, H, I = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        pdt = to_ms_dtype(cfg.param_dtype)
        self.compute_dtype = to_ms_dtype(cfg.compute_dtype)
        std = cfg.initializer_range
        self.gate_proj = StackedWeight([E, I, H], std, pdt)
        self.up_proj = StackedWeight([E, I, H], std, pdt)
        self.down_proj = StackedWeight([E, H, I], std, pdt)
        self.gate_bmm = ops.BatchMatMul(transpose_b=True)
        self.up_bmm = ops.BatchMatMul(transpose_b=True)
        self.down_bmm = ops.BatchMatMul(transpose_b=True)
        # the stacked adapters' batched matmuls (used once ms_deepseek.model.lora attaches adapters)
        self.gate_lora_a_bmm, self.gate_lora_b_bmm = (
            ops.BatchMatMul(transpose_b=True),
            ops.BatchMatMul(transpose_b=True),
        )
        self.up_lora_a_bmm, self.up_lora_b_bmm = ops.BatchMatMul(transpose_b=True), ops.BatchMatMul(transpose_b=True)
        self.down_lora_a_bmm, self.down_lora_b_bmm = (
            ops.BatchMatMul(transpose_b=True),
            ops.BatchMatMul(transpose_b=True),
        )
        # Decided when the Cell is built (the device is chosen before the model, core/runtime.py).
        self.broadcast_weights = device_target() != "Ascend"
        # Every op on the expert rows [D, E, C, *] is a named primitive with the plan's split (the experts
        # style): under a pipeline MindSpore compiles in semi_auto mode, where an op without a strategy
        # splits its first axis only (D = dp/ep, often 1), and the expert buffer would be gathered whole for
        # it (MindFormers' LlamaFeedForward._shard_semi_auto_parallel names each of them the same way).
        self.cast_in = ops.Cast()
        self.act = SiLU()  # ops.auto_generate: the primitive behind ops.silu
        self.act_mul = ops.Mul()
        # the dropless path's grouped matmul, and the fused SwiGLU of its three for experts without adapters (built
        # only for it: on CPU their first use compiles a C++ kernel)
        dropless = cfg.moe_dispatch == "dropless"
        self.gmm = GroupedMatmul() if dropless else None
        self.swiglu = GroupedSwiglu() if dropless else None

    def has_adapters(self) -> bool:
        return self.gate_proj.lora_A is not None or self.up_proj.lora_A is not None or self.down_proj.lora_A is not None

    def chosen(self, x, idx):
        """x [n, 1, H] through the one expert of each row, idx [n] -> [n, 1, H]: the chosen experts' weights
        gathered ([n, out, in]) instead of every expert run on a capacity buffer (no adapters)."""
        cdt = self.compute_dtype
        x = self.cast_in(x, cdt)
        gate = self.gate_bmm(x, self.gate_proj.rows(idx, cdt))  # [n, 1, I]
        up = self.up_bmm(x, self.up_proj.rows(idx, cdt))  # [n, 1, I]
        return self.down_bmm(self.act_mul(self.act(gate), up), self.down_proj.rows(idx, cdt))  # [n, 1, H]

    def fused(self, tokens, order, group_list, weight):
        """The dropless path without adapters: tokens [N, H], order [S] (the slot token * k + choice at each
        position sorted by expert), group_list [E] int32 row counts, weight [N, k] the routing weights -> [N, H]
        float32, every expert's SwiGLU on exactly its rows and each token's k outputs weighted and summed, in one
        :class:`ms_deepseek.ops.GroupedSwiglu` call (CPU: one C++ kernel)."""
        cdt = self.compute_dtype
        weights = (self.gate_proj.dense(cdt), self.up_proj.dense(cdt), self.down_proj.dense(cdt))
        return self.swiglu(self.cast_in(tokens, cdt), order, weights[0], weights[1], weights[2], group_list, weight)

    def grouped(self, x, group_list):
        """x [M, H] sorted by expert, group_list [E] int32 row counts -> [M, H] float32: every expert on exactly
        its rows, each projection (and each factor of its adapter) one grouped matmul; the same SwiGLU as
        :meth:`construct`."""
        cdt = self.compute_dtype
        x = self.cast_in(x, cdt)
        gate = self.gate_proj.grouped(x, group_list, self.gmm, cdt)  # [M, I]
        up = self.up_proj.grouped(x, group_list, self.gmm, cdt)  # [M, I]
        hidden = self.act_mul(self.act(gate), up).astype(cdt)  # [M, I]
        return self.down_proj.grouped(hidden, group_list, self.gmm, cdt)  # [M, H]

    def construct(self, x):
        """x [D, E, C, H] -> [D, E, C, H] (D = G/ep blocks of the exchange view, the experts on axis 1)."""
        cdt, b = self.compute_dtype, self.broadcast_weights
        x = self.cast_in(x, cdt)
        gate = self.gate_proj.project(x, self.gate_bmm, self.gate_lora_a_bmm, self.gate_lora_b_bmm, cdt, b)
        up = self.up_proj.project(x, self.up_bmm, self.up_lora_a_bmm, self.up_lora_b_bmm, cdt, b)  # [D, E, C, I]
        return self.down_proj.project(
            self.act_mul(self.act(gate), up), self.down_bmm, self.down_lora_a_bmm, self.down_lora_b_bmm, cdt, b
        )  # [D, E, C, H]


# the primitives of the sorted dropless path (DeepseekV2MoE.dropless_experts)
SORTED_PATH_PRIMITIVES = ("choice_sort", "inverse_sort", "sorted_gather", "unsort_gather")


class DeepseekV2MoE(nn.Cell):
    def __init__(self, cfg: DeepseekV2Config):
        super().__init__()
        E = cfg.n_routed_experts
        self.num_experts, self.top_k = E, cfg.num_experts_per_tok
        # the training buffers' factor, by the planner's rule (None on a dropless layer: C = N, the bounded exchange)
        self.capacity_factor = dispatch_shapes.training_factor(cfg)
        self.eval_capacity_factor = cfg.eval_capacity_factor  # None: dropless evaluation
        self.capacity_multiple = 1  # rounds C up; the per-group layout needs none (G*C splits by G/ep)
        # The parallel degrees come from the plan (apply_plan), never from the config's ep_size.
        self.groups = 1  # G: token groups = the plan's dp
        self.ep = 1  # the plan's ep (the exchange view [G/ep, ep, E, C, H])
        self.alphas = (cfg.expert_alpha, cfg.device_aux_loss_alpha, cfg.comm_aux_loss_alpha)
        self.gate = Router(cfg)
        self.experts = RoutedExperts(cfg)
        self.expert_placement = Parameter(Tensor(default_placement(E, 1)), name="expert_placement", requires_grad=False)
        self.lookup = ExpertLookup(num_experts=E, experts_per_rank=E)
        self.shared_experts = None
        if cfg.n_shared_experts:
            self.shared_experts = MLP(
                cfg.hidden_size,
                cfg.moe_intermediate_size * cfg.n_shared_experts,
                cfg.initializer_range,
                to_ms_dtype(cfg.compute_dtype),
                to_ms_dtype(cfg.param_dtype),
            )
        self.pad_tokens = ops.Concat(1)
        self.slot_sort = ops.Sort(axis=-1)
        self.dispatch_gather = ops.Gather(batch_dims=1)
        self.to_experts = ops.Transpose()
        self.from_experts = ops.Transpose()
        self.combine_gather = ops.Gather(batch_dims=1)
        # the dropless path (model.moe_dispatch: dropless): sort the choices by expert, gather, unsort
        # (only on a dropless layer; the plan has no rule for them: outside SEMI_AUTO_PARALLEL none is needed, under it
        # use_bounded_exchange removes them)
        self.dropless = cfg.moe_dispatch == "dropless"
        # a dropless layer under a parallel plan runs the bounded exchange (:meth:`use_bounded_exchange`)
        self.bounded_exchange = False
        # a decode step's path (:meth:`set_decode_mode`): the chosen experts' gathered weights (:meth:`one_token`)
        # unless a dropless layer decodes in graph mode
        self.one_token_decode = True
        if self.dropless:
            self.choice_sort = ops.Sort()
            self.inverse_sort = ops.Sort()
            self.sorted_gather = ops.Gather()
            self.unsort_gather = ops.Gather()

    def use_bounded_exchange(self) -> None:
        """A dropless layer under a parallel plan (``parallel_apply.apply``): :meth:`construct`'s dispatch,
        exchange and batched experts at the worst-case capacity C = N, a token group's whole token count. A
        token picks an expert at most once (top-k without repeats), so no expert of a group receives more than
        N rows and nothing is dropped, by construction; the buffers are static ([G, E, N, H]), which is what
        SEMI_AUTO_PARALLEL compiles, and the dp -> ep layout change is the capacity path's AllToAll. A variable
        exchange (AlltoAllV with counts) is not what the plan uses: MindSpore 2.9's parallel frontend has no
        operator info for ``AlltoAllV`` (none under ``frontend/parallel/ops_info/``), and its only one for a
        grouped matmul, ``GroupedMatmulInfo`` (``grouped_matmul_info.cc`` ``InferTensorMap``, registered for
        the ``GroupedMatmul`` primitive, not ``GroupedMatmulV4``), maps the stacked weight's expert axis to -1
        (never split), so an expert-split grouped matmul on the received rows has no strategy to compile with.
        Memory and compute are the worst case (every one of the E x N slots per group, mostly empty rows); the
        planner prices them so.
        The sorted path's primitives are removed: nothing in this graph runs them, and the plan has no rule
        for them (``parallel_apply.apply._check_strategic``)."""
        if not self.dropless:
            return
        self.bounded_exchange = True
        for name in SORTED_PATH_PRIMITIVES:
            # nn.Cell keeps a primitive attribute both in the instance and in its ``_primitives`` table
            self.__dict__.pop(name, None)
            self._primitives.pop(name, None)
        self.experts.gmm = self.experts.swiglu = None

    def sorted_path_members(self):
        """Paths, relative to this layer, of what only the sorted dropless path runs (primitives and the grouped
        matmul cells); empty on a capacity layer or on the bounded exchange. Outside SEMI_AUTO_PARALLEL they need no
        strategy: MindSpore reads a primitive's strategy only in the semi-auto and auto modes
        (``mindspore/ops/primitive.py`` ``Primitive.shard``)."""
        if not self.dropless or self.bounded_exchange:
            return ()
        return SORTED_PATH_PRIMITIVES + ("experts.gmm", "experts.swiglu")

    def set_expert_placement(self, table: np.ndarray, groups: int, ep: int) -> None:
        """The plan's expert placement (``parallel_apply.apply``): the placement table [E, 2] (rank, slot), the
        token groups (the plan's dp: capacity and slots per rank) and ep (the exchange view
        [G/ep, ep, E, C, H], ``ranks.exchange_view``); the router's device-level balance losses and the
        lookup's experts per rank follow. The stacked weights' buffer order is the plan's to set."""
        # the sorted path runs every choice of its tokens, however they are grouped; split experts need the exchange
        if self.dropless and not self.bounded_exchange and ep > 1:
            raise UserError(
                f"model.moe_dispatch: dropless splits the experts {ep} ways only on the bounded exchange "
                "(DeepseekV2MoE.use_bounded_exchange, which apply_plan calls under SEMI_AUTO_PARALLEL)"
            )
        self.expert_placement.set_data(Tensor(table))
        self.groups, self.ep = groups, ep
        self.gate.set_expert_parallel(ep)
        self.lookup.set_experts_per_rank(self.num_experts // ep)  # in place: the op keeps its strategy

    def capacity(self, tokens_per_group: int) -> int:
        """Per-expert buffer rows of one group: the training factor's, in evaluation the eval factor's
        (None: dropless); the rule is :func:`ms_deepseek.config.dispatch_shapes.capacity`."""
        factor = self.capacity_factor if self.training else self.eval_capacity_factor
        return dispatch_shapes.capacity(tokens_per_group, self.top_k, self.num_experts, factor, self.capacity_multiple)

    def dispatch_index(self, buffer_row, keep, C: int):
        """[G, E, C] int32: the local token in each buffer slot (N = the zero row), from buffer_row and
        keep [G, N, k] (MindFormers TopkRouterV2's sort indexing, on the lookup's kept slots)."""
        G, N, k = buffer_row.shape
        E, S = self.num_experts, k * N
        row_km = buffer_row.transpose(0, 2, 1).reshape(G, 1, S)  # [G, N, k] -> [G, k, N] -> [G, 1, k*N]
        kept_km = keep.transpose(0, 2, 1).reshape(G, 1, S) > 0  # [G, 1, k*N]
        rows = ops.arange(0, E, dtype=ms.int32).reshape(1, E, 1)  # [1, E, 1]
        stream = ops.arange(0, S, dtype=ms.float32).reshape(1, 1, S)  # [1, 1, k*N]: k-major slot s = j*N + i
        mine = ops.logical_and(row_km == rows, kept_km)  # [G, E, k*N]: slot s is kept in buffer row e
        # Keys: kept slots of row e keep their stream index, the rest move past 2*k*N; sorting each row
        # puts row e's slots first in k-major order, i.e. by position. Exact in float32 while 3*k*N < 2**24.
        # Written as a broadcasting add, not a select between two broadcast constants: MindSpore folds a
        # broadcast constant at the graph's global shape (dp 32 at 236B width: [32, 160, 24576] float32 per copy,
        # per micro-batch and recomputed forward), more than the compile check's host holds.
        keys = stream + ops.logical_not(mine).astype(ms.float32) * (2.0 * S)  # [G, E, k*N]
        # Outputs are indexed, not unpacked into unused names: an unused element of an unpacked tuple
        # is what graph mode reports as "Some side effect nodes were eliminated by mistake".
        ordered = self.slot_sort(keys)[0]  # [G, E, k*N] (the sort's indices are not needed)
        first = ordered[:, :, :C]  # [G, E, C]
        token = ops.floor_mod(first.astype(ms.int32), N)  # k-major s -> token i = s mod N
        filled = first < 2.0 * S
        # token where filled, else N (the zero row), in arithmetic: a full_like(token, N) of this static shape
        # is folded into a constant ([8, 64, 4096] int32 in v2-lite-lora-8npu's eval graph; the compile check)
        held = filled.astype(ms.int32)
        return ops.stop_gradient(token * held + (1 - held) * N)  # [G, E, C]

    def dispatch(self, tokens):
        """Steps 1-3 on G token groups: tokens [G, N, H] -> (buffer [G, E, C, H], route), route =
        (scores [G*N, E], topk_idx [G*N, k], topk_weight [G*N, k], buffer_row, position, keep [G, N, k]).
        Everything here is local to a group (what one data-parallel rank runs on its own tokens)."""
        G, N, H = tokens.shape
        k = self.top_k
        C = self.capacity(N)
        scores, topk_idx, topk_weight = self.gate(tokens.reshape(G * N, H))  # [G*N, E], [G*N, k], [G*N, k]
        ids = topk_idx.reshape(G, N, k)  # [G*N, k] -> [G, N, k]
        looked = self.lookup(ids, self.expert_placement, C)  # (dest_rank, buffer_row, position, keep) [G, N, k]
        buffer_row, position, keep = looked[1], looked[2], looked[3]
        # A local gather per group from its tokens plus a zero row (index N).
        padded = self.pad_tokens((tokens, ops.zeros((G, 1, H), tokens.dtype)))  # [G, N + 1, H]
        buffer = self.dispatch_gather(padded, self.dispatch_index(buffer_row, keep, C), 1)  # [G, E, C, H]
        return buffer, (scores, topk_idx, topk_weight, buffer_row, position, keep)

    def combine(self, back, route):
        """Step 6 on G token groups: expert output back [G, E*C, H] -> routed [G, N, H] float32 (local)."""
        topk_weight, buffer_row, position, keep = route[2], route[3], route[4], route[5]
        G, N, k = buffer_row.shape
        C = back.shape[1] // self.num_experts
        # Dropped choices read slot 0 and get weight 0.
        combine_index = ops.select(keep > 0, buffer_row * C + position, ops.zeros_like(position))  # [G, N, k]
        picked = self.combine_gather(back, ops.stop_gradient(combine_index), 1)  # [G, N, k, H]
        weight = topk_weight.reshape(G, N, k) * keep  # [G, N, k]
        return (picked.astype(ms.float32) * weight.reshape(G, N, k, 1)).sum(2)  # [G, N, H]

    def dropless_experts(self, tokens, topk_idx, topk_weight):
        """The routed experts without capacity: tokens [N, H], the router's topk_idx / topk_weight [N, k] ->
        [N, H] float32. All N*k choices are sorted by expert (static shapes: [N*k, H] rows, the per-expert counts
        ``group_list`` [E] a tensor), every expert runs on exactly its rows, and the rows go back to their
        (token, choice) slots and are mixed with the routing weights as :meth:`combine` does (without adapters all
        of it one fused
        :class:`ms_deepseek.ops.GroupedSwiglu` call; with them one :class:`ms_deepseek.ops.GroupedMatmul` per
        projection and adapter factor)."""
        N, H = tokens.shape
        k, E, S = self.top_k, self.num_experts, tokens.shape[0] * self.top_k
        choice = topk_idx.reshape(S).astype(ms.int32)  # token-major slot s = i*k + j
        # unique int32 keys expert*S + s: ascending order is by expert, then by slot (a stable sort by expert)
        keys = choice * S + ops.arange(0, S, dtype=ms.int32)
        order = ops.stop_gradient(self.choice_sort(keys)[1])  # [S]: the slot at each sorted position
        experts = ops.arange(0, E, dtype=ms.int32).reshape(1, E)
        group_list = ops.stop_gradient((choice.reshape(S, 1) == experts).astype(ms.int32).sum(0))  # [E] counts
        if not self.experts.has_adapters():  # gather, experts and the weighted way back in one call
            return self.experts.fused(tokens, order, group_list, topk_weight)  # [N, H]
        inverse = ops.stop_gradient(self.inverse_sort(order)[1])  # [S]: the sorted position of each slot
        rows = self.sorted_gather(tokens, ops.floor_div(order, k), 0)  # [S, H] sorted by expert
        out = self.experts.grouped(rows, group_list)  # [S, H] float32
        back = self.unsort_gather(out, inverse, 0).reshape(N, k, H)  # [N, k, H] in slot order
        return (back.astype(ms.float32) * topk_weight.reshape(N, k, 1)).sum(1)  # [N, H]

    def construct(self, x):
        """x [B, T, H] -> (y [B, T, H], aux_loss scalar, stats [E + 4], scores [B*T, E], topk_idx [B*T, k],
        topk_weight [B*T, k])."""
        if self.dropless and not self.bounded_exchange and (self.training or self.eval_capacity_factor is None):
            return self.construct_dropless(x)
        B, T, H = x.shape
        E, k, G, ep = self.num_experts, self.top_k, self.groups, self.ep
        # Internal guards (graph mode raises only builtin exceptions): apply_plan and the recipe checks
        # refuse these layouts earlier with a UserError.
        if (B * T) % G or G % ep:
            raise ValueError(f"MoE: {B}x{T} tokens do not split into {G} data-parallel groups of ep {ep}")
        N = B * T // G
        C = self.capacity(N)
        if N > dispatch_shapes.max_tokens_per_group(k):
            raise ValueError(f"MoE: {N} tokens per group x top-{k} exceed the float32 sort keys of the dispatch")
        buffer, route = self.dispatch(x.reshape(G, N, H))  # [B, T, H] -> [G, N, H] (rank-major rows)

        # dp -> ep exchange (one AllToAll per ep group when G and E are split), experts, and back.
        outer, _ = exchange_view(G, ep)  # G = outer * ep, ep inner: an ep group is consecutive groups
        view = buffer.reshape(outer, ep, E, C, H)  # [G, E, C, H] -> [G/ep, ep, E, C, H]
        expert_in = self.to_experts(view, (0, 2, 1, 3, 4)).reshape(outer, E, ep * C, H)  # -> [G/ep, E, ep*C, H]
        out = self.experts(expert_in).astype(x.dtype)  # [G/ep, E, ep*C, H]
        out = out.reshape(outer, E, ep, C, H)  # -> [G/ep, E, ep, C, H]
        back = self.from_experts(out, (0, 2, 1, 3, 4)).reshape(G, E * C, H)  # -> [G/ep, ep, E, C, H] -> [G, E*C, H]

        y = self.combine(back, route).astype(x.dtype).reshape(B, T, H)  # [G, N, H] -> [B, T, H]
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        scores, topk_idx, topk_weight, keep = route[0], route[1], route[2], route[5]
        l_exp, l_dev, l_com, load = self.gate.balance_losses(scores, topk_idx, B)
        aux = self.alphas[0] * l_exp + self.alphas[1] * l_dev + self.alphas[2] * l_com
        dropped = 1.0 - keep.mean()
        # statistics for the logs, made of values without a gradient: under a pipeline a layer's stats travel to the
        # last stage, which takes no gradient of them, so the stage that made them must not expect one (it would
        # wait for a gradient Receive that no stage sends; plan --execute runs the stages and names such a wait).
        # The pieces stop the gradient, not the concat: a StopGradient cannot be a stage's border node
        # (MindSpore's pipeline pass: "Only PipelineSplit cared node can be a border")
        pieces = ops.stop_gradient(ops.stack((dropped, l_exp, l_dev, l_com)))  # [4]
        stats = ops.concat((ops.stop_gradient(load), pieces), 0)  # [E + 4]
        return y, aux, stats, scores, topk_idx, topk_weight

    def construct_dropless(self, x):
        """:meth:`construct` on the sorted dropless path (every choice of the local tokens runs, so token groups do
        not change it; split experts take the bounded exchange instead), same outputs; the dropped fraction in
        ``stats`` is 0."""
        B, T, H = x.shape
        tokens = x.reshape(B * T, H)
        scores, topk_idx, topk_weight = self.gate(tokens)  # [B*T, E], [B*T, k], [B*T, k]
        y = self.dropless_experts(tokens, topk_idx, topk_weight).astype(x.dtype).reshape(B, T, H)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        l_exp, l_dev, l_com, load = self.gate.balance_losses(scores, topk_idx, B)
        aux = self.alphas[0] * l_exp + self.alphas[1] * l_dev + self.alphas[2] * l_com
        pieces = ops.stop_gradient(ops.stack((ops.zeros((), ms.float32), l_exp, l_dev, l_com)))  # [4]
        stats = ops.concat((ops.stop_gradient(load), pieces), 0)  # [E + 4]
        return y, aux, stats, scores, topk_idx, topk_weight

    def set_decode_mode(self, graph: bool) -> None:
        """Which path a decode step takes (``ms_deepseek.generate`` calls this before decoding): in graph mode a
        dropless layer that evaluates dropless runs its dropless path (:meth:`construct_dropless`: the B*k rows
        through the grouped kernel, which reads the chosen experts' weights in place), which on CPU takes less
        time than :meth:`one_token`'s gather of those weights and batched matmuls; op by op (PyNative) its
        longer chain of ops costs more than the compute it saves, and every layer takes :meth:`one_token`
        (docs/measurements.md, "Training step on CPU"). Both compute the same sums."""
        dropless_eval = self.dropless and self.eval_capacity_factor is None
        self.one_token_decode = not (graph and dropless_eval)

    def one_token_fits(self, x) -> bool:
        """Whether :meth:`one_token` serves x [B, T, H]: one token per row, evaluation, one token group, at most
        E routed rows (never more weight rows read than the stack holds), no expert adapters, and the decode
        mode's choice (:meth:`set_decode_mode`)."""
        B, T = x.shape[0], x.shape[1]
        fits = T == 1 and B * self.top_k <= self.num_experts and self.groups == 1 and self.one_token_decode
        return fits and not self.training and not self.experts.has_adapters()

    def one_token(self, x):
        """A decode step's routed and shared experts, x [B, 1, H] -> y [B, 1, H] (no balance losses).

        Each row's k routed copies go through their experts' gathered weights (``RoutedExperts.chosen``): the
        dropless math of the dispatch path without its index arithmetic, capacity buffer and E-expert
        matmuls, B*k expert rows read instead of all E. Nothing is dropped."""
        B, H, k = x.shape[0], x.shape[2], self.top_k
        _, topk_idx, topk_weight = self.gate(x.reshape(B, H))  # [B, k], [B, k]
        copies = ops.broadcast_to(x.reshape(B, 1, 1, H), (B, k, 1, H)).reshape(B * k, 1, H)  # [B*k, 1, H]
        out = self.experts.chosen(copies, topk_idx.reshape(B * k)).reshape(B, k, H)  # [B, k, H]
        y = (out.astype(ms.float32) * topk_weight.reshape(B, k, 1)).sum(1)  # [B, H] float32, as ``combine``
        y = y.astype(x.dtype).reshape(B, 1, H)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y
