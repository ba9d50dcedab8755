"""Cached decoding with the MLA latent KV cache (single-device math).

The cache keeps, per layer and token, only what MLA compresses the keys and values
into: ``c_kv`` (``kv_lora_rank``, after ``kv_a_layernorm``) and the shared rotated
``k_pe`` (``qk_rope_head_dim``), side by side in one preallocated buffer
``[B, max_len, kv_lora_rank + qk_rope_head_dim]`` per layer (a Parameter, updated in
place with ``scatter_nd_update``; static shapes, so in graph mode a decode step
compiles once).

There is no second layer stack here: :class:`CachedDecoder` owns the buffers and runs
the training model's own ``DeepseekV2Model.construct`` with them (``caches=``,
``start_pos=``, ``prefill=``). Each ``MLAttention`` writes its layer's entries and, on
decode steps, attends in the absorbed-weight form (``MLAttention.absorbed``: no
per-head keys or values); prefill (the prompt from position 0) runs the full attention
of training and fills the buffer.

``CachedDecoder(model, batch_size, max_len)(input_ids, start_pos, prefill)`` writes the
entries of ``input_ids`` [B, T] at positions ``start_pos .. start_pos + T - 1`` and
returns the float32 logits of the last position [B, V]. ``prefill=True`` (from position
0) uses the full path and clears the rest of the cache; otherwise the absorbed path runs
(T == 1 for a decode step; larger T works too, causal among the new tokens). Works in
PyNative and GRAPH_MODE (prefill compiles once per prompt length, the decode step once; ``generate`` pads
prompts to a few bucketed lengths, ``last`` picking the real last position).
"""

from __future__ import annotations

from dataclasses import dataclass

import mindspore as ms
import numpy as np
from mindspore import Parameter, ParameterTuple, Tensor, nn, ops

from ms_deepseek.config.model import DeepseekV2Config
from ms_deepseek.core.dtypes import itemsize
from ms_deepseek.model.layers import to_ms_dtype


@dataclass
class CacheFigures:
    """Per-token KV-cache size of a config: the latent cache against a full per-head K/V cache."""

    layers: int
    latent_elements_per_layer: int  # kv_lora_rank + qk_rope_head_dim
    full_elements_per_layer: int  # num_heads * (qk_head_dim + v_head_dim)
    dtype: str
    latent_bytes_per_token: int  # all layers
    full_bytes_per_token: int

    @property
    def ratio(self) -> float:
        return self.full_bytes_per_token / self.latent_bytes_per_token

    def as_dict(self) -> dict:
        return {
            "layers": self.layers,
            "dtype": self.dtype,
            "latent_elements_per_layer": self.latent_elements_per_layer,
            "full_elements_per_layer": self.full_elements_per_layer,
            "latent_bytes_per_token": self.latent_bytes_per_token,
            "full_kv_bytes_per_token": self.full_bytes_per_token,
            "full_over_latent": round(self.ratio, 3),
        }

    def describe(self) -> str:
        return (
            f"latent KV cache {_human(self.latent_bytes_per_token)}/token "
            f"({self.layers} layers x {self.latent_elements_per_layer} {self.dtype}); "
            f"a full per-head K/V cache would take {_human(self.full_bytes_per_token)}/token "
            f"({self.layers} x {self.full_elements_per_layer}), {self.ratio:.1f}x more"
        )


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
    L, size = cfg.num_hidden_layers, itemsize(dtype)
    return CacheFigures(
        layers=L,
        latent_elements_per_layer=latent,
        full_elements_per_layer=full,
        dtype=dtype,
        latent_bytes_per_token=L * latent * size,
        full_bytes_per_token=L * full * size,
    )


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
        width = cfg.kv_lora_rank + cfg.qk_rope_head_dim
        dtype = to_ms_dtype(cfg.compute_dtype)
        self.caches = ParameterTuple(
            tuple(
                Parameter(
                    Tensor(np.zeros((batch_size, max_len, width), np.float32), dtype),
                    name=f"latent_cache.{i}",
                    requires_grad=False,
                )
                for i in range(cfg.num_hidden_layers)
            )
        )
        self.figures = cache_figures(cfg)

    def construct(self, input_ids, start_pos, prefill=False, last=None):
        """input_ids [B, T] at positions start_pos.. -> logits [B, V] of the last one; writes the cache.

        prefill=True: the full MLA path, from position 0 (start_pos must be 0), resets the cache.
        prefill=False: the absorbed path against the cache (any T; causal among the new tokens).
        ``last`` (int32 scalar Tensor): the logits of that index of ``input_ids`` instead of the last one, for
        a prompt padded to a bucketed length (causal attention and dropless MoE keep the padding after it
        invisible to it; its cache rows are overwritten by the decode steps before any query reads them).
        """
        B, T = input_ids.shape
        hidden = self.lm.model(input_ids, start_pos.astype(ms.int32), self.caches, prefill)[0]  # [B, T, H]
        if last is None:
            hidden = hidden[:, T - 1 :, :]  # [B, 1, H]
        else:
            hidden = ops.gather(hidden, last.astype(ms.int32).reshape(1), 1)  # [B, 1, H]
        return self.lm.lm_head(hidden).astype(ms.float32).reshape(B, -1)  # [B, V]
