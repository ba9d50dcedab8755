"""The expected tensors of a DeepSeek-V2 checkpoint, name -> shape, computed from its config.

One table, two layouts:

* :func:`expected_hf_shapes`: the released HuggingFace layout (per-expert tensors),
* :func:`expected_ms_shapes`: ours (routed experts stacked per layer, [E, out, in]).

Shapes follow the released modeling code (and transformers' native port): linear
weights are [out, in]; ``q_proj`` without q compression, else ``q_a_proj`` ->
``q_a_layernorm`` -> ``q_b_proj``; with ``attention_bias`` the projections that read
the hidden state or write it (``q_a_proj``/``kv_a_proj_with_mqa``/``o_proj``) carry a
bias, never ``q_proj``, ``q_b_proj`` or ``kv_b_proj``; shared experts are one MLP of
width ``moe_intermediate_size * n_shared_experts``; ``lm_head`` is absent when tied.

Importable without MindSpore (``from_pretrained`` and the converter both use it).
"""

from __future__ import annotations

from typing import Dict, Tuple

from ms_deepseek.config import DeepseekV2Config
from ms_deepseek.convert import names

Shape = Tuple[int, ...]


def _attention(cfg: DeepseekV2Config, p: str) -> Dict[str, Shape]:
    H, nh = cfg.hidden_size, cfg.num_attention_heads
    out: Dict[str, Shape] = {}
    if cfg.q_lora_rank is None:
        out[f"{p}.q_proj.weight"] = (nh * cfg.qk_head_dim, H)
    else:
        out[f"{p}.q_a_proj.weight"] = (cfg.q_lora_rank, H)
        if cfg.attention_bias:
            out[f"{p}.q_a_proj.bias"] = (cfg.q_lora_rank,)
        out[f"{p}.q_a_layernorm.weight"] = (cfg.q_lora_rank,)
        out[f"{p}.q_b_proj.weight"] = (nh * cfg.qk_head_dim, cfg.q_lora_rank)
    out[f"{p}.kv_a_proj_with_mqa.weight"] = (cfg.kv_lora_rank + cfg.qk_rope_head_dim, H)
    if cfg.attention_bias:
        out[f"{p}.kv_a_proj_with_mqa.bias"] = (cfg.kv_lora_rank + cfg.qk_rope_head_dim,)
    out[f"{p}.kv_a_layernorm.weight"] = (cfg.kv_lora_rank,)
    out[f"{p}.kv_b_proj.weight"] = (nh * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank)
    out[f"{p}.o_proj.weight"] = (H, nh * cfg.v_head_dim)
    if cfg.attention_bias:
        out[f"{p}.o_proj.bias"] = (H,)
    return out


def _mlp(p: str, hidden: int, inter: int) -> Dict[str, Shape]:
    return {f"{p}.gate_proj.weight": (inter, hidden), f"{p}.up_proj.weight": (inter, hidden),
            f"{p}.down_proj.weight": (hidden, inter)}


def expected_hf_shapes(cfg: DeepseekV2Config) -> Dict[str, Shape]:
    """Every tensor of a HuggingFace-layout checkpoint for ``cfg``, in model order."""
    return _expected(cfg, stacked=False)


def expected_ms_shapes(cfg: DeepseekV2Config) -> Dict[str, Shape]:
    """Every parameter of the ms_deepseek layout for ``cfg`` (routed experts stacked), in model order."""
    return _expected(cfg, stacked=True)


def _expected(cfg: DeepseekV2Config, stacked: bool) -> Dict[str, Shape]:
    H = cfg.hidden_size
    out: Dict[str, Shape] = {"model.embed_tokens.weight": (cfg.vocab_size, H)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}"
        out[f"{p}.input_layernorm.weight"] = (H,)
        out.update(_attention(cfg, f"{p}.self_attn"))
        out[f"{p}.post_attention_layernorm.weight"] = (H,)
        if not cfg.is_moe_layer(i):
            out.update(_mlp(f"{p}.mlp", H, cfg.intermediate_size))
            continue
        E, inter = cfg.n_routed_experts, cfg.moe_intermediate_size
        out[f"{p}.mlp.gate.weight"] = (E, H)
        if stacked:
            for name, shape in _mlp(f"{p}.mlp.experts", H, inter).items():
                out[name] = (E,) + shape
        else:
            for e in range(E):
                out.update(_mlp(f"{p}.mlp.experts.{e}", H, inter))
        if cfg.n_shared_experts:
            out.update(_mlp(f"{p}.mlp.shared_experts", H, inter * cfg.n_shared_experts))
    out["model.norm.weight"] = (H,)
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (cfg.vocab_size, H)
    return out


def ms_buffer_shapes(cfg: DeepseekV2Config) -> Dict[str, Shape]:
    """Non-weight model state a training checkpoint may hold (``save_checkpoint(model)`` writes every
    Parameter): the per-MoE-layer ``expert_placement`` table [E, 2] (EP rank, local slot), int32.

    Derived from the parallel plan, so it has no HuggingFace counterpart: ms-to-hf checks its
    shape and drops it; it is never required.
    """
    return {f"model.layers.{i}.mlp.expert_placement": (cfg.n_routed_experts, 2) for i in cfg.moe_layer_indices}


def zero_width_shapes(cfg: DeepseekV2Config) -> Dict[str, Shape]:
    """Tensors of width 0 that the reference code (and transformers) still save when ``n_shared_experts`` is 0:
    a shared-expert MLP of intermediate size 0. They hold no bytes; either layout may carry them or not."""
    if cfg.n_shared_experts != 0 or not cfg.has_moe:
        return {}
    out: Dict[str, Shape] = {}
    for i in cfg.moe_layer_indices:
        out.update(_mlp(f"model.layers.{i}.mlp.shared_experts", cfg.hidden_size, 0))
    return out


def layer_key(name: str) -> Tuple[int, int]:
    """Sort key grouping tensors by position in the model: embeddings, layers 0..L-1, final norm and head."""
    layer = names.layer_of(name)
    if layer is not None:
        return (1, layer)
    return (0, 0) if name.startswith("model.embed_tokens") else (2, 0)
