"""Decoupled rotary embedding of DeepSeek-V2, with YaRN.

Inverse frequencies are computed once on the host (numpy, float32, the reference
formulas); cos/sin are computed per call from the positions, so no table of
``max_position_embeddings`` rows is kept.

RoPE rotates interleaved pairs (x0, x1), (x2, x3), ... as the released checkpoints
expect. Like the original code we first de-interleave ([x0, x2, ..., x1, x3, ...])
and then apply the half-rotation form; q_pe and k_pe get the same permutation, so
q.k is unchanged and the latent cache stores k_pe in this rotated layout.
"""

from __future__ import annotations

import math
from typing import Tuple

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn, ops

from ms_deepseek.config.model import DeepseekV2Config
from ms_deepseek.core.dtypes import ms_dtype as to_ms_dtype


# ------------------------------------------------------------------------- YaRN
def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction ``0.1 * mscale * ln(scale) + 1`` (1 when the context is not stretched)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def softmax_scale(cfg: DeepseekV2Config) -> float:
    """``qk_head_dim**-0.5``, times ``yarn_mscale(factor, mscale_all_dim)**2`` under YaRN."""
    scale = cfg.qk_head_dim**-0.5
    if cfg.rope_scaling is not None:
        mscale_all_dim = cfg.rope_scaling.get("mscale_all_dim", 0)
        if mscale_all_dim:
            m = yarn_get_mscale(cfg.rope_scaling["factor"], mscale_all_dim)
            scale *= m * m
    return scale


def _yarn_correction_dim(num_rotations: float, dim: int, base: float, max_pos: int) -> float:
    return (dim * math.log(max_pos / (num_rotations * 2 * math.pi))) / (2 * math.log(base))


