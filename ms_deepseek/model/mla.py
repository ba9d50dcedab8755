"""Multi-head Latent Attention (MLA) of DeepSeek-V2, single-device math.

Shapes (B batch, T query length, S key length, nh heads):
  q:   [B, T, nh, qk_nope + qk_rope]          (q_proj, or q_a_proj -> q_a_layernorm -> q_b_proj)
  kv_a_proj_with_mqa -> [c_kv (kv_lora_rank) | k_pe (qk_rope)]; k_pe is shared by all heads
  kv_b_proj(kv_a_layernorm(c_kv)) -> per head [k_nope (qk_nope) | v (v_head)]

Primitives (for the parallel plan): ``qk_bmm`` (q @ k^T), ``pv_bmm`` (probs @ v),
``softmax`` (FP32Softmax: ops.Softmax on Ascend, see ``MLAttention.__init__``), plus the Linear cells' ``matmul``; with
``use_flash_attention`` (Ascend only) the causal full-sequence path is one
``flash_attention`` (FlashAttentionScore) primitive instead, the same math fused. Every other
operation on a per-head tensor is a primitive attribute too (``to_heads``, ``head_slice``,
``head_concat``, ..., and the two ``RotaryApply`` cells), so that the plan splits it by heads: see
``MLAttention.__init__``.

One class serves training, prefill and decoding: ``construct`` takes an optional latent
cache (one buffer per layer, ``[B, max_len, kv_lora_rank + qk_rope_head_dim]``: c_kv after
``kv_a_layernorm`` and the rotated k_pe, side by side). Training and prefill run the full
path; a decode step writes its entries into the cache and attends in the absorbed-weight
form (no per-head K/V), see :meth:`MLAttention.absorbed`.
"""

from __future__ import annotations

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn, ops

