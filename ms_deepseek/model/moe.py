"""DeepSeekMoE layer: router, capacity-buffer dispatch, stacked routed experts, shared experts.

Dispatch uses static shapes (graph mode, SEMI_AUTO_PARALLEL on Ascend):

1. the router picks k experts per token (``topk_idx`` [N, k]) with weights;
2. ``ExpertLookup`` maps each expert id through the placement table
   (``expert_placement`` [E, 2] = EP rank, local slot) to its buffer row and gives each
   (token, choice) a position inside that expert's capacity buffer, k-major so a
   token's first choice is dropped last; ``keep`` marks positions < capacity;
3. the tokens are gathered into the buffer [E, C, H] (index arithmetic, no one-hot
   [N, E, C] tensor), the experts run as batched matmuls on stacked weights
   [E, out, in], and the results are gathered back and mixed with the weights
   (a dropped choice gets weight 0).

Capacity: ``ceil(capacity_factor * N * k / E)`` in training when the config sets a
factor; otherwise C = N, which is dropless (an expert receives each token at most once).

Primitives (for the parallel plan): ``experts.gate_bmm``, ``experts.up_bmm``,
``experts.down_bmm`` (BatchMatMul on [E, C, *]), ``dispatch_gather``, ``combine_gather``.
"""

from __future__ import annotations

import math

import numpy as np
import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops
from mindspore.common.initializer import Normal, initializer

from ms_deepseek.config import DeepseekV2Config
from ms_deepseek.model.layers import MLP, to_ms_dtype
from ms_deepseek.model.router import Router
from ms_deepseek.ops import ExpertLookup


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
        # Optional stacked LoRA adapter (ms_deepseek.model.lora.add_adapters): A [E, r, in], B [E, out, r].
        self.lora_A = None
        self.lora_B = None
        self.lora_scaling = 0.0
        self.lora_dropout = None

    def project(self, x, bmm, lora_a_bmm, lora_b_bmm, cdt):
        """x [E, C, in] -> [E, C, out] through the stacked weight (+ its adapter, same batched matmuls)."""
        y = bmm(x, self.weight.astype(cdt))  # [E, C, out]
        if self.lora_A is not None:
            h = x if self.lora_dropout is None else self.lora_dropout(x)
            h = lora_a_bmm(h, self.lora_A.weight.astype(cdt))  # [E, C, r]
            y = y + lora_b_bmm(h, self.lora_B.weight.astype(cdt)) * self.lora_scaling  # [E, C, out]
        return y


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
        self.gate_lora_a_bmm, self.gate_lora_b_bmm = ops.BatchMatMul(transpose_b=True), ops.BatchMatMul(transpose_b=True)
        self.up_lora_a_bmm, self.up_lora_b_bmm = ops.BatchMatMul(transpose_b=True), ops.BatchMatMul(transpose_b=True)
        self.down_lora_a_bmm, self.down_lora_b_bmm = ops.BatchMatMul(transpose_b=True), ops.BatchMatMul(transpose_b=True)

    def construct(self, x):
        """x [E, C, H] -> [E, C, H]."""
        cdt = self.compute_dtype
        x = x.astype(cdt)
        gate = self.gate_proj.project(x, self.gate_bmm, self.gate_lora_a_bmm, self.gate_lora_b_bmm, cdt)  # [E, C, I]
        up = self.up_proj.project(x, self.up_bmm, self.up_lora_a_bmm, self.up_lora_b_bmm, cdt)  # [E, C, I]
        return self.down_proj.project(ops.silu(gate) * up, self.down_bmm, self.down_lora_a_bmm,
                                      self.down_lora_b_bmm, cdt)  # [E, C, H]