def rope_inv_freq(cfg: DeepseekV2Config) -> Tuple[np.ndarray, float]:
    """(inverse frequencies [dim/2] float32, cos/sin multiplier) for the config's RoPE."""
    dim, base = cfg.qk_rope_head_dim, cfg.rope_theta
    exponents = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
    freq_extra = (1.0 / (np.float32(base) ** exponents)).astype(np.float32)
    scaling = cfg.rope_scaling
    if scaling is None:
        return freq_extra, 1.0
    factor = float(scaling["factor"])
    original = int(scaling["original_max_position_embeddings"])
    beta_fast, beta_slow = float(scaling.get("beta_fast", 32)), float(scaling.get("beta_slow", 1))
    freq_inter = (1.0 / (np.float32(factor) * np.float32(base) ** exponents)).astype(np.float32)
    low = max(math.floor(_yarn_correction_dim(beta_fast, dim, base, original)), 0)
    high = min(math.ceil(_yarn_correction_dim(beta_slow, dim, base, original)), dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
    extra_mask = (1.0 - ramp).astype(np.float32)
    inv_freq = (freq_inter * (1 - extra_mask) + freq_extra * extra_mask).astype(np.float32)
    if "attention_factor" in scaling and scaling["attention_factor"] is not None:
        mscale = float(scaling["attention_factor"])
    else:
        mscale = yarn_get_mscale(factor, scaling.get("mscale", 1)) / yarn_get_mscale(
            factor, scaling.get("mscale_all_dim", 0)
        )
    return inv_freq, float(mscale)


class RotaryEmbedding(nn.Cell):
    """cos/sin [T, dim] (half-rotation layout, the compute dtype) for given positions."""

    def __init__(self, cfg: DeepseekV2Config):
        super().__init__()
        inv_freq, self.mscale = rope_inv_freq(cfg)
        self.inv_freq = Tensor(inv_freq[None, :])  # [1, dim/2]
        self.half = cfg.qk_rope_head_dim // 2
        # Primitives in attributes, so the plan can give them explicit (replicated) strategies: the table
        # depends on the positions only, and left to sharding propagation under a pipeline its reshape was
        # tied to the micro-batch's layout ("tensor_redistribution init failed": [T] positions against
        # [B, T] ids, found by compiling dp, tp, pp and ep all 2). MindFormers does the same for its rotary ops.
        self.freq_mul = ops.Mul()
        self.concat = ops.Concat(-1)
        self.cos = ops.Cos()
        self.sin = ops.Sin()
        self.mscale_value = Tensor(self.mscale, ms.float32)  # a 0-d input of ``mscale_mul`` (strategy ``()``)
        self.mscale_mul = ops.Mul()
        self.table_dtype = to_ms_dtype(cfg.compute_dtype)
        self.table_cast = ops.Cast()

    def construct(self, positions):
        # positions: [T] float32
        freqs = self.freq_mul(positions.reshape(-1, 1), self.inv_freq)  # [T, 1] x [1, dim/2] -> [T, dim/2]
        emb = self.concat((freqs, freqs))  # [T, dim]
        # Made whole on every device and in the compute dtype here, once for all layers, so that no layer's
        # recomputed attention holds an operation on the shared table. One did: the scaling, left without a
        # strategy, split the table ([4096, 64] -> [512, 64] at dp 8) and MindSpore put the AllGather back in
        # layer 0's rotary, one node (common-subexpression elimination) that every layer's attention read. That
        # joined every layer's recomputed attention into one recompute region (recompute.cc
        # InsertRecomputedNodes: GetMaxSubGraph grows a region over connected recomputed nodes, and
        # GetFirstTargetInputs gives it one start, the first backward node of its last layer), so level 1 of a
        # pipeline stage replayed every layer's attention at the start of the backward and held each until its
        # own layer's backward (docs/planner.md).
        cos = self.table_cast(self.mscale_mul(self.cos(emb), self.mscale_value), self.table_dtype)
        sin = self.table_cast(self.mscale_mul(self.sin(emb), self.mscale_value), self.table_dtype)
        return cos, sin  # [T, dim] each, in the compute dtype


class RotaryApply(nn.Cell):
    """x [..., T, dim] (interleaved pairs) -> rotated, in de-interleaved half-rotation layout.

    cos/sin: [T, dim] in x's dtype (``RotaryEmbedding`` casts them), broadcast over the leading axes. Every
    operation is a primitive attribute so that the plan can give it the split of x: under a pipeline MindSpore
    compiles in ``semi_auto``, where an operation without a strategy splits only its first axis, and on q_pe
    [B, nh, T, rope] with B = 1 that gathered all heads onto every tensor-parallel rank (v2-sft-64npu's compiled
    graph: the rotary and the slices around it on [1, 128, 4096, *] on each of 8 ranks). The plan's
    ``head_rotary`` / ``latent_rotary`` styles; MindFormers names and shards its rotary and split operations the
    same way.
    """

    def __init__(self):
        super().__init__()
        self.pair_swap = ops.Transpose()
        self.half_slice = ops.StridedSlice()
        self.neg = ops.Neg()
        self.concat = ops.Concat(-1)
        self.mul_cos = ops.Mul()
        self.mul_sin = ops.Mul()
        self.add = ops.Add()

    def construct(self, x, cos, sin):
        dim, lead = x.shape[-1], x.shape[:-1]
        n, half = len(lead), dim // 2
        x = x.reshape(lead + (half, 2))  # [..., dim/2, 2]: the interleaved pairs
        x = self.pair_swap(x, tuple(range(n)) + (n + 1, n)).reshape(lead + (dim,))  # [..., (evens|odds)]
        ones = (1,) * (n + 1)
        x1 = self.half_slice(x, (0,) * (n + 1), lead + (half,), ones)  # [..., dim/2]
        x2 = self.half_slice(x, (0,) * n + (half,), lead + (dim,), ones)  # [..., dim/2]
        rotated = self.concat((self.neg(x2), x1))  # rotate_half
        return self.add(self.mul_cos(x, cos), self.mul_sin(rotated, sin))
