"""DeepSeekMoE router: fp32 softmax scores, greedy or group-limited top-k, and the balance losses.

All routing math runs in float32 whatever the compute dtype. Balance losses follow
the paper (section 2.2.3) and, for the expert-level one, the original code exactly:

  f_i   = E / (k * T) * #{(t, j): token t's j-th choice is expert i}     (expert load, scaled)
  P_i   = mean_t s_{i,t}                                                  (mean routing score)
  L_exp = sum_i f_i P_i
  L_dev = sum_d mean_{i in d}(f_i) * sum_{i in d} P_i                    (D device groups)
  L_com = sum_d D / (M * T) * #{t: token t sends to device d} * sum_{i in d} P_i

With ``seq_aux`` each is computed per sequence and averaged over the batch. Devices
are the routing groups (``n_group``) under group-limited routing, else the parallel
plan's ``ep`` contiguous expert blocks (set by :meth:`Router.set_expert_parallel`, called
by ``apply_plan``; 1 before; the config's ``ep_size`` is only an HF key and is never
read); M is ``topk_group`` (devices a token may reach) or min(k, D).
"""

from __future__ import annotations

import mindspore as ms
from mindspore import Parameter, nn, ops
from mindspore.common.initializer import Normal, initializer

from ms_deepseek.config.model import DeepseekV2Config
from ms_deepseek.ops import FP32Softmax


class Router(nn.Cell):
    """Primitives: ``matmul`` (scores), ``topk``, ``group_topk``."""

    def __init__(self, cfg: DeepseekV2Config):
        super().__init__()
        E = cfg.n_routed_experts
        self.num_experts, self.top_k = E, cfg.num_experts_per_tok
        self.weight = Parameter(
            initializer(Normal(cfg.initializer_range), [E, cfg.hidden_size], ms.float32), name="weight"
        )
        self.group_limited = cfg.topk_method == "group_limited_greedy"
        self.n_group = cfg.n_group if self.group_limited else 1
        self.topk_group = cfg.topk_group if self.group_limited else 1
        self.norm_topk_prob = cfg.norm_topk_prob
        self.routed_scaling_factor = cfg.routed_scaling_factor
        self.seq_aux = cfg.seq_aux
        self.set_expert_parallel(1)
        self.matmul = ops.MatMul(transpose_b=True)
        # float32 logits: CANN's Softmax on Ascend, our more accurate kernel on CPU (FP32Softmax doc)
        self.softmax = FP32Softmax(out_dtype=ms.float32, float32_input=True)
        self.topk = ops.TopK(sorted=True)
        self.group_topk = ops.TopK(sorted=True)

    def set_expert_parallel(self, ep: int) -> None:
        """Device groups of the balance losses: the routing groups under group-limited routing,
        else ``ep`` contiguous expert blocks (the plan's expert-parallel degree)."""
        devices = self.n_group if self.group_limited else ep
        self.num_devices = devices if devices and self.num_experts % devices == 0 else 1
        self.devices_per_token = self.topk_group if self.group_limited else min(self.top_k, self.num_devices)

    def construct(self, x):
        """x [N, H] -> scores [N, E] f32, topk_idx [N, k] int32, topk_weight [N, k] f32."""
        logits = self.matmul(x.astype(ms.float32), self.weight.astype(ms.float32))  # [N, E]
        scores = self.softmax(logits)
        masked = scores
        if self.group_limited:
            N = scores.shape[0]
            grouped = scores.reshape(N, self.n_group, self.num_experts // self.n_group)  # [N, G, E/G]
            group_best = ops.amax(grouped, -1)  # [N, G]
            _, group_idx = self.group_topk(group_best, self.topk_group)  # [N, topk_group]
            keep_group = ops.one_hot(group_idx, self.n_group, ops.ones((), ms.float32), ops.zeros((), ms.float32)).sum(
                1
            )  # [N, G] in {0, 1}
            keep = ops.broadcast_to(keep_group.reshape(N, self.n_group, 1), grouped.shape).reshape(N, -1)
            masked = scores * keep  # scores outside the kept groups -> 0
        weight, idx = self.topk(masked, self.top_k)
        if self.top_k > 1 and self.norm_topk_prob:
            weight = weight / (weight.sum(-1, keepdims=True) + 1e-20)
        else:
            weight = weight * self.routed_scaling_factor
        return scores, idx.astype(ms.int32), weight

    def balance_losses(self, scores, topk_idx, batch: int):
        """Unweighted (L_exp, L_dev, L_com) float32 scalars and the expert load [E] (fraction of routed
        slots per expert). scores [N, E], topk_idx [N, k]."""
        E, k, D = self.num_experts, self.top_k, self.num_devices
        groups = batch if self.seq_aux else 1
        T = scores.shape[0] // groups
        picks = ops.one_hot(topk_idx, E, ops.ones((), ms.float32), ops.zeros((), ms.float32))  # [N, k, E]
        counts = picks.sum(1).reshape(groups, T, E)  # [G, T, E] choices per token per expert
        f = counts.sum(1) * (E / (k * T))  # [G, E]
        P = scores.reshape(groups, T, E).mean(1)  # [G, E]
        l_exp = (f * P).sum(-1).mean()
        f_dev = f.reshape(groups, D, E // D).mean(-1)  # [G, D]
        P_dev = P.reshape(groups, D, E // D).sum(-1)  # [G, D]
        l_dev = (f_dev * P_dev).sum(-1).mean()
        sent = (counts.reshape(groups, T, D, E // D).sum(-1) > 0).astype(ms.float32)  # [G, T, D]
        f_com = sent.sum(1) * (D / (self.devices_per_token * T))  # [G, D]
        l_com = (f_com * P_dev).sum(-1).mean()
        load = counts.reshape(-1, E).sum(0) / (groups * T * k)  # [E]
        return l_exp, l_dev, l_com, load
