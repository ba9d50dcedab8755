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

import numpy as np
from mindspore import Tensor, nn, ops

from ms_deepseek.config.model import DeepseekV2Config


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
    """cos/sin [T, dim] (half-rotation layout) for given positions."""

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

    def construct(self, positions):
        # positions: [T] float32
        freqs = self.freq_mul(positions.reshape(-1, 1), self.inv_freq)  # [T, 1] x [1, dim/2] -> [T, dim/2]
        emb = self.concat((freqs, freqs))  # [T, dim]
        return self.cos(emb) * self.mscale, self.sin(emb) * self.mscale


def apply_rotary(x, cos, sin):
    """x [..., T, dim] (interleaved pairs) -> rotated, in de-interleaved half-rotation layout.

    cos/sin: [T, dim], broadcast over the leading axes.
    """
    dim = x.shape[-1]
    lead = x.shape[:-1]
    x = x.reshape(lead + (dim // 2, 2)).swapaxes(-1, -2).reshape(lead + (dim,))  # [..., (evens|odds)]
    x1, x2 = x[..., : dim // 2], x[..., dim // 2 :]
    rotated = ops.concat((-x2, x1), -1)  # rotate_half
    return x * cos.astype(x.dtype) + rotated * sin.astype(x.dtype)
