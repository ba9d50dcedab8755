"""The sharding plan for DeepSeek-V2, kept as data.

``DEEPSEEK_V2_PLAN`` maps module-path patterns (``*`` = one path component, e.g. a
layer index) to a style name. A path names either a Cell (a Linear, the embedding,
the routed experts, a norm, the router) or a primitive attribute of a Cell (the
attention batch matmuls, the MoE dispatch gathers). A style
(:mod:`ms_deepseek.parallel_plan.styles`) turns the parallel degrees into strategies and
parameter layouts.

This module is pure Python (no MindSpore import): the planner reads the same table
to size every parameter's per-NPU shard from the model's name/shape table
(:func:`ms_deepseek.config.inventory.parameter_inventory`, re-exported here).
"""

from __future__ import annotations

import re
from typing import Dict, List, Optional, Tuple

from ms_deepseek.core.errors import UserError
from ms_deepseek.parallel_plan.styles import Mesh, style_spec

# Path pattern -> style. Exactly one pattern may match any path.
DEEPSEEK_V2_PLAN: Dict[str, str] = {
    "model.embed_tokens": "vocab_embedding",
    "model.embed_cast": "hidden_cast",
    "model.rotary_emb": "rotary_table",
    "model.causal_mask": "causal_mask",
    "model.layers.*.input_layernorm": "hidden_norm",
    "model.layers.*.post_attention_layernorm": "hidden_norm",
    "model.layers.*.attn_cast": "hidden_cast",
    "model.layers.*.attn_residual": "residual_add",
    "model.layers.*.mlp_cast": "hidden_cast",
    "model.layers.*.mlp_residual": "residual_add",
    "model.layers.*.self_attn": "attention_heads",
    "model.layers.*.self_attn.q_rotary": "head_rotary",
    "model.layers.*.self_attn.k_rotary": "latent_rotary",
    "model.layers.*.self_attn.q_proj": "colwise",
    "model.layers.*.self_attn.q_a_proj": "replicate",
    "model.layers.*.self_attn.q_a_layernorm": "norm",
    "model.layers.*.self_attn.q_b_proj": "colwise",
    "model.layers.*.self_attn.kv_a_proj_with_mqa": "replicate",
    "model.layers.*.self_attn.kv_a_layernorm": "norm",
    "model.layers.*.self_attn.kv_b_proj": "colwise",
    "model.layers.*.self_attn.o_proj": "rowwise",
    "model.layers.*.self_attn.qk_bmm": "head_bmm",
    "model.layers.*.self_attn.pv_bmm": "head_bmm",
    "model.layers.*.self_attn.flash_attention": "flash_attention",
    "model.layers.*.self_attn.pad_head_op": "head_pad",
    "model.layers.*.self_attn.softmax.impl.op": "head_softmax",  # FP32Softmax (ops.Softmax on Ascend)
    "model.layers.*.mlp.gate.softmax.impl.op": "row_softmax",  # the router's FP32Softmax (ops.Softmax on Ascend)
    "model.layers.*.mlp.gate_proj": "colwise",
    "model.layers.*.mlp.up_proj": "colwise",
    "model.layers.*.mlp.down_proj": "rowwise",
    "model.layers.*.mlp.shared_experts.gate_proj": "colwise",
    "model.layers.*.mlp.shared_experts.up_proj": "colwise",
    "model.layers.*.mlp.shared_experts.down_proj": "rowwise",
    "model.layers.*.mlp.act": "swiglu",  # SiLU(gate) of a dense layer's MLP [B, T, I]
    "model.layers.*.mlp.act_mul": "swiglu_pair",  # SiLU(gate) * up
    "model.layers.*.mlp.shared_experts.act": "swiglu",
    "model.layers.*.mlp.shared_experts.act_mul": "swiglu_pair",
    "model.layers.*.mlp.gate": "router",
    "model.layers.*.mlp.experts": "experts",
    # stacked adapters (model/lora.py) on the expert rows: the dropout of each projection's input and the sum
    # of base and adapter, split like the rows they take (gate / up: [D, E, C, H]; down: [D, E, C, I])
    "model.layers.*.mlp.experts.gate_proj.lora_dropout.dropout": "expert_rows",
    "model.layers.*.mlp.experts.up_proj.lora_dropout.dropout": "expert_rows",
    "model.layers.*.mlp.experts.down_proj.lora_dropout.dropout": "expert_rows_tp",
    "model.layers.*.mlp.experts.gate_proj.lora_add": "expert_rows_tp_pair",
    "model.layers.*.mlp.experts.up_proj.lora_add": "expert_rows_tp_pair",
    "model.layers.*.mlp.experts.down_proj.lora_add": "expert_rows_pair",
    "model.layers.*.mlp.experts.gate_proj.lora_scale": "expert_rows_tp_scalar",
    "model.layers.*.mlp.experts.up_proj.lora_scale": "expert_rows_tp_scalar",
    "model.layers.*.mlp.experts.down_proj.lora_scale": "expert_rows_scalar",
    "model.layers.*.mlp.pad_tokens": "moe_pad_tokens",
    "model.layers.*.mlp.lookup.impl.op": "expert_lookup",  # ExpertLookup custom op
    "model.layers.*.mlp.slot_sort": "moe_slot_sort",
    "model.layers.*.mlp.dispatch_gather": "dispatch_gather",
    "model.layers.*.mlp.to_experts": "moe_exchange",
    "model.layers.*.mlp.from_experts": "moe_exchange",
    "model.layers.*.mlp.combine_gather": "combine_gather",
    "model.layers.*.mlp.expert_placement": "placement_table",
    # a quantized base (model/quant.py QuantStackedWeight): each expert stack's dequantisation
    "model.layers.*.mlp.experts.gate_proj": "expert_quant_colwise",
    "model.layers.*.mlp.experts.up_proj": "expert_quant_colwise",
    "model.layers.*.mlp.experts.down_proj": "expert_quant_rowwise",
    "model.norm": "hidden_norm",
    "lm_head": "vocab_head",
    "loss_fn": "vocab_cross_entropy",
}

