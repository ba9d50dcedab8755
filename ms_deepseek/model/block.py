"""Decoder layer: pre-norm MLA attention and a dense MLP or DeepSeekMoE, each with a residual.

The same layer runs training, prefill and decode steps: the optional latent cache
arguments go straight to the attention (see ``MLAttention.construct``).
"""

from __future__ import annotations

import mindspore as ms
from mindspore import nn, ops

from ms_deepseek.config.model import DeepseekV2Config
from ms_deepseek.model.layers import MLP, RMSNorm, to_ms_dtype
from ms_deepseek.model.mla import MLAttention
from ms_deepseek.model.moe import DeepseekV2MoE


class DecoderLayer(nn.Cell):
    def __init__(self, cfg: DeepseekV2Config, layer_index: int):
        super().__init__()
        pdt = to_ms_dtype(cfg.param_dtype)
        self.layer_index = layer_index
        self.is_moe = cfg.is_moe_layer(layer_index)
        self.num_experts = cfg.n_routed_experts or 0
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, pdt)
        self.self_attn = MLAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, pdt)
        if self.is_moe:
            self.mlp = DeepseekV2MoE(cfg)
        else:
            self.mlp = MLP(
                cfg.hidden_size, cfg.intermediate_size, cfg.initializer_range, to_ms_dtype(cfg.compute_dtype), pdt
            )
        # The residual sums and the casts into them are named primitives, split like the hidden stream
        # (the plan's ``residual_add`` / ``hidden_cast`` styles; why: ``RMSNorm``).
        self.attn_cast = ops.Cast()
        self.attn_residual = ops.Add()
        self.mlp_cast = ops.Cast()
        self.mlp_residual = ops.Add()

    def construct(self, x, cos, sin, mask, cache=None, cache_index=None, prefill=False):
        """x [B, T, H] -> (x, aux scalar, stats [E + 4] or None, routing tuple or None).

        cache / cache_index / prefill: this layer's latent cache buffer and where the tokens' entries
        go, or None in training (see ``MLAttention.construct``). A decode step of one token per row takes
        the MoE's one-token path (``DeepseekV2MoE.one_token``) and returns no routing or balance losses.
        """
        attn = self.self_attn(self.input_layernorm(x), cos, sin, mask, cache, cache_index, prefill)
        x = self.attn_residual(x, self.attn_cast(attn, x.dtype))
        h = self.post_attention_layernorm(x)
        if self.is_moe and cache is not None and self.mlp.one_token_fits(h):  # a decode step: nobody reads aux
            return (
                self.mlp_residual(x, self.mlp_cast(self.mlp.one_token(h), x.dtype)),
                ops.zeros((), ms.float32),
                None,
                None,
            )
        if self.is_moe:
            y, aux, stats, scores, idx, weight = self.mlp(h)
            return self.mlp_residual(x, self.mlp_cast(y, x.dtype)), aux, stats, (scores, idx, weight)
        return self.mlp_residual(x, self.mlp_cast(self.mlp(h), x.dtype)), ops.zeros((), ms.float32), None, None