from ms_deepseek.config.model import DeepseekV2Config
from ms_deepseek.model.layers import Linear, RMSNorm, to_ms_dtype
from ms_deepseek.model.rope import RotaryApply, softmax_scale
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
        self.scale_value = Tensor(self.scale, ms.float32)  # a 0-d input of ``score_scale`` (strategy ``()``)
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
        # The per-head operations as primitive attributes, for the plan's ``attention_heads`` style (heads by tp).
        # Under a pipeline MindSpore compiles in ``semi_auto``, where an operation without a strategy splits its
        # first axis only (B = 1 per micro-batch): v2-sft-64npu's compiled graph gathered q and kv of all 128
        # heads onto each of its 8 tensor-parallel ranks, ran the transposes, slices and rotary there, and the
        # slices' gradients at the global shape, all alive at the peak. MindFormers' MLA (parallel_core
        # ``MLASelfAttention.shard_self_attn``) shards its split, tile and concat the same way.
        self.to_heads = ops.Transpose()  # [B, T, nh, d] -> [B, nh, T, d]
        self.from_heads = ops.Transpose()  # [B, nh, T, d] -> [B, T, nh, d]
        self.head_slice = ops.StridedSlice()  # a range of the last axis of [B, nh, T, d]
        self.head_concat = ops.Concat(-1)
        self.head_cast = ops.Cast()
        self.pe_tile = ops.Tile()  # the shared k_pe [B, 1, S, rope] -> every head
        self.latent_slice = ops.StridedSlice()  # [B, T, kv_lora + rope] -> c_kv, k_pe (no head axis)
        self.score_cast = ops.Cast()
        self.score_scale = ops.Mul()
        self.score_mask = ops.Add()
        self.q_rotary = RotaryApply()  # q_pe [B, nh, T, rope]
        self.k_rotary = RotaryApply()  # k_pe [B, T, rope], shared by the heads
        self.qk_bmm = ops.BatchMatMul(transpose_b=True)
        self.pv_bmm = ops.BatchMatMul()
        # The scores arrive in float32 (score_cast before the scale and the mask; the absorbed decode path
        # too), so on Ascend this is MindSpore's own Softmax, as the router's (FP32Softmax's doc), not our
        # Ascend C kernel: the kernel's one gain, 16-bit input computed in float32, does not apply (both
        # compute in float32); MindSpore's Softmax differentiates into one fused SoftmaxBackward op
        # (grad_nn_ops.cc, REG_BPROP_BUILDER("Softmax")), where the custom op's backward is four built-in
        # ops over the [B, nh, T, S] float32 scores (ops/ascend.py, FP32SoftmaxAscend); at S = 4096 a UB
        # tile of the kernel holds two rows (fp32_softmax_tiling_logic.h), too few for its one SoftMax API
        # call per tile to gain from normalising many rows per vector instruction. MindFormers' training
        # attention does the same: a float32 cast, then P.Softmax (parallel_core/training_graph/transformer/
        # fused_softmax.py). On CPU the kernel stays: more accurate than MindSpore's CPU Softmax.
        self.softmax = FP32Softmax(out_dtype=cdt, float32_input=True)
        self.use_flash_attention = cfg.use_flash_attention
        if cfg.use_flash_attention:
            from mindspore.ops.operations.nn_ops import FlashAttentionScore, PadV3

            # Causal via sparse_mode 2 (left-up causal) with the compressed 2048 x 2048 mask
            # (1 = masked); q/k/v share one head size, so v is zero-padded to it (or q/k to v's).
            self.fa_head_dim = max(self.qk_head_dim, self.v_dim)
            self.flash_attention = FlashAttentionScore(
                head_num=nh,
                keep_prob=1.0,
                scale_value=self.scale,
                pre_tokens=2147483647,
                next_tokens=0,
                inner_precise=0,
                input_layout="BNSD",
                sparse_mode=2,
            )
            self.fa_mask = Tensor(np.triu(np.ones((2048, 2048), np.uint8), 1))
            # The zero columns that pad q/k/v to one head size are added at run time by PadV3 (parallel-aware:
            # MindSpore's ops_info/pad_info.h PadV3Info). A zeros constant of the padded shape is folded by the
            # compiler at the graph's global batch ([B, nh, T, 64] bf16 per layer and micro-batch, B = 32 on
            # v2-pretrain-256npu), held in host memory through the compile and on the device
            # after it; MindFormers' Tile of a small zero block is folded too (the compiler runs the Tile).
            self.pad_head_op = PadV3(mode="constant", paddings_contiguous=True)
            self.pad_value = Tensor(0.0, cdt)  # the kernels want the fill value in the padded tensor's dtype

    # ------------------------------------------------------------------ pieces
    def query(self, x, cos, sin):
        """x [B, T, H] -> q_nope [B, nh, T, nope], q_pe [B, nh, T, rope] (rotated)."""
        B, T = x.shape[0], x.shape[1]
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = self.to_heads(q.reshape(B, T, self.num_heads, self.qk_head_dim), (0, 2, 1, 3))  # [B, nh, T, qk]
        q_nope, q_pe = self._cut(q, 0, self.qk_nope), self._cut(q, self.qk_nope, self.qk_head_dim)
        return q_nope, self.q_rotary(q_pe, cos, sin)

    def latent(self, x, cos, sin):
        """x [B, T, H] -> c_kv [B, T, kv_lora] (normed), k_pe [B, T, rope] (rotated): the latent cache entry."""
        ckv = self.kv_a_proj_with_mqa(x)  # [B, T, kv_lora + rope]
        B, T, r, width = ckv.shape[0], ckv.shape[1], self.kv_lora_rank, ckv.shape[2]
        c_kv = self.latent_slice(ckv, (0, 0, 0), (B, T, r), (1, 1, 1))  # [B, T, kv_lora]
        k_pe = self.latent_slice(ckv, (0, 0, r), (B, T, width), (1, 1, 1))  # [B, T, rope]
        return self.kv_a_layernorm(c_kv), self.k_rotary(k_pe, cos, sin)

    def expand_kv(self, c_kv, k_pe):
        """Latent -> per-head keys [B, nh, S, qk] and values [B, nh, S, v]."""
        B, S = c_kv.shape[0], c_kv.shape[1]
        kv = self.kv_b_proj(c_kv).reshape(B, S, self.num_heads, self.qk_nope + self.v_dim)
        kv = self.to_heads(kv, (0, 2, 1, 3))  # [B, nh, S, nope + v]
        k_nope, v = self._cut(kv, 0, self.qk_nope), self._cut(kv, self.qk_nope, self.qk_nope + self.v_dim)
        k_pe = k_pe.astype(k_nope.dtype).reshape(B, 1, S, self.qk_rope)  # [B, 1, S, rope]
        k_pe = self.pe_tile(k_pe, (1, self.num_heads, 1, 1))  # [B, nh, S, rope]
        return self.head_concat((k_nope, k_pe)), v

    def _cut(self, x, start: int, stop: int):
        """x [B, nh, T, d] -> x[..., start:stop]."""
        B, nh, T = x.shape[0], x.shape[1], x.shape[2]
        return self.head_slice(x, (0, 0, 0, start), (B, nh, T, stop), (1, 1, 1, 1))

    def attend(self, q, k, v, mask):
        """q [B, nh, T, d], k [B, nh, S, d], v [B, nh, S, dv], additive mask [T, S] -> [B, T, nh*dv]."""
        B, T = q.shape[0], q.shape[2]
        cdt = self.compute_dtype
        scores = self.qk_bmm(self.head_cast(q, cdt), self.head_cast(k, cdt))  # [B, nh, T, S]
        scores = self.score_mask(self.score_scale(self.score_cast(scores, ms.float32), self.scale_value), mask)
        probs = self.softmax(scores)  # float32 softmax, cast to compute dtype
        out = self.pv_bmm(probs, self.head_cast(v, cdt))  # [B, nh, T, dv]
        return self.from_heads(out, (0, 2, 1, 3)).reshape(B, T, self.num_heads * self.v_dim)

    def flash_attend(self, q, k, v):
        """Causal attention fused on Ascend: q, k [B, nh, T, qk], v [B, nh, T, dv] -> [B, T, nh*dv]."""
        B, T, D = q.shape[0], q.shape[2], self.fa_head_dim
        cdt = self.compute_dtype
        q, k, v = (self._pad_head(self.head_cast(t, cdt), D) for t in (q, k, v))  # [B, nh, T, D]
        _, _, _, out = self.flash_attention(q, k, v, None, None, None, self.fa_mask, None, None, None)
        out = self._cut(out, 0, self.v_dim)  # [B, nh, T, dv]
        return self.from_heads(out, (0, 2, 1, 3)).reshape(B, T, self.num_heads * self.v_dim)

    def _pad_head(self, t, size: int):
        """[B, nh, S, d] -> [B, nh, S, size]: zero columns after d (zeros leave q.k and p@v's first d unchanged)."""
        extra = size - t.shape[-1]
        if extra == 0:
            return t
        return self.pad_head_op(t, (0, extra), self.pad_value)  # [B, nh, S, size]

    # ------------------------------------------------------------ latent cache
    @staticmethod
    def write_cache(cache, entry, cache_index):
        """cache[b, p] = entry[b, t] for cache_index[b, t] = (b, p); cache [B, S, kv_lora + rope],
        entry [B, T, width], cache_index [B, T, 2] int32 (built once per step by the model)."""
        return ops.scatter_nd_update(cache, cache_index, entry.astype(cache.dtype))

    @staticmethod
    def fill_cache(cache, entry):
        """Prefill: rows [0, T) = entry, every later row zero (nothing stale from an earlier sequence)."""
        B, T, S = entry.shape[0], entry.shape[1], cache.shape[1]
        value = entry.astype(cache.dtype)
        if T < S:
            value = ops.concat((value, ops.zeros((B, S - T, cache.shape[2]), cache.dtype)), 1)  # [B, S, width]
        return ops.assign(cache, value)

    def absorbed(self, q_nope, q_pe, cache, mask):
        """New queries against the latent cache without per-head K/V (the "absorbed" form).

        With kv_b_proj's matrix (``Linear.effective_weight``) viewed as [nh, nope + v, kv_lora], W_UK = [:, :nope],
        W_UV = [:, nope:]:
        q_lat = q_nope W_UK; scores = [q_lat | q_pe] . [c_kv | k_pe]; o_lat = probs . c_kv; out = o_lat W_UV^T.
        q_nope [B, nh, T, nope], q_pe [B, nh, T, rope], cache [B, S, kv_lora + rope], mask [T, S] additive
        -> [B, T, nh*v] (before o_proj).
        """
        B, T = q_nope.shape[0], q_nope.shape[2]
        nh, nope, vd, r = self.num_heads, self.qk_nope, self.v_dim, self.kv_lora_rank
        cdt = self.compute_dtype
        # the matrix kv_b_proj applies: a LoRA adapter's B A added, a quantised weight dequantised
        w = self.kv_b_proj.effective_weight(cdt).reshape(nh, nope + vd, r)  # [nh, nope + v, kv_lora]
        w_uk, w_uv = w[:, :nope, :], w[:, nope:, :]  # [nh, nope, kv_lora], [nh, v, kv_lora]
        q_nope = q_nope.astype(cdt).transpose(1, 0, 2, 3).reshape(nh, B * T, nope)  # [nh, B*T, nope]
        q_lat = ops.bmm(q_nope, w_uk)  # [nh, B*T, kv_lora]
        q_lat = q_lat.reshape(nh, B, T, r).transpose(1, 0, 2, 3)  # [B, nh, T, kv_lora]
        q = ops.concat((q_lat, q_pe.astype(cdt)), -1).reshape(B, nh * T, r + self.qk_rope)  # [B, nh*T, kv_lora+rope]
        kv = cache.astype(cdt)
        scores = ops.bmm(q, kv.transpose(0, 2, 1))  # [B, nh*T, S]
        S = scores.shape[-1]
        scores = scores.astype(ms.float32).reshape(B, nh, T, S) * self.scale + mask  # [B, nh, T, S]
        probs = self.softmax(scores).reshape(B, nh * T, S)  # float32 softmax, compute dtype out
        o_lat = ops.bmm(probs, kv[:, :, :r])  # [B, nh*T, kv_lora]
        o_lat = o_lat.reshape(B, nh, T, r).transpose(1, 0, 2, 3).reshape(nh, B * T, r)  # [nh, B*T, kv_lora]
        out = ops.bmm(o_lat, w_uv.transpose(0, 2, 1))  # [nh, B*T, v]
        return out.reshape(nh, B, T, vd).transpose(1, 2, 0, 3).reshape(B, T, nh * vd)  # [B, T, nh*v]

    # ----------------------------------------------------------------- forward
    def construct(self, x, cos, sin, mask, cache=None, cache_index=None, prefill=False):
        """x [B, T, H] (normed) -> [B, T, H]; cos/sin [T, rope] of the tokens' positions; mask additive.

        cache None (training): full attention, mask [T, T].
        cache [B, S, kv_lora + rope] (a Parameter, updated in place):
          prefill=True  (positions 0..T-1): the same full attention, mask [T, T]; the cache gets these
                        entries and zeros after them;
          prefill=False: the tokens' entries are written at ``cache_index`` [B, T, 2] (batch row,
                        position), then the absorbed form attends
                        over the whole buffer, mask [T, S] (rows past each query's position masked).
        """
        q_nope, q_pe = self.query(x, cos, sin)
        c_kv, k_pe = self.latent(x, cos, sin)
        if cache is not None and not prefill:
            entry = ops.concat((c_kv, k_pe.astype(c_kv.dtype)), -1)  # [B, T, kv_lora + rope]
            cache = ops.depend(cache, self.write_cache(cache, entry, cache_index))  # read after the write
            return self.o_proj(self.absorbed(q_nope, q_pe, cache, mask))
        if cache is not None:
            self.fill_cache(cache, ops.concat((c_kv, k_pe.astype(c_kv.dtype)), -1))
        k, v = self.expand_kv(c_kv, k_pe)
        q = self.head_concat((q_nope, q_pe))  # [B, nh, T, qk]; q_pe has q's dtype
        if self.use_flash_attention:
            return self.o_proj(self.flash_attend(q, k, v))
        return self.o_proj(self.attend(q, k, v, mask))


class CausalMask(nn.Cell):
    """Additive mask [q_len, k_len]: 0 where key position <= query position + offset, MASK_VALUE elsewhere.

    Training and prefill: ``mask(T, T)``; a decode step of T tokens from position p against a cache of S rows:
    ``mask(T, S, p)`` (p may be a Tensor). Built once per forward for every layer, by named primitives the plan
    keeps whole on every device (style ``causal_mask``): for the same reason as the rotary table
    (``rope.RotaryEmbedding``), no layer's recomputed attention may hold an operation on it."""

    def __init__(self):
        super().__init__()
        self.later = ops.Greater()
        self.cast = ops.Cast()
        self.scale = ops.Mul()
        self.mask_value = Tensor(MASK_VALUE, ms.float32)  # a 0-d input of ``scale`` (strategy ``()``)

    def construct(self, q_len: int, k_len: int, offset=0):
        rows = ops.arange(0, q_len, dtype=ms.int32).reshape(-1, 1) + offset  # [q_len, 1]
        cols = ops.arange(0, k_len, dtype=ms.int32).reshape(1, -1)  # [1, k_len]
        return self.scale(self.cast(self.later(cols, rows), ms.float32), self.mask_value)