# Primitive types that must receive a strategy (the rest follow by sharding propagation).
# Custom ops (our kernels) included: without a strategy MindSpore splits a custom op on its first
# input only and leaves its other outputs full-size.
STRATEGIC_PRIMITIVES = (
    "MatMul",
    "BatchMatMul",
    "Gather",
    "TopK",
    "FlashAttentionScore",
    "Custom",
    "Sort",
    "Transpose",
    "Concat",
)


# --------------------------------------------------------------------------- patterns
_LAYER_INDEX = re.compile(r"\.\d+\.")


def _compile(pattern: str) -> re.Pattern:
    parts = [r"[^.]+" if p == "*" else re.escape(p) for p in pattern.split(".")]
    return re.compile(r"\.".join(parts))


class Plan:
    """A pattern table with lookups for cell paths and parameter names."""

    def __init__(self, table: Optional[Dict[str, str]] = None):
        self.table = dict(DEEPSEEK_V2_PLAN if table is None else table)
        self._compiled = [(p, _compile(p), s) for p, s in self.table.items()]
        self._cache: Dict[tuple, Tuple[str, Tuple[int, ...]]] = {}
        self._layer_generic = not any(re.search(r"(^|\.)\d+(\.|$)", p) for p in self.table)

    def match(self, path: str) -> Optional[Tuple[str, str]]:
        """(pattern, style) for a cell or primitive path, None when nothing matches."""
        hits = [(p, s) for p, rx, s in self._compiled if rx.fullmatch(path)]
        if len(hits) > 1:
            raise UserError(f"parallel plan: path {path!r} matches several patterns: {', '.join(p for p, _ in hits)}")
        return hits[0] if hits else None

    def param_layout(self, name: str, mesh: Mesh) -> Tuple[str, Tuple[int, ...]]:
        """(matched pattern, layout) for a full parameter name; UserError when no rule covers it."""
        # Layers share rules: look each kind up once per mesh (unless a pattern names one layer).
        kind = _LAYER_INDEX.sub(".*.", name) if self._layer_generic else name
        key = (kind, mesh)
        if key not in self._cache:
            self._cache[key] = self._param_layout(kind, name, mesh)
        return self._cache[key]

    def _param_layout(self, kind: str, name: str, mesh: Mesh) -> Tuple[str, Tuple[int, ...]]:
        found = []
        for pattern, rx, style in self._compiled:
            spec = style_spec(style, mesh)
            for suffix, layout in spec.params.items():
                full = rx.pattern + (r"\." + re.escape(suffix) if suffix else "")
                if re.fullmatch(full, name):
                    found.append((pattern, layout))
        if not found:
            raise UserError(f"parallel plan: no rule covers parameter {name!r}")
        if len(found) > 1:
            raise UserError(
                f"parallel plan: parameter {name!r} is covered by several rules: {', '.join(p for p, _ in found)}"
            )
        return found[0]


# ------------------------------------------------------------------- parameter inventory
# The model's name/shape table lives in ms_deepseek.config.inventory (shared with the converter and loaders).
from ms_deepseek.config.inventory import ParamInfo, parameter_inventory  # noqa: E402,F401


# ------------------------------------------------------------------------ pipeline stages
def stage_layer_counts(num_layers: int, pp: int, stage_layers: Optional[List[int]] = None) -> List[int]:
    """Layers per stage: the recipe's ``stage_layers`` or as even a cut as possible.

    With an uneven cut the first stages take one layer fewer: they already hold the
    embedding and keep the most micro-batches in flight under 1F1B.
    """
    if stage_layers is not None:
        return list(stage_layers)
    base, extra = divmod(num_layers, pp)
    return [base + (1 if s >= pp - extra else 0) for s in range(pp)]


