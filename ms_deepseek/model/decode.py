"""Cached decoding with the MLA latent KV cache (single-device math).

The cache keeps, per layer and token, only what MLA compresses the keys and values
into: ``c_kv`` (``kv_lora_rank``, after ``kv_a_layernorm``) and the shared rotated
``k_pe`` (``qk_rope_head_dim``), side by side in one preallocated buffer
``[B, max_len, kv_lora_rank + qk_rope_head_dim]`` per layer (a Parameter, updated in
place with ``scatter_nd_update``; static shapes, so in graph mode a decode step
compiles once).

Decode steps never materialise per-head keys or values (the "absorbed" form). With
``kv_b_proj.weight`` viewed as [nh, nope + v, kv_lora], W_UK = [:, :nope] and
W_UV = [:, nope:]:

  q_lat  = q_nope W_UK                               [nh, kv_lora] per query
  scores = [q_lat | q_pe] . [c_kv | k_pe]            one matmul against the cache rows
  o_lat  = probs . c_kv                              [nh, kv_lora]
  out    = o_proj(o_lat W_UV^T)

Prefill (several tokens from position 0) runs the full MLA path (``MLAttention``'s own
math) on the prompt and writes the latent entries of every prompt token into the cache.

``CachedDecoder(model, batch_size, max_len)(input_ids, start_pos, prefill)`` writes the
entries of ``input_ids`` [B, T] at positions ``start_pos .. start_pos + T - 1`` and
returns the float32 logits of the last position [B, V]. ``prefill=True`` (from position
0) uses the full path and clears the rest of the cache; otherwise the absorbed path runs
(T == 1 for a decode step; larger T works too, causal among the new tokens). Works in
PyNative and GRAPH_MODE (prefill compiles once per prompt length, the decode step once).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import mindspore as ms
from mindspore import Parameter, ParameterTuple, Tensor, nn, ops

from ms_deepseek.config import DeepseekV2Config
from ms_deepseek.model.layers import to_ms_dtype
from ms_deepseek.model.mla import MASK_VALUE, causal_mask

_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass
class CacheFigures:
    """Per-token KV-cache size of a config: the latent cache against a full per-head K/V cache."""

    layers: int
    latent_elements_per_layer: int   # kv_lora_rank + qk_rope_head_dim
    full_elements_per_layer: int     # num_heads * (qk_head_dim + v_head_dim)
    dtype: str
    latent_bytes_per_token: int      # all layers
    full_bytes_per_token: int

    @property
    def ratio(self) -> float:
        return self.full_bytes_per_token / self.latent_bytes_per_token

    def as_dict(self) -> dict:
        return {"layers": self.layers, "dtype": self.dtype,
                "latent_elements_per_layer": self.latent_elements_per_layer,
                "full_elements_per_layer": self.full_elements_per_layer,
                "latent_bytes_per_token": self.latent_bytes_per_token,
                "full_kv_bytes_per_token": self.full_bytes_per_token,
                "full_over_latent": round(self.ratio, 3)}

    def describe(self) -> str:
        return (f"latent KV cache {_human(self.latent_bytes_per_token)}/token "
                f"({self.layers} layers x {self.latent_elements_per_layer} {self.dtype}); "
                f"a full per-head K/V cache would take {_human(self.full_bytes_per_token)}/token "
                f"({self.layers} x {self.full_elements_per_layer}), {self.ratio:.1f}x more")


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover


def cache_figures(cfg: DeepseekV2Config, dtype: str = None) -> CacheFigures:
    """Bytes per token of the latent cache and of a full per-head K/V cache (``dtype``: compute dtype by default)."""
    dtype = dtype or cfg.compute_dtype
    latent = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    full = cfg.num_attention_heads * (cfg.qk_head_dim + cfg.v_head_dim)
    L, size = cfg.num_hidden_layers, _ITEMSIZE[dtype]
    return CacheFigures(layers=L, latent_elements_per_layer=latent, full_elements_per_layer=full, dtype=dtype,
                        latent_bytes_per_token=L * latent * size, full_bytes_per_token=L * full * size)


def absorbed_attention(attn, x, cos, sin, cache, mask):
    """Attention of new tokens against the latent cache, without per-head K/V.

    attn: an ``MLAttention``; x [B, T, H] (normed); cos/sin [T, rope] of the new positions;
    cache [B, S, kv_lora + rope] already holding the new tokens' entries; mask [T, S] additive.
    Returns [B, T, H] (after o_proj).
    """
    B, T = x.shape[0], x.shape[1]
    nh, nope, vd, r = attn.num_heads, attn.qk_nope, attn.v_dim, attn.kv_lora_rank
    cdt = attn.compute_dtype
    q_nope, q_pe = attn.query(x, cos, sin)  # [B, nh, T, nope], [B, nh, T, rope]
    w = attn.kv_b_proj.weight.astype(cdt).reshape(nh, nope + vd, r)  # [nh, nope + v, kv_lora]
    w_uk, w_uv = w[:, :nope, :], w[:, nope:, :]  # [nh, nope, kv_lora], [nh, v, kv_lora]
    q_nope = q_nope.astype(cdt).transpose(1, 0, 2, 3).reshape(nh, B * T, nope)  # [nh, B*T, nope]
    q_lat = ops.bmm(q_nope, w_uk)  # [nh, B*T, kv_lora]
    q_lat = q_lat.reshape(nh, B, T, r).transpose(1, 0, 2, 3)  # [B, nh, T, kv_lora]
    q = ops.concat((q_lat, q_pe.astype(cdt)), -1).reshape(B, nh * T, r + attn.qk_rope)  # [B, nh*T, kv_lora+rope]
    kv = cache.astype(cdt)
    scores = ops.bmm(q, kv.transpose(0, 2, 1))  # [B, nh*T, S]
    S = scores.shape[-1]
    scores = scores.astype(ms.float32).reshape(B, nh, T, S) * attn.scale + mask  # [B, nh, T, S]
    probs = attn.softmax(scores).reshape(B, nh * T, S)  # float32 softmax, compute dtype out
    o_lat = ops.bmm(probs, kv[:, :, :r])  # [B, nh*T, kv_lora]
    o_lat = o_lat.reshape(B, nh, T, r).transpose(1, 0, 2, 3).reshape(nh, B * T, r)  # [nh, B*T, kv_lora]
    out = ops.bmm(o_lat, w_uv.transpose(0, 2, 1))  # [nh, B*T, v]
    out = out.reshape(nh, B, T, vd).transpose(1, 2, 0, 3).reshape(B, T, nh * vd)  # [B, T, nh*v]
    return attn.o_proj(out)


def full_attention(attn, x, cos, sin, mask):
    """The training path (per-head K/V from the latent) for a prompt from position 0.

    Returns (out [B, T, H], latent entries [B, T, kv_lora + rope]).
    """
    q_nope, q_pe = attn.query(x, cos, sin)
    c_kv, k_pe = attn.latent(x, cos, sin)
    k, v = attn.expand_kv(c_kv, k_pe)
    out = attn.o_proj(attn.attend(ops.concat((q_nope, q_pe), -1), k, v, mask))
    return out, ops.concat((c_kv, k_pe.astype(c_kv.dtype)), -1)


class CachedDecoder(nn.Cell):
    """A model plus its latent cache buffers; ``decoder(input_ids, start_pos, prefill) -> logits [B, V]``.

    The model's parameters keep their names (``auto_prefix=False``), so a model wrapped
    here can still be saved or loaded by name.
    """

    def __init__(self, model, batch_size: int, max_len: int):
        super().__init__(auto_prefix=False)
        cfg: DeepseekV2Config = model.config
        self.lm = model
        self.batch_size, self.max_len = batch_size, max_len
        self.width = cfg.kv_lora_rank + cfg.qk_rope_head_dim
        self.kv_lora_rank = cfg.kv_lora_rank
        self.cache_dtype = to_ms_dtype(cfg.compute_dtype)
        self.caches = ParameterTuple(tuple(
            Parameter(Tensor(np.zeros((batch_size, max_len, self.width), np.float32), self.cache_dtype),
                      name=f"latent_cache.{i}", requires_grad=False)
            for i in range(cfg.num_hidden_layers)))
        self.figures = cache_figures(cfg)
        # Batch index of every (b, t) cache write: [B, 1] (broadcast over T inside construct).
        self.batch_index = Tensor(np.arange(batch_size, dtype=np.int32).reshape(batch_size, 1))

    def _write(self, cache, entry, positions):
        """cache[b, positions[t]] = entry[b, t]; entry [B, T, width], positions [T] int32."""
        B, T = entry.shape[0], entry.shape[1]
        rows = ops.broadcast_to(self.batch_index, (B, T))  # [B, T]
        cols = ops.broadcast_to(positions.reshape(1, T), (B, T))  # [B, T]
        index = ops.stack((rows, cols), -1)  # [B, T, 2]
        return ops.scatter_nd_update(cache, index, entry.astype(self.cache_dtype))

    def _fill(self, cache, entry):
        """Prefill: rows [0, T) = entry, every later row zero (nothing stale from an earlier sequence)."""
        B, T = entry.shape[0], entry.shape[1]
        value = entry.astype(self.cache_dtype)
        if T < self.max_len:
            value = ops.concat((value, ops.zeros((B, self.max_len - T, self.width), self.cache_dtype)), 1)
        return ops.assign(cache, value)  # [B, max_len, width]

    def construct(self, input_ids, start_pos, prefill=False):
        """input_ids [B, T] at positions start_pos.. -> logits [B, V] of the last one; writes the cache.

        prefill=True: the full MLA path, from position 0 (start_pos must be 0), resets the cache.
        prefill=False: the absorbed path against the cache (any T; causal among the new tokens).
        """
        model = self.lm.model
        B, T = input_ids.shape
        positions = ops.arange(0, T, dtype=ms.int32) + start_pos.astype(ms.int32)  # [T]
        cos, sin = model.rotary_emb(positions.astype(ms.float32))  # [T, rope]
        if prefill:
            mask = causal_mask(T, T)  # the prompt attends to itself only
        else:
            cols = ops.arange(0, self.max_len, dtype=ms.int32).reshape(1, -1)  # [1, S]
            mask = (cols > positions.reshape(-1, 1)).astype(ms.float32) * MASK_VALUE  # [T, S]
        x = model.embed_tokens(input_ids).astype(model.compute_dtype)
        i = 0
        for layer in model.layers:
            cache = self.caches[i]
            h = layer.input_layernorm(x)
            if prefill:
                attn_out, entry = full_attention(layer.self_attn, h, cos, sin, mask)
                self._fill(cache, entry)
            else:
                c_kv, k_pe = layer.self_attn.latent(h, cos, sin)
                entry = ops.concat((c_kv, k_pe.astype(c_kv.dtype)), -1)  # [B, T, kv_lora + rope]
                cache = ops.depend(cache, self._write(cache, entry, positions))  # read after the write
                attn_out = absorbed_attention(layer.self_attn, h, cos, sin, cache, mask)
            x = x + attn_out.astype(x.dtype)
            h = layer.post_attention_layernorm(x)
            if layer.is_moe:
                x = x + layer.mlp(h)[0]  # (y, aux, stats, scores, idx, weight): decoding needs y
            else:
                x = x + layer.mlp(h).astype(x.dtype)
            i += 1
        last = model.norm(x[:, T - 1:, :])  # [B, 1, H]
        return self.lm.lm_head(last).astype(ms.float32).reshape(B, -1)  # [B, V]
