"""The styles of the sharding plan (:mod:`ms_deepseek.parallel_plan.plan`): what a style name stands for
on a mesh of parallel degrees. A style turns the parallel
degrees into

* ``prims``: primitive attribute -> (in_strategy, out_strategy or None), given to
  ``Primitive.shard`` by :func:`ms_deepseek.parallel_apply.apply.apply_plan`;
* ``params``: parameter suffix -> tensor layout (how many ways each axis is split),
  which must equal the strategy of the primitive input that consumes the parameter.

Strategy conventions (MindSpore: one integer per tensor axis, the number of slices):

* Linear: ``matmul`` is MatMul(transpose_b) on x [N, in] (N = batch * seq, split dp)
  and weight [out, in]. colwise splits ``out`` by tp, rowwise splits ``in`` by tp
  (partial sums are all-reduced; under sequence parallel the out_strategy
  ``(dp * tp, 1)`` turns that into a reduce-scatter over tokens).
* Attention batch matmuls on [B, nh, T, d]: batch by dp, heads by tp.
* Routed experts: stacked weights [E, out, in], experts by ep, the expert
  intermediate size by tp. The MoE dispatch is per data-parallel group (MindFormers
  MoE v1, ``ms_deepseek/model/moe.py``): everything up to the capacity buffer
  [G, E, C, H] and back from it is split by dp on G (local); the buffer is viewed
  [G/ep, ep, E, C, H] (ep the inner factor of dp, :func:`ms_deepseek.parallel_plan.ranks.exchange_view`;
  validator rule ``ep | dp``) and the exchange transposes read it split (dp/ep, 1, ep, 1, 1)
  (the AllToAll); the 4-D expert input [G/ep, E, ep*C, H] splits (dp/ep, ep, 1, 1), so the
  expert matmuls' device matrix is (dp/ep, ep, ..., tp) and an ep group is adjacent ranks.
* Vocabulary-parallel embedding / lm_head: the vocabulary axis by tp; the loss
  (``loss_fn``, ``ms_deepseek.model.loss``) keeps the logits [N, V] split (dp, tp).
* Norm weights, the router and the low-rank ``q_a_proj`` / ``kv_a_proj_with_mqa``
  are replicated (small, and their outputs feed every head).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, Optional, Tuple

from ms_deepseek.core.errors import UserError
from ms_deepseek.parallel_plan.named_layout import NamedLayout, Strategy, dequant_layouts


@dataclass(frozen=True)
class Mesh:
    """The degrees a style needs. ``dp``/``tp`` are per pipeline stage."""

    dp: int = 1
    tp: int = 1
    ep: int = 1
    sequence_parallel: bool = False
    vocab_parallel: bool = True

    @classmethod
    def from_parallel(cls, parallel) -> "Mesh":
        return cls(
            dp=parallel.dp,
            tp=parallel.tp,
            ep=parallel.ep,
            sequence_parallel=parallel.sequence_parallel,
            vocab_parallel=parallel.vocab_parallel,
        )

    @property
    def stage_devices(self) -> int:
        return self.dp * self.tp


@dataclass
class StyleSpec:
    # primitive attribute -> (in_strategy, out_strategy or None)
    prims: Dict[str, Tuple[Strategy, Optional[Strategy]]] = field(default_factory=dict)
    # parameter suffix (relative to the cell path) -> layout
    params: Dict[str, Tuple[int, ...]] = field(default_factory=dict)
    # parameter suffix -> (primitive attribute, input index) that consumes it
    consumers: Dict[str, Tuple[str, int]] = field(default_factory=dict)
    # True when the path names a primitive (the spec then has one entry under "")
    is_primitive: bool = False
    # cell attribute -> value, set on the matched cell (a form that depends on the layout, e.g. the loss's
    # ``split_vocab``)
    attrs: Dict[str, object] = field(default_factory=dict)
    # primitive attribute -> its shard as named axes (``mindspore.parallel.Layout``), where a tuple strategy
    # would not say which device axis a split takes
    layouts: Dict[str, NamedLayout] = field(default_factory=dict)


def _linear_dequant(mesh: Mesh, weight: Tuple[int, int]):
    """A quantized Linear's dequantisation on the stage's (dp, tp) matrix, tp fastest (the plan's MatMuls)."""
    names = tuple("tp" if k > 1 else "None" for k in weight)
    return dequant_layouts((mesh.dp, mesh.tp), ("dp", "tp"), names)


def _linear(
    mesh: Mesh, weight: Tuple[int, int], x: Tuple[int, int], bias: Tuple[int, ...], out: Optional[Strategy] = None
) -> StyleSpec:
    out_rows = x[0] if out is None else out[0][0]
    bias_cols = weight[0]
    # A LoRA adapter shards with its base layer: A [r, in] splits ``in`` as the weight does
    # (a rowwise layer's partial sums are reduced after x A^T), B [out, r] splits ``out``.
    lora_a, lora_b = (1, weight[1]), (weight[0], 1)
    # A quantized base layer (model/quant.py): its dequantisation split like the weight (``dequant_layouts``);
    # Ascend's WeightQuantBatchMatmul gets x, weight [out, in] (transpose_weight) and the 1-D scale / offset
    # [out], which MindSpore's WeightQuantBatchMatmulInfo::InferTensorMap (ops_info/weight_quant_batch_matmul_info.cc)
    # maps to the weight's output axis.
    scale = (weight[0], weight[1])
    return StyleSpec(
        prims={
            "matmul": ((x, weight), out),
            "qmatmul": ((x, weight, (weight[0],), (weight[0],)), out),
            "add_bias": (((out_rows, bias_cols), bias), None),
            "lora_a_matmul": ((x, lora_a), None),
            "lora_b_matmul": (((x[0], 1), lora_b), None),
        },
        params={
            "weight": weight,
            "bias": bias,
            "lora_A.weight": lora_a,
            "lora_B.weight": lora_b,
            "weight_scale": scale,
            "weight_offset": scale,
        },
        consumers={
            "weight": ("matmul", 1),
            "bias": ("add_bias", 1),
            "lora_A.weight": ("lora_a_matmul", 1),
            "lora_B.weight": ("lora_b_matmul", 1),
        },
        layouts=_linear_dequant(mesh, weight),
    )


def _expert_lora_layouts(ep: int, tp: int) -> Dict[str, Tuple[int, ...]]:
    """Layouts of the stacked expert adapters: E by ep; the intermediate size by tp, as in the weights."""
    return {
        "gate_proj.lora_A.weight": (ep, 1, 1),
        "gate_proj.lora_B.weight": (ep, tp, 1),
        "up_proj.lora_A.weight": (ep, 1, 1),
        "up_proj.lora_B.weight": (ep, tp, 1),
        "down_proj.lora_A.weight": (ep, 1, tp),
        "down_proj.lora_B.weight": (ep, 1, 1),
    }


def _colwise(mesh: Mesh) -> StyleSpec:
    dp, tp = mesh.dp, mesh.tp
    return _linear(mesh, weight=(tp, 1), x=(dp, 1), bias=(tp,))


def _rowwise(mesh: Mesh) -> StyleSpec:
    dp, tp = mesh.dp, mesh.tp
    out = ((dp * tp, 1),) if mesh.sequence_parallel and tp > 1 else None
    return _linear(mesh, weight=(1, tp), x=(dp, tp), bias=(1,), out=out)


def _replicate(mesh: Mesh) -> StyleSpec:
    dp = mesh.dp
    return _linear(mesh, weight=(1, 1), x=(dp, 1), bias=(1,))


def _vocab_head(mesh: Mesh) -> StyleSpec:
    dp, tp = mesh.dp, mesh.tp
    v = tp if mesh.vocab_parallel else 1
    return _linear(mesh, weight=(v, 1), x=(dp, 1), bias=(v,))


def _vocab_cross_entropy(mesh: Mesh) -> StyleSpec:
    dp, tp = mesh.dp, mesh.tp
    # logits [N, V] as lm_head leaves them: tokens by dp, vocabulary by the head's split. Every
    # reduction over V is partial per device and all-reduced (MindFormers' CrossEntropyLoss
    # strategies). The target logit: on a split vocabulary OneHot builds each device's slice of the
    # targets (GatherD cannot split its gather axis: gather_d_info.cc GatherDInfo::CheckStrategy); on a
    # whole vocabulary GatherD picks it per token, no [N, V] one-hot (model/loss.py).
    v = tp if mesh.vocab_parallel else 1
    nv = ((dp, v),)
    prims = {
        "row_max": (nv, None),
        "sub": (((dp, v), (dp, 1)), None),
        "exp": (nv, None),
        "sum_exp": (nv, None),
        "log": (((dp,),), None),
    }
    if v > 1:
        prims.update({"onehot": (((dp, v), (), ()), None), "mul": (((dp, v), (dp, v)), None), "pick": (nv, None)})
    else:
        prims["gather_target"] = (((dp, 1), (dp, 1)), None)
    return StyleSpec(prims=prims, attrs={"split_vocab": v > 1})


def _vocab_embedding(mesh: Mesh) -> StyleSpec:
    dp, tp = mesh.dp, mesh.tp
    v = tp if mesh.vocab_parallel else 1
    # Gather(weight [V, H], ids [B, T], axis 0): vocab split by tp, ids by dp.
    return StyleSpec(
        prims={"gather": (((v, 1), (dp, 1)), None)}, params={"weight": (v, 1)}, consumers={"weight": ("gather", 0)}
    )


def _rotary_table(mesh: Mesh) -> StyleSpec:
    # cos / sin [T, dim] from the positions [T]: small, position-only, replicated on every device
    # (MindFormers' rotary ops carry explicit replicated strategies too)
    one = ((1, 1),)
    return StyleSpec(
        prims={
            "freq_mul": (((1, 1), (1, 1)), None),
            "concat": (((1, 1), (1, 1)), None),
            "cos": (one, None),
            "sin": (one, None),
            "mscale_mul": (((1, 1), ()), None),
            "table_cast": (one, None),  # to the compute dtype, once for every layer (model/rope.py)
        }
    )


def _causal_mask(mesh: Mesh) -> StyleSpec:
    # model/mla.py CausalMask (eager attention): [1, S] > [T, 1], to float32, times the mask value; replicated on every
    # device like the rotary table, so that no layer holds an operation on it
    whole = (1, 1)
    return StyleSpec(prims={"later": ((whole, whole), None), "cast": ((whole,), None), "scale": ((whole, ()), None)})


def hidden_split(mesh: Mesh) -> Tuple[int, int, int]:
    """The split of the hidden stream [B, T, H] between the layers: batch by dp and, under sequence parallel,
    tokens by tp (Megatron SP; MindFormers' ``LLamaDecodeLayer`` under ``use_seq_parallel``: (dp, mp, 1)).
    Seen as rows [B*T, H] it is the row-parallel output's (dp * tp, 1) (``_rowwise``) when each data-parallel
    rank holds one sequence per micro-batch, as every sequence-parallel recipe does; otherwise MindSpore's
    reshape redistributes between the two."""
    seq = mesh.tp if mesh.sequence_parallel and mesh.tp > 1 else 1
    return (mesh.dp, seq, 1)


def _rms_norm(s: Tuple[int, ...]) -> StyleSpec:
    # RMSNorm (model/layers.py) on x split ``s``, its last (normalised) axis whole, so the variance [..., 1] splits
    # as ``s`` too; the weight [H] replicated
    return StyleSpec(
        prims={
            "cast_in": ((s,), None),
            "square": ((s,), None),
            "mean": ((s,), None),  # ReduceMean over the last axis, keep_dims: [..., 1]
            "add_eps": ((s, ()), None),
            "rsqrt": ((s,), None),
            "normalize": ((s, s), None),
            "cast_out": ((s,), None),
            "cast_weight": (((1,),), None),
            "scale": ((s, (1,)), None),
        },
        params={"weight": (1,)},
        consumers={"weight": ("cast_weight", 0)},
    )


def _norm(mesh: Mesh) -> StyleSpec:
    # the latent norms (q_a_layernorm, kv_a_layernorm) on [B, T, r]: after a replicated projection, batch by dp
    return _rms_norm((mesh.dp, 1, 1))


def _hidden_norm(mesh: Mesh) -> StyleSpec:
    # the decoder norms and the final norm, on the hidden stream
    return _rms_norm(hidden_split(mesh))


def _hidden_cast(mesh: Mesh) -> StyleSpec:
    # a Cast into the hidden stream [B, T, H] (the embedding's output, each sub-layer's output)
    return StyleSpec(prims={"": ((hidden_split(mesh),), None)}, is_primitive=True)


def _residual_add(mesh: Mesh) -> StyleSpec:
    # x + sub-layer(x) on the hidden stream [B, T, H]
    s = hidden_split(mesh)
    return StyleSpec(prims={"": ((s, s), None)}, is_primitive=True)


def _router(mesh: Mesh) -> StyleSpec:
    dp = mesh.dp
    # fp32 scores [N, E] replicated over tp; top-k per token row.
    return StyleSpec(
        prims={"matmul": (((dp, 1), (1, 1)), None), "topk": (((dp, 1),), None), "group_topk": (((dp, 1),), None)},
        params={"weight": (1, 1)},
        consumers={"weight": ("matmul", 1)},
    )


def _expert_outer(mesh: Mesh) -> int:
    """D's split in the exchange view [D = G/ep, ...]: dp/ep when ep divides dp, else whole."""
    return mesh.dp // mesh.ep if mesh.dp % mesh.ep == 0 else 1


def _expert_rows(mesh: Mesh, tp_last: bool) -> Tuple[int, ...]:
    """The split of expert rows [D, E, M, *]: D by dp/ep, E by ep, the last axis by tp where it is the
    intermediate width I (``tp_last``)."""
    return (_expert_outer(mesh), mesh.ep, 1, mesh.tp if tp_last else 1)


def _experts(mesh: Mesh) -> StyleSpec:
    tp, ep = mesh.tp, mesh.ep
    # MindFormers llama_layer.py LlamaFeedForward._shard_semi_auto_parallel (MoE branch): x [D, E, M, in]
    # split (dp_moe, ep, 1, 1) against weights [E, out, in] split (ep, mp, 1); D = dp/ep (the outer factor).
    rows, rows_tp = _expert_rows(mesh, tp_last=False), _expert_rows(mesh, tp_last=True)
    return StyleSpec(
        prims={
            "cast_in": ((rows,), None),  # the expert rows [D, E, M, H] to the compute dtype
            "act": ((rows_tp,), None),  # SiLU(gate) [D, E, M, I]
            "act_mul": ((rows_tp, rows_tp), None),  # SiLU(gate) * up
            "gate_bmm": ((rows, (ep, tp, 1)), None),  # [D, E, M, H] x [E, I, H]^T
            "up_bmm": ((rows, (ep, tp, 1)), None),
            "down_bmm": ((rows_tp, (ep, 1, tp)), None),  # [D, E, M, I] x [E, H, I]^T
            # stacked adapters, split like the expert weights they adapt:
            # gate/up A [E, r, H], B [E, I, r]; down A [E, r, I], B [E, H, r]
            "gate_lora_a_bmm": ((rows, (ep, 1, 1)), None),
            "gate_lora_b_bmm": ((rows, (ep, tp, 1)), None),
            "up_lora_a_bmm": ((rows, (ep, 1, 1)), None),
            "up_lora_b_bmm": ((rows, (ep, tp, 1)), None),
            "down_lora_a_bmm": ((rows_tp, (ep, 1, tp)), None),
            "down_lora_b_bmm": ((rows, (ep, 1, 1)), None),
        },
        params={
            "gate_proj.weight": (ep, tp, 1),
            "up_proj.weight": (ep, tp, 1),
            "down_proj.weight": (ep, 1, tp),
            **_expert_lora_layouts(ep, tp),
            # a quantized base (model/quant.py): scales / offsets [E, out, in/G] split like the weights
            # [E, out, in] (a per-channel scale's one-group axis stays whole: fit_layout)
            **{
                f"{p}_proj.{s}": ((ep, 1, tp) if p == "down" else (ep, tp, 1))
                for p in ("gate", "up", "down")
                for s in ("weight_scale", "weight_offset")
            },
        },
        consumers={
            "gate_proj.weight": ("gate_bmm", 1),
            "up_proj.weight": ("up_bmm", 1),
            "down_proj.weight": ("down_bmm", 1),
            **{
                f"{p}_proj.lora_{ab}.weight": (f"{p}_lora_{ab.lower()}_bmm", 1)
                for p in ("gate", "up", "down")
                for ab in ("A", "B")
            },
        },
    )


def _expert_quant(weight_of) -> Callable[[Mesh], StyleSpec]:
    """A quantized stacked expert projection (model/quant.py ``QuantStackedWeight``): its dequantisation split
    like its weight [E, out, in] (``weight_of(mesh)``: the device axis of each weight axis, as ``_experts``
    splits it), on the stage's matrix (dp/ep, ep, tp): the expert-parallel groups are adjacent data-parallel
    ranks and tp is fastest, as the expert BatchMatMuls' device matrix (x (dp/ep, ep, 1, 1) then the weight's
    ``out``: checkpoint/layout.py ``_dev_matrix_for``). A float ``StackedWeight`` at the same path has none of
    these primitives."""

    def build(mesh: Mesh) -> StyleSpec:
        matrix = (mesh.dp // mesh.ep, mesh.ep, mesh.tp)
        return StyleSpec(layouts=dequant_layouts(matrix, ("dp_outer", "ep", "tp"), weight_of(mesh)))

    return build


# gate / up [E, I, H] split (ep, tp, 1); down [E, H, I] split (ep, 1, tp), as the weights (_experts)
_EXPERT_QUANT = {
    "expert_quant_colwise": lambda m: ("ep", "tp", "None"),
    "expert_quant_rowwise": lambda m: ("ep", "None", "tp"),
}


def fit_layout(shape: Tuple[int, ...], layout: Tuple[int, ...]) -> Tuple[int, ...]:
    """A layout on a tensor's actual shape: an axis of length 1 (a per-channel scale's one group) is whole.

    As MindSpore sees it: the dequantisation Mul's scale input is split (.., 1) on that axis."""
    return tuple(1 if d == 1 else k for d, k in zip(shape, layout))


def _head_bmm(mesh: Mesh) -> StyleSpec:
    dp, tp = mesh.dp, mesh.tp
    return StyleSpec(prims={"": (((dp, tp, 1, 1), (dp, tp, 1, 1)), None)}, is_primitive=True)


def _attention_heads(mesh: Mesh) -> StyleSpec:
    """MLAttention's own operations on per-head tensors [B, nh, T, d]: batch by dp, heads by tp, as the
    attention matmuls and the fused kernel. Without them a pipeline's ``semi_auto`` compile gathered the heads
    (``model/mla.py``)."""
    dp, tp = mesh.dp, mesh.tp
    heads = (dp, tp, 1, 1)
    return StyleSpec(
        prims={
            "to_heads": (((dp, 1, tp, 1),), None),  # [B, T, nh, d] -> [B, nh, T, d]
            "from_heads": ((heads,), None),  # [B, nh, T, d] -> [B, T, nh, d]
            "head_slice": ((heads,), None),  # a range of d: MindSpore's StridedSliceInfo splits the whole axes
            "head_concat": ((heads, heads), None),  # along d
            "head_cast": ((heads,), None),
            "latent_slice": (((dp, 1, 1),), None),  # [B, T, kv_lora + rope] after the replicated projection
            "pe_tile": ((heads,), None),  # k_pe [B, 1, S, rope] tiled to nh heads, each rank tiling its nh / tp
            "score_cast": ((heads,), None),  # scores [B, nh, T, S] to float32
            "score_scale": ((heads, ()), None),
            "score_mask": ((heads, (1, 1)), None),  # + the causal mask [T, S], replicated
        }
    )


def _rotary_apply(split: Tuple[int, ...]) -> StyleSpec:
    # model/rope.py RotaryApply on x split ``split`` (its last axis, the rotary dims, whole); the pair swap
    # sees x as [..., dim/2, 2], the tables cos / sin [T, dim] are replicated
    table = (1, 1)
    return StyleSpec(
        prims={
            "pair_swap": ((split + (1,),), None),
            "half_slice": ((split,), None),
            "neg": ((split,), None),
            "concat": ((split, split), None),
            "mul_cos": ((split, table), None),
            "mul_sin": ((split, table), None),
            "add": ((split, split), None),
        }
    )


def _head_rotary(mesh: Mesh) -> StyleSpec:
    return _rotary_apply((mesh.dp, mesh.tp, 1, 1))  # q_pe [B, nh, T, rope]


def _latent_rotary(mesh: Mesh) -> StyleSpec:
    return _rotary_apply((mesh.dp, 1, 1))  # k_pe [B, T, rope]: one for all heads, after a replicated projection


def _head_pad(mesh: Mesh) -> StyleSpec:
    dp, tp = mesh.dp, mesh.tp
    # PadV3 of q / k / v [B, nh, S, d] with zero columns after d: batch by dp, heads by tp, the padded axis whole
    return StyleSpec(prims={"": (((dp, tp, 1, 1),), None)}, is_primitive=True)


def _head_softmax(mesh: Mesh) -> StyleSpec:
    dp, tp = mesh.dp, mesh.tp
    # FP32Softmax on scores [B, nh, T, S] (ops.Custom; on Ascend ops.Softmax, float32 scores): like the score
    # matmul, the softmax axis whole.
    return StyleSpec(prims={"": (((dp, tp, 1, 1),), None)}, is_primitive=True)


def _row_softmax(mesh: Mesh) -> StyleSpec:
    dp = mesh.dp
    # FP32Softmax on router logits [N, E] (ops.Custom; on Ascend ops.Softmax, float32 input): tokens by dp,
    # the expert axis whole.
    return StyleSpec(prims={"": (((dp, 1),), None)}, is_primitive=True)


def _flash_attention(mesh: Mesh) -> StyleSpec:
    dp, tp = mesh.dp, mesh.tp
    # FlashAttentionScore(q, k, v [B, nh, T, D] BNSD, ..., compressed causal mask [2048, 2048]):
    # batch by dp, heads by tp; the mask is replicated.
    heads = ((dp, tp, 1, 1),) * 3
    return StyleSpec(prims={"": ((heads + ((1, 1),)), None)}, is_primitive=True)


# MoE dispatch per data-parallel group G = dp (ms_deepseek/model/moe.py, dispatch_shapes.py).
def _moe_pad_tokens(mesh: Mesh) -> StyleSpec:
    dp = mesh.dp
    # Concat(tokens [G, N, H], zero row [G, 1, H]) on axis 1: the concat axis stays whole.
    return StyleSpec(prims={"": (((dp, 1, 1), (dp, 1, 1)), None)}, is_primitive=True)


def _expert_lookup(mesh: Mesh) -> StyleSpec:
    dp = mesh.dp
    # ExpertLookup custom op on the k-major ids [G, k*N] and the placement [E, 2]: each device
    # counts positions for its own group (the op's groups are independent); the placement is
    # replicated. apply_plan appends the impl's strategy_tail (e.g. the CPU config tensor).
    return StyleSpec(prims={"": (((dp, 1), (1, 1)), None)}, is_primitive=True)


def _moe_slot_sort(mesh: Mesh) -> StyleSpec:
    dp = mesh.dp
    # Sort of the keys [G, E, k*N] along the last axis (which cannot be split).
    return StyleSpec(prims={"": (((dp, 1, 1),), None)}, is_primitive=True)


def _batch_local_gather(mesh: Mesh) -> StyleSpec:
    dp = mesh.dp
    # dispatch_gather: Gather(batch_dims=1)(padded tokens [G, N+1, H], dispatch_index [G, E, C], axis 1);
    # combine_gather: Gather(batch_dims=1)(expert out [G, E*C, H], combine_index [G, N, k], axis 1).
    # Local per group, batch axis by dp (MindFormers TopkRouterV2's dispatch_gather strategy). Legal in
    # MindSpore's gather_info.cc BatchImpl (batch_dims > 0): the gather axis unsplit, equal batch-dim splits.
    return StyleSpec(prims={"": (((dp, 1, 1), (dp, 1, 1)), None)}, is_primitive=True)


def _moe_exchange(mesh: Mesh) -> StyleSpec:
    # Transpose (0, 2, 1, 3, 4) of [G/ep, ep, E, C, H] (to_experts) or [G/ep, E, ep, C, H] (from_experts),
    # split (dp/ep, 1, ep, 1, 1) as MindFormers' MoEV2.transpose_5dim_ep2: to_experts reads the view with
    # E split by ep (it arrives with the ep axis split: the AllToAll at its input) and gives E split;
    # from_experts reads the expert output with the ep axis split (the AllToAll back) and gives G split.
    return StyleSpec(prims={"": (((_expert_outer(mesh), 1, mesh.ep, 1, 1),), None)}, is_primitive=True)


def _expert_rows_styles(mesh: Mesh, tp_last: bool, second: str = "") -> StyleSpec:
    # an elementwise op on expert rows [D, E, M, *], split as the experts style's rows (_expert_rows);
    # ``second``: "rows" (a second tensor split the same), "scalar" (a Python number, whole), "" (one input)
    rows = _expert_rows(mesh, tp_last)
    inputs = {"": (rows,), "rows": (rows, rows), "scalar": (rows, ())}[second]
    return StyleSpec(prims={"": (inputs, None)}, is_primitive=True)


def _swiglu(mesh: Mesh, inputs: int) -> StyleSpec:
    # SiLU(gate) and its product with up on [B, T, I]: split as the column-parallel projections leave them, batch by
    # dp and the intermediate width by tp (MindFormers' LlamaFeedForward shards its activation and mul the same way)
    split = (mesh.dp, 1, mesh.tp)
    return StyleSpec(prims={"": ((split,) * inputs, None)}, is_primitive=True)


def _placement_table(mesh: Mesh) -> StyleSpec:
    # The [E, 2] int32 table is tiny and read by every rank: replicated, not trainable.
    return StyleSpec(params={"": (1, 1)})


# style name -> its strategies on a mesh (the plan's table values)
STYLES: Dict[str, Callable[[Mesh], StyleSpec]] = {
    "colwise": _colwise,
    "rowwise": _rowwise,
    "replicate": _replicate,
    "vocab_head": _vocab_head,
    "vocab_cross_entropy": _vocab_cross_entropy,
    "vocab_embedding": _vocab_embedding,
    "norm": _norm,
    "hidden_norm": _hidden_norm,
    "hidden_cast": _hidden_cast,
    "residual_add": _residual_add,
    "rotary_table": _rotary_table,
    "causal_mask": _causal_mask,
    "router": _router,
    "experts": _experts,
    "head_bmm": _head_bmm,
    "attention_heads": _attention_heads,
    "head_rotary": _head_rotary,
    "latent_rotary": _latent_rotary,
    "head_softmax": _head_softmax,
    "head_pad": _head_pad,
    "row_softmax": _row_softmax,
    "flash_attention": _flash_attention,
    "moe_pad_tokens": _moe_pad_tokens,
    "expert_lookup": _expert_lookup,
    "moe_slot_sort": _moe_slot_sort,
    "dispatch_gather": _batch_local_gather,
    "moe_exchange": _moe_exchange,
    "combine_gather": _batch_local_gather,
    "placement_table": _placement_table,
    "swiglu": lambda mesh: _swiglu(mesh, 1),
    "swiglu_pair": lambda mesh: _swiglu(mesh, 2),
    "expert_rows": lambda mesh: _expert_rows_styles(mesh, tp_last=False),
    "expert_rows_tp": lambda mesh: _expert_rows_styles(mesh, tp_last=True),
    "expert_rows_pair": lambda mesh: _expert_rows_styles(mesh, tp_last=False, second="rows"),
    "expert_rows_tp_pair": lambda mesh: _expert_rows_styles(mesh, tp_last=True, second="rows"),
    "expert_rows_scalar": lambda mesh: _expert_rows_styles(mesh, tp_last=False, second="scalar"),
    "expert_rows_tp_scalar": lambda mesh: _expert_rows_styles(mesh, tp_last=True, second="scalar"),
    **{name: _expert_quant(rule) for name, rule in _EXPERT_QUANT.items()},
}


def style_spec(style: str, mesh: Mesh) -> StyleSpec:
    """The strategies and parameter layouts a style stands for on ``mesh``."""
    build = STYLES.get(style)
    if build is None:
        raise UserError(f"parallel plan: unknown style {style!r}")
    return build(mesh)