def layer_stages(num_layers: int, pp: int, stage_layers: Optional[List[int]] = None) -> List[int]:
    """Stage of each decoder layer."""
    stages: List[int] = []
    for s, n in enumerate(stage_layer_counts(num_layers, pp, stage_layers)):
        stages.extend([s] * n)
    return stages


def stage_of_param(info: ParamInfo, pp: int, stages: List[int]) -> int:
    if info.layer is not None:
        return stages[info.layer]
    return 0 if info.name.startswith("model.embed_tokens") else pp - 1


def shard_numel(shape: Tuple[int, ...], layout: Tuple[int, ...]) -> int:
    """Elements of one device's slice (layouts always divide the shape after validation)."""
    n = 1
    for d, k in zip(shape, layout):
        n *= -(-d // k)
    return n


def optimizer_shard_group(
    shape: Tuple[int, ...], layout: Tuple[int, ...], stage_devices: int, itemsize: int, threshold_kb: int = 64
) -> int:
    """How many ways MindSpore's parallel optimizer splits one parameter's slice.

    The slice is replicated on ``stage_devices / prod(layout)`` devices; the optimizer
    shards it over that group along its first axis when the first axis divides and the
    whole parameter is at least ``threshold_kb`` (MindSpore's ``parallel_optimizer_threshold``:
    ``parallel_optimizer/opt_param_mgr.cc`` ``OptParamMgrImpl::SplitParam`` skips a parameter whose
    ``ComputeMemorySize``, its full shape times its element size, is smaller; found by compiling,
    where a [512, 32] float32 embedding split 2 ways, 32 KB a slice and 64 KB whole, was sharded).
    Otherwise it stays whole (group 1).
    """
    split = 1
    for k in layout:
        split *= k
    group = stage_devices // split
    if group <= 1:
        return 1
    first = -(-shape[0] // layout[0]) if shape else 1
    if first % group:
        return 1
    full = 1
    for d in shape:
        full *= int(d)
    if full * itemsize < threshold_kb * 1024:
        return 1
    return group


# ------------------------------------------------------------- listed redistributions
def deliberate_redistributions(mesh: Mesh) -> Dict[str, str]:
    """Layout changes the plan relies on, which the parallel-rules lint accepts (``ms_deepseek.parallel_apply.lint``).

    Key: ``"<primitive path pattern>:<input index>"`` (a consumer whose input strategy differs from
    its producer's layout) or ``"<primitive path pattern>:out"`` (a residual-stream producer whose
    output differs from the stream's layout). Value: why the redistribution is wanted.
    """
    out: Dict[str, str] = {}
    if mesh.ep > 1 or mesh.dp > 1:
        # MindFormers MoE v1 (MoEV2._ffn_forward): the view [G/ep, ep, E, C, H] of the dp-split buffer is
        # split (dp/ep, ep, 1, 1, 1); the exchange transposes read it (dp/ep, 1, ep, 1, 1): MindSpore lowers
        # the change to one AllToAll inside each group of ep adjacent data-parallel ranks (enable_alltoall),
        # and the same way back at from_experts.
        out["model.layers.*.mlp.to_experts:0"] = (
            "MoE dispatch: the dp -> ep exchange of the capacity buffer (AllToAll, enable_alltoall)"
        )
        out["model.layers.*.mlp.from_experts:0"] = (
            "MoE combine: the ep -> dp exchange of the expert output (AllToAll, enable_alltoall)"
        )
    if mesh.sequence_parallel and mesh.tp > 1:
        why = (
            "sequence parallel (Megatron SP): the hidden stream is split by tokens (dp*tp, hidden_split) and "
            "all-gathered over tp before the column-parallel matmuls, the router and the MoE dispatch"
        )
        for p in (
            "model.layers.*.self_attn.q_proj.matmul",
            "model.layers.*.self_attn.q_a_proj.matmul",
            "model.layers.*.self_attn.kv_a_proj_with_mqa.matmul",
            "model.layers.*.mlp.gate_proj.matmul",
            "model.layers.*.mlp.up_proj.matmul",
            "model.layers.*.mlp.gate.matmul",
            "model.layers.*.mlp.shared_experts.gate_proj.matmul",
            "model.layers.*.mlp.shared_experts.up_proj.matmul",
            "model.layers.*.mlp.pad_tokens",
            "lm_head.matmul",
        ):
            out[p + ":0"] = why
        # the embedding's output (whole per token after the vocabulary split's AllReduce) is cut by tokens
        # at embed_cast: a slice, no communication
        out["model.embed_tokens.gather:out"] = why
    return out
