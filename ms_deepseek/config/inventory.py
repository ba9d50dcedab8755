"""The one name/shape table of a DeepSeek-V2 model, computed from its config.

:func:`parameter_inventory` lists every Parameter of ``DeepseekV2ForCausalLM(cfg)`` (names,
shapes, dtypes exactly as the model builds them, routed experts stacked [E, out, in]).
Everything else reads it:

* the converter and the loaders: :func:`expected_ms_shapes` (our layout),
  :func:`expected_hf_shapes` (the released per-expert layout), :func:`ms_buffer_shapes`
  (non-weight state), :func:`zero_width_shapes`;
* the planner: shard sizes per parameter (``ms_deepseek.parallel_plan.costs`` / ``planner``);
* :func:`count_parameters`: total and activated counts are sums over the same table.

Shapes follow the released modeling code (and transformers' native port): linear
weights are [out, in]; ``q_proj`` without q compression, else ``q_a_proj`` ->
``q_a_layernorm`` -> ``q_b_proj``; with ``attention_bias`` the projections that read
the hidden state or write it (``q_a_proj``/``kv_a_proj_with_mqa``/``o_proj``) carry a
bias, never ``q_proj``, ``q_b_proj`` or ``kv_b_proj``; shared experts are one MLP of
width ``moe_intermediate_size * n_shared_experts``; ``lm_head`` is absent when tied.

Pure Python (no MindSpore import): the planner runs on machines without it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from ms_deepseek.config.model import check_model_size

Shape = Tuple[int, ...]

# The non-weight Parameter of each MoE layer: the [E, 2] int32 expert placement table (plan data).
BUFFER_SUFFIXES = ("expert_placement",)
_HF_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.((?:gate|up|down)_proj\.weight)$")
_MS_EXPERT = re.compile(r"^(model\.layers\.(\d+)\.mlp\.experts)\.((?:gate|up|down)_proj\.weight)$")


@dataclass(frozen=True)
class ParamInfo:
    name: str
    shape: Shape
    dtype: str  # "float32" | "bfloat16" | "float16" | "int32"
    trainable: bool
    layer: Optional[int]  # decoder layer index, None for embedding / final norm / head
    kind: str = "other"  # embedding | attention | norm | dense_mlp | router | routed_experts | shared_experts |
    #                       lm_head | buffer

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def is_buffer(self) -> bool:
        return self.kind == "buffer"


def parameter_inventory(cfg) -> List[ParamInfo]:
    """Every parameter of ``DeepseekV2ForCausalLM(cfg)`` in model order (the order checkpoints are written in)."""
    check_model_size(cfg)
    H, V, nh = cfg.hidden_size, cfg.vocab_size, cfg.num_attention_heads
    pdt = cfg.param_dtype
    out: List[ParamInfo] = []

    def add(name, shape, layer, kind, dtype=pdt, trainable=True):
        out.append(ParamInfo(name, tuple(int(d) for d in shape), dtype, trainable, layer, kind))

    def mlp(prefix, inter, layer, kind, experts=None):
        lead = () if experts is None else (experts,)
        add(prefix + "gate_proj.weight", lead + (inter, H), layer, kind)
        add(prefix + "up_proj.weight", lead + (inter, H), layer, kind)
        add(prefix + "down_proj.weight", lead + (H, inter), layer, kind)

    add("model.embed_tokens.weight", (V, H), None, "embedding")
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        add(p + "input_layernorm.weight", (H,), i, "norm")
        a = p + "self_attn."
        if cfg.q_lora_rank is None:
            add(a + "q_proj.weight", (nh * cfg.qk_head_dim, H), i, "attention")
        else:
            add(a + "q_a_proj.weight", (cfg.q_lora_rank, H), i, "attention")
            if cfg.attention_bias:
                add(a + "q_a_proj.bias", (cfg.q_lora_rank,), i, "attention")
            add(a + "q_a_layernorm.weight", (cfg.q_lora_rank,), i, "attention")
            add(a + "q_b_proj.weight", (nh * cfg.qk_head_dim, cfg.q_lora_rank), i, "attention")
        add(a + "kv_a_proj_with_mqa.weight", (cfg.kv_lora_rank + cfg.qk_rope_head_dim, H), i, "attention")
        if cfg.attention_bias:
            add(a + "kv_a_proj_with_mqa.bias", (cfg.kv_lora_rank + cfg.qk_rope_head_dim,), i, "attention")
        add(a + "kv_a_layernorm.weight", (cfg.kv_lora_rank,), i, "attention")
        add(a + "kv_b_proj.weight", (nh * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank), i, "attention")
        add(a + "o_proj.weight", (H, nh * cfg.v_head_dim), i, "attention")
        if cfg.attention_bias:
            add(a + "o_proj.bias", (H,), i, "attention")
        add(p + "post_attention_layernorm.weight", (H,), i, "norm")
        m = p + "mlp."
        if cfg.is_moe_layer(i):
            E, inter = cfg.n_routed_experts, cfg.moe_intermediate_size
            add(m + "gate.weight", (E, H), i, "router", dtype="float32")  # the router is always float32
            mlp(m + "experts.", inter, i, "routed_experts", experts=E)
            if cfg.n_shared_experts:
                mlp(m + "shared_experts.", inter * cfg.n_shared_experts, i, "shared_experts")
            add(m + "expert_placement", (E, 2), i, "buffer", dtype="int32", trainable=False)
        else:
            mlp(m, cfg.intermediate_size, i, "dense_mlp")
    add("model.norm.weight", (H,), None, "norm")
    if not cfg.tie_word_embeddings:
        add("lm_head.weight", (V, H), None, "lm_head")
    return out


# --------------------------------------------------------------------------- checkpoint layouts
def expected_ms_shapes(cfg) -> Dict[str, Shape]:
    """Every weight of the ms_deepseek layout for ``cfg`` (routed experts stacked), in model order."""
    return {p.name: p.shape for p in parameter_inventory(cfg) if not p.is_buffer}


def expected_hf_shapes(cfg) -> Dict[str, Shape]:
    """Every tensor of a HuggingFace-layout checkpoint for ``cfg`` (per-expert tensors), in model order."""
    out: Dict[str, Shape] = {}
    experts: List[ParamInfo] = []  # the stacked gate/up/down of the current layer

    def flush():  # expert by expert, gate/up/down within each, where the stack stood
        for e in range(experts[0].shape[0] if experts else 0):
            for p in experts:
                m = _MS_EXPERT.match(p.name)
                out[f"{m.group(1)}.{e}.{m.group(3)}"] = p.shape[1:]
        experts.clear()

    for p in parameter_inventory(cfg):
        if p.kind == "routed_experts":
            experts.append(p)
            continue
        flush()
        if not p.is_buffer:
            out[p.name] = p.shape
    flush()
    return out


def ms_buffer_shapes(cfg) -> Dict[str, Shape]:
    """Non-weight model state a training checkpoint may hold (``save_checkpoint(model)`` writes every
    Parameter): the per-MoE-layer ``expert_placement`` table [E, 2] (EP rank, local slot), int32.

    Derived from the parallel plan, so it has no HuggingFace counterpart: ms-to-hf checks its
    shape and drops it; it is never required.
    """
    return {p.name: p.shape for p in parameter_inventory(cfg) if p.is_buffer}


def zero_width_shapes(cfg) -> Dict[str, Shape]:
    """Tensors of width 0 that the reference code (and transformers) still save when ``n_shared_experts`` is 0:
    a shared-expert MLP of intermediate size 0. They hold no bytes; either layout may carry them or not."""
    if cfg.n_shared_experts != 0 or not cfg.has_moe:
        return {}
    H = cfg.hidden_size
    out: Dict[str, Shape] = {}
    for i in cfg.moe_layer_indices:
        p = f"model.layers.{i}.mlp.shared_experts."
        out.update({p + "gate_proj.weight": (0, H), p + "up_proj.weight": (0, H), p + "down_proj.weight": (H, 0)})
    return out


# --------------------------------------------------------------------------- parameter counts
@dataclass
class ParamCount:
    total: int
    activated: int  # per token, excluding the input embedding (a lookup, no FLOPs), as in the paper
    embedding: int
    attention: int
    dense_mlp: int
    routed_experts: int
    shared_experts: int
    routers: int
    norms: int
    lm_head: int
    per_layer: List[int] = field(default_factory=list)

    def summary(self) -> str:
        return f"{self.total / 1e9:.2f}B total, {self.activated / 1e9:.2f}B activated per token"


def count_parameters(cfg) -> ParamCount:
    """Total and per-token activated parameter counts: sums over :func:`parameter_inventory` (buffers excluded).

    Attention layer norms (``q_a_layernorm``, ``kv_a_layernorm``) count as attention, the decoder
    and final norms as norms; a token activates ``num_experts_per_tok`` of the routed experts."""
    kinds = dict(embedding=0, attention=0, dense_mlp=0, routed_experts=0, shared_experts=0, router=0, norm=0, lm_head=0)
    check_model_size(cfg)
    per_layer = [0] * cfg.num_hidden_layers
    for p in parameter_inventory(cfg):
        if p.is_buffer:
            continue
        kinds[p.kind] += p.numel
        if p.layer is not None:
            per_layer[p.layer] += p.numel
    total = sum(kinds.values())
    routed_active = (
        kinds["routed_experts"] * cfg.num_experts_per_tok // cfg.n_routed_experts if cfg.n_routed_experts else 0
    )
    activated = total - kinds["embedding"] - kinds["routed_experts"] + routed_active
    return ParamCount(
        total=total,
        activated=activated,
        embedding=kinds["embedding"],
        attention=kinds["attention"],
        dense_mlp=kinds["dense_mlp"],
        routed_experts=kinds["routed_experts"],
        shared_experts=kinds["shared_experts"],
        routers=kinds["router"],
        norms=kinds["norm"],
        lm_head=kinds["lm_head"],
        per_layer=per_layer,
    )
