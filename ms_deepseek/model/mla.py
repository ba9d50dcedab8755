"""Multi-head Latent Attention (MLA) of DeepSeek-V2, single-device math.

Shapes (B batch, T query length, S key length, nh heads):
  q:   [B, T, nh, qk_nope + qk_rope]          (q_proj, or q_a_proj -> q_a_layernorm -> q_b_proj)
  kv_a_proj_with_mqa -> [c_kv (kv_lora_rank) | k_pe (qk_rope)]; k_pe is shared by all heads
  kv_b_proj(kv_a_layernorm(c_kv)) -> per head [k_nope (qk_nope) | v (v_head)]

Primitives (for the parallel plan): ``qk_bmm`` (q @ k^T), ``pv_bmm`` (probs @ v),
``softmax`` (FP32Softmax op), plus the Linear cells' ``matmul``; with
``use_flash_attention`` (Ascend only) the causal full-sequence path is one
``flash_attention`` (FlashAttentionScore) primitive instead, the same math fused.
"""

from __future__ import annotations

import numpy as np
import mindspore as ms
from mindspore import Tensor, nn, ops

from ms_deepseek.config import DeepseekV2Config, softmax_scale
from ms_deepseek.model.layers import Linear, RMSNorm, to_ms_dtype
from ms_deepseek.model.rope import apply_rotary
from ms_deepseek.ops import FP32Softmax

MASK_VALUE = -1e30  # additive causal mask; exp() of it underflows to exactly 0 in float32