class DeepseekV2MoE(nn.Cell):
    def __init__(self, cfg: DeepseekV2Config):
        super().__init__()
        E = cfg.n_routed_experts
        self.num_experts, self.top_k = E, cfg.num_experts_per_tok
        self.capacity_factor = cfg.capacity_factor
        self.capacity_multiple = 1  # set by the parallel plan (dp / ep) so [E, C, H] splits evenly
        self.alphas = (cfg.expert_alpha, cfg.device_aux_loss_alpha, cfg.comm_aux_loss_alpha)
        self.gate = Router(cfg)
        self.experts = RoutedExperts(cfg)
        ep = cfg.ep_size if cfg.ep_size and E % cfg.ep_size == 0 else 1
        self.expert_placement = Parameter(Tensor(default_placement(E, ep)), name="expert_placement",
                                          requires_grad=False)
        self.lookup = ExpertLookup(num_experts=E, experts_per_rank=E // ep)
        self.shared_experts = None
        if cfg.n_shared_experts:
            self.shared_experts = MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts,
                                      cfg.initializer_range, to_ms_dtype(cfg.compute_dtype),
                                      to_ms_dtype(cfg.param_dtype))
        self.dispatch_gather = ops.Gather()
        self.combine_gather = ops.Gather()

    def capacity(self, num_tokens: int) -> int:
        """Per-expert buffer rows: from the factor in training (rounded up to ``capacity_multiple``,
        which the parallel plan sets so the buffer splits evenly), else ``num_tokens`` (dropless)."""
        if self.training and self.capacity_factor is not None:
            capacity = max(1, math.ceil(self.capacity_factor * num_tokens * self.top_k / self.num_experts))
            return -(-capacity // self.capacity_multiple) * self.capacity_multiple
        return num_tokens  # dropless

    def construct(self, x):
        """x [B, T, H] -> (y [B, T, H], aux_loss scalar, stats [E + 4])."""
        B, T, H = x.shape
        N, E, k = B * T, self.num_experts, self.top_k
        flat = x.reshape(N, H)
        scores, topk_idx, topk_weight = self.gate(flat)
        C = self.capacity(N)
        _, buffer_row, position, keep = self.lookup(topk_idx, self.expert_placement, C)
        # Slot of each kept (token, choice) in the flattened [E * C] buffer; dropped -> E * C (a zero row).
        slot = ops.select(keep > 0, buffer_row * C + position, ops.full_like(position, E * C))  # [N, k]
        token = ops.broadcast_to(ops.arange(0, N, dtype=ms.int32).reshape(N, 1), (N, k))  # [N, k]
        # Which token fills each buffer slot: empty slots point at row N (zeros). Kept slots are unique,
        # so a scatter-add of (token - N) onto N is an exact assignment; dropped ones land on row E*C.
        slot_token = ops.scatter_nd(slot.reshape(N * k, 1), (token - N).reshape(N * k),
                                    (E * C + 1,)) + N  # [E*C + 1]
        padded = ops.concat((flat, ops.zeros((1, H), flat.dtype)), 0)  # [N + 1, H]
        buffer = self.dispatch_gather(padded, slot_token[: E * C], 0).reshape(E, C, H)  # [E, C, H]
        out = self.experts(buffer).reshape(E * C, H).astype(x.dtype)  # [E*C, H]
        # Combine: dropped choices read row 0 and get weight 0 (no padding row, so the expert
        # output keeps its [E*C, H] layout and splits by ep without a gather).
        kept_slot = ops.select(keep > 0, slot, ops.zeros_like(slot))  # [N, k]
        picked = self.combine_gather(out, kept_slot.reshape(N * k), 0).reshape(N, k, H)  # [N, k, H]
        weight = topk_weight * keep  # [N, k]
        routed = (picked.astype(ms.float32) * weight.reshape(N, k, 1)).sum(1)  # [N, H]
        y = routed.astype(x.dtype).reshape(B, T, H)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        l_exp, l_dev, l_com, load = self.gate.balance_losses(scores, topk_idx, B)
        aux = self.alphas[0] * l_exp + self.alphas[1] * l_dev + self.alphas[2] * l_com
        dropped = 1.0 - keep.mean()
        stats = ops.concat((load, ops.stack((dropped, l_exp, l_dev, l_com))), 0)  # [E + 4]
        return y, aux, ops.stop_gradient(stats), scores, topk_idx, topk_weight