class MLAttention(nn.Cell):
    def __init__(self, cfg: DeepseekV2Config):
        super().__init__()
        cdt, pdt = to_ms_dtype(cfg.compute_dtype), to_ms_dtype(cfg.param_dtype)
        kw = dict(init_std=cfg.initializer_range, compute_dtype=cdt, param_dtype=pdt)
        H, nh = cfg.hidden_size, cfg.num_attention_heads
        self.num_heads = nh
        self.q_lora_rank = cfg.q_lora_rank
        self.kv_lora_rank = cfg.kv_lora_rank
        self.qk_nope, self.qk_rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.qk_head_dim = cfg.qk_head_dim
        self.scale = softmax_scale(cfg)
        self.compute_dtype = cdt
        if cfg.q_lora_rank is None:
            self.q_proj = Linear(H, nh * self.qk_head_dim, **kw)
        else:
            self.q_a_proj = Linear(H, cfg.q_lora_rank, bias=cfg.attention_bias, **kw)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, eps=1e-6, param_dtype=pdt)
            self.q_b_proj = Linear(cfg.q_lora_rank, nh * self.qk_head_dim, **kw)
        self.kv_a_proj_with_mqa = Linear(H, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=cfg.attention_bias, **kw)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, eps=1e-6, param_dtype=pdt)
        self.kv_b_proj = Linear(cfg.kv_lora_rank, nh * (cfg.qk_nope_head_dim + cfg.v_head_dim), **kw)
        self.o_proj = Linear(nh * cfg.v_head_dim, H, bias=cfg.attention_bias, **kw)
        self.qk_bmm = ops.BatchMatMul(transpose_b=True)
        self.pv_bmm = ops.BatchMatMul()
        self.softmax = FP32Softmax(out_dtype=cdt)
        self.use_flash_attention = cfg.use_flash_attention
        if cfg.use_flash_attention:
            from mindspore.ops.operations.nn_ops import FlashAttentionScore

            # Causal via sparse_mode 2 (left-up causal) with the compressed 2048 x 2048 mask
            # (1 = masked); q/k/v share one head size, so v is zero-padded to it (or q/k to v's).
            self.fa_head_dim = max(self.qk_head_dim, self.v_dim)
            self.flash_attention = FlashAttentionScore(head_num=nh, keep_prob=1.0, scale_value=self.scale,
                                                       pre_tokens=2147483647, next_tokens=0, inner_precise=0,
                                                       input_layout="BNSD", sparse_mode=2)
            self.fa_mask = Tensor(np.triu(np.ones((2048, 2048), np.uint8), 1))

    # ------------------------------------------------------------------ pieces
    def query(self, x, cos, sin):
        """x [B, T, H] -> q_nope [B, nh, T, nope], q_pe [B, nh, T, rope] (rotated)."""
        B, T = x.shape[0], x.shape[1]
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.reshape(B, T, self.num_heads, self.qk_head_dim).transpose(0, 2, 1, 3)  # [B, nh, T, qk]
        q_nope, q_pe = q[..., : self.qk_nope], q[..., self.qk_nope:]
        return q_nope, apply_rotary(q_pe, cos, sin)

    def latent(self, x, cos, sin):
        """x [B, T, H] -> c_kv [B, T, kv_lora] (normed), k_pe [B, T, rope] (rotated): the latent cache entry."""
        ckv = self.kv_a_proj_with_mqa(x)  # [B, T, kv_lora + rope]
        c_kv, k_pe = ckv[..., : self.kv_lora_rank], ckv[..., self.kv_lora_rank:]
        return self.kv_a_layernorm(c_kv), apply_rotary(k_pe, cos, sin)

    def expand_kv(self, c_kv, k_pe):
        """Latent -> per-head keys [B, nh, S, qk] and values [B, nh, S, v]."""
        B, S = c_kv.shape[0], c_kv.shape[1]
        kv = self.kv_b_proj(c_kv).reshape(B, S, self.num_heads, self.qk_nope + self.v_dim)
        kv = kv.transpose(0, 2, 1, 3)  # [B, nh, S, nope + v]
        k_nope, v = kv[..., : self.qk_nope], kv[..., self.qk_nope:]
        k_pe = ops.broadcast_to(k_pe.reshape(B, 1, S, self.qk_rope), (B, self.num_heads, S, self.qk_rope))
        return ops.concat((k_nope, k_pe.astype(k_nope.dtype)), -1), v

    def attend(self, q, k, v, mask):
        """q [B, nh, T, d], k [B, nh, S, d], v [B, nh, S, dv], additive mask [T, S] -> [B, T, nh*dv]."""
        B, T = q.shape[0], q.shape[2]
        scores = self.qk_bmm(q.astype(self.compute_dtype), k.astype(self.compute_dtype))  # [B, nh, T, S]
        scores = scores.astype(ms.float32) * self.scale + mask
        probs = self.softmax(scores)  # float32 softmax, cast to compute dtype
        out = self.pv_bmm(probs, v.astype(self.compute_dtype))  # [B, nh, T, dv]
        return out.transpose(0, 2, 1, 3).reshape(B, T, self.num_heads * self.v_dim)

    def flash_attend(self, q, k, v):
        """Causal attention fused on Ascend: q, k [B, nh, T, qk], v [B, nh, T, dv] -> [B, T, nh*dv]."""
        B, T, D = q.shape[0], q.shape[2], self.fa_head_dim
        cdt = self.compute_dtype
        q, k, v = (self._pad_head(t.astype(cdt), D) for t in (q, k, v))  # [B, nh, T, D]
        _, _, _, out = self.flash_attention(q, k, v, None, None, None, self.fa_mask, None, None, None)
        out = out[..., : self.v_dim]  # [B, nh, T, dv]
        return out.transpose(0, 2, 1, 3).reshape(B, T, self.num_heads * self.v_dim)

    @staticmethod
    def _pad_head(t, size: int):
        extra = size - t.shape[-1]
        if extra == 0:
            return t
        return ops.concat((t, ops.zeros(t.shape[:-1] + (extra,), t.dtype)), -1)  # zeros leave q.k unchanged

    # ----------------------------------------------------------------- forward
    def construct(self, x, cos, sin, mask):
        """Full (training / prefill) attention. x [B, T, H]; cos/sin [T, rope]; mask [T, T] additive."""
        q_nope, q_pe = self.query(x, cos, sin)
        c_kv, k_pe = self.latent(x, cos, sin)
        k, v = self.expand_kv(c_kv, k_pe)
        q = ops.concat((q_nope, q_pe), -1)
        if self.use_flash_attention:
            return self.o_proj(self.flash_attend(q, k, v))
        return self.o_proj(self.attend(q, k, v, mask))


def causal_mask(q_len: int, k_len: int, offset=0):
    """Additive mask [q_len, k_len]: 0 where key position <= query position + offset, MASK_VALUE elsewhere."""
    rows = ops.arange(0, q_len, dtype=ms.int32).reshape(-1, 1) + offset
    cols = ops.arange(0, k_len, dtype=ms.int32).reshape(1, -1)
    return (cols > rows).astype(ms.float32) * MASK_VALUE
