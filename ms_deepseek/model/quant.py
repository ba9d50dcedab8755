"""A quantized frozen base under LoRA: int8 / int4 Linear layers and stacked experts.

The layers hold the stored weight of :mod:`ms_deepseek.checkpoint.convert.quant_format` (int8
[out, in], or uint8 [out, in/2] with two int4 per byte), ``weight_scale`` [out, in/G] and
``weight_offset`` (zeros) as frozen Parameters, and compute ``x @ dequant(W)^T`` with
``dequant(W) = q * scale`` per group of G input columns. LoRA adapters attach to them exactly
as to the float layers (model/lora.py); the quantized parameters never get gradients (they
are not trainable, and the integer weight has no gradient).

Backends:

* CPU (the reference): dequantise in float32 (``dequant_mul``: the same product as
  :func:`~ms_deepseek.checkpoint.convert.quant_format.dequantize_array`), then the float layer's matmul;
* Ascend, int8 per output channel Linear: ``ops.auto_generate.WeightQuantBatchMatmul`` (MindSpore
  2.9 ``ops/auto_generate/gen_ops_prim.py``: ``WeightQuantBatchMatmul(transpose_x=False,
  transpose_weight=False, antiquant_group_size=0)(x, weight, antiquant_scale, antiquant_offset=None,
  quant_scale=None, quant_offset=None, bias=None)``; CANN's ANTIQUANT(w) = (w + offset) * scale),
  with ``transpose_weight=True`` on our [out, in] weight and the scale / offset as 1-D [out] in the
  activation dtype. Its parallel rule (MindSpore ``frontend/parallel/ops_info/
  weight_quant_batch_matmul_info.cc``, ``WeightQuantBatchMatmulInfo::InferTensorMap``) maps every
  input after the weight to the tensor map ``{0}``: a 1-D tensor split like the weight's output
  axis. That fits a per-channel scale [out] and nothing else, so group-wise scales, int4 and the
  stacked experts (one scale row per expert) take the dequantise-then-matmul path on Ascend too,
  every step of which (the unpacking, the scale's Mul, the cast to the compute dtype:
  :data:`DEQUANT_PRIMITIVES`) and the (Batch)MatMul shard by the plan, like the weight
  (parallel_plan/named_layout.py ``dequant_layouts``; ``weight_scale``/``weight_offset`` layouts beside ``weight``).
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops
from mindspore.common.initializer import initializer

from ms_deepseek.checkpoint.convert.quant_format import group_of, is_quantized_weight, stored_array
from ms_deepseek.config.quant import QuantSpec
from ms_deepseek.core.errors import UserError
from ms_deepseek.model.layers import Linear
from ms_deepseek.model.moe import RoutedExperts, StackedWeight, grouped_project, stacked_project

# the dequantisation's primitives (``_Dequant``), each split like the weight by the plan
# (parallel_plan/named_layout.py ``dequant_layouts``)
DEQUANT_PRIMITIVES = (
    "unpack_first",
    "unpack_cast",
    "nibble_div",
    "nibble_bias",
    "nibble_mod",
    "nibble_center",
    "int_cast",
    "scale_expand",
    "group_scale_expand",
    "dequant_mul",
    "group_dequant_mul",
    "weight_cast",
)


def _on_ascend() -> bool:
    return ms.get_context("device_target") == "Ascend"


class _Dequant:
    """The shared parts: frozen quantized parameters and the dequantisation (a mixin of Cells)."""

    def _init_quant(self, lead: Tuple[int, ...], out_f: int, in_f: int, spec: QuantSpec) -> None:
        self.bits = spec.bits
        self.group = group_of(spec, in_f)
        self.groups = in_f // self.group
        self.dense_shape = tuple(lead) + (out_f, in_f)  # what LoRA sees: the float weight's shape
        q_shape = tuple(lead) + (out_f, in_f if spec.bits == 8 else in_f // 2)
        s_shape = tuple(lead) + (out_f, self.groups)
        q_dtype = ms.int8 if spec.bits == 8 else ms.uint8
        # initializers, not host arrays: under no_init_parameters (a sharded run) nothing of the full
        # tensors is allocated; each rank sets its slices after the compile (train/lora_run.py)
        self.weight = Parameter(initializer("zeros", q_shape, q_dtype), name="weight", requires_grad=False)
        self.weight_scale = Parameter(
            initializer("ones", s_shape, ms.float32), name="weight_scale", requires_grad=False
        )
        self.weight_offset = Parameter(
            initializer("zeros", s_shape, ms.float32), name="weight_offset", requires_grad=False
        )
        # The unpacking starts from the Parameter alone, so MindSpore's common-subexpression elimination
        # merges it across the accumulation's micro-steps and holds every layer's unpacked image from the
        # first forward to the last backward (MindSpore's level-1 accounting of v2-qlora-8npu: docs/measurements.md).
        # Two MindSpore rules decide the fix:
        # - "side_effect_hidden" (the attribute its random ops carry) keeps CSE from merging calls
        #   (utils/pipeline/cse.h CSE::HasHiddenSideEffect): each micro-step unpacks its own;
        # - a Cast whose input is a Parameter is never recomputed (step_parallel_utils.cc
        #   SetCastForParamNotRecompute), so under recompute its output would be held from the forward to
        #   the backward: the first op is an ExpandDims of the packed bytes, and the Cast follows it.
        self.unpack_first = ops.ExpandDims()
        self.unpack_first.add_prim_attr("side_effect_hidden", True)
        # Every step of the unpacking is a named primitive, so that the plan gives each the weight's split
        # (parallel_plan/named_layout.py ``dequant_layouts``). An operator without a strategy takes semi_auto's
        # default, its first axis split over all the stage's devices (MindSpore frontend/parallel/step_parallel.cc
        # ExtractStrategyAndInit -> GenerateBatchParallelStrategy; ops_info/operator_info.cc
        # GenerateBatchStrategiesBySplitFlag), and a Parameter takes the layout of the operator that reads it: the
        # weight and its scales would be split over the stage's dp x tp devices by rows (the plan keeps a
        # replicated layer whole, a column-parallel one split tp ways) and all-gathered before the dequantisation.
        self.int_cast = ops.Cast()  # the integers as float32
        if spec.bits == 4:
            self.unpack_cast = ops.Cast()  # the packed bytes as int32
            # the low and high nibble of each byte as a signed int4: ((u // (1, 16) + 8) % 16) - 8, a broadcast
            # over a new last axis (n + 8 mod 16, less 8, maps 0..7 to itself and 8..15 to -8..-1)
            self.nibble_divisors = Tensor(np.array([1, 16], np.int32))
            self.nibble_div = ops.FloorDiv()
            self.nibble_bias = ops.Add()
            self.nibble_mod = ops.FloorMod()
            self.nibble_center = ops.Sub()
        # q [.., out, in/G, G] * scale [.., out, in/G, 1]: two names for the two forms, so the plan can split
        # them apart (per channel: in/G = 1 and the input axis G = in splits like the weight's; group-wise:
        # the groups do). A layer holds only the form it uses: the compile check matches the plan's
        # strategies with the compiled operators of a cell by type (parallel_apply/compiled_check.py).
        if self.groups == 1:
            self.scale_expand = ops.ExpandDims()
            self.dequant_mul = ops.Mul()
        else:
            self.group_scale_expand = ops.ExpandDims()
            self.group_dequant_mul = ops.Mul()
        self.weight_cast = ops.Cast()  # the dequantised weight in the compute dtype
        # primitives this layer holds that its training graph does not use (QuantLinear's fused Ascend path)
        self.graph_unused = ()

    def _int_values(self):
        """The weight's integers as float32 [..., out, in] (int4: nibbles sign-extended and interleaved)."""
        packed = self.unpack_first(self.weight, -1)  # [..., out, in, 1] (int8) or [..., out, in/2, 1] (int4)
        if self.bits == 8:
            return self.int_cast(packed, ms.float32).reshape(self.dense_shape)  # -> [..., out, in]
        u = self.unpack_cast(packed, ms.int32)  # [..., out, in/2, 1]
        both = self.nibble_bias(self.nibble_div(u, self.nibble_divisors), 8)  # [..., out, in/2, 2]: column 2j, 2j+1
        both = self.nibble_center(self.nibble_mod(both, 16), 8)
        return self.int_cast(both, ms.float32).reshape(self.dense_shape)  # [..., out, in/2, 2] -> [..., out, in]

    def dequantized(self):
        """float32 [..., out, in]: q * scale per group of ``self.group`` input columns."""
        shape = self.dense_shape
        q = self._int_values().reshape(shape[:-1] + (self.groups, self.group))  # [..., out, in/G, G]
        if self.groups == 1:
            scale = self.scale_expand(self.weight_scale, -1)  # [..., out, 1] -> [..., out, 1, 1]
            return self.dequant_mul(q, scale).reshape(shape)  # -> [..., out, in]
        scale = self.group_scale_expand(self.weight_scale, -1)  # [..., out, in/G] -> [..., out, in/G, 1]
        return self.group_dequant_mul(q, scale).reshape(shape)

    def set_quantized(self, stored: np.ndarray, scale: np.ndarray) -> None:
        self.weight.set_data(Tensor(np.ascontiguousarray(stored)))
        self.weight_scale.set_data(Tensor(np.ascontiguousarray(scale, np.float32)))


class QuantLinear(_Dequant, Linear):
    """A frozen int8 / int4 ``Linear`` (no bias: DeepSeek-V2's projections have none)."""

    def base_weight(self, dtype):
        """The dequantised weight [out, in] (``weight`` holds the integers)."""
        return self.weight_cast(self.dequantized(), dtype)

    def __init__(self, in_features: int, out_features: int, spec: QuantSpec, compute_dtype=ms.float32):
        nn.Cell.__init__(self)
        self.in_features, self.out_features = in_features, out_features
        self._init_quant((), out_features, in_features, spec)
        self.bias = None
        self.compute_dtype = compute_dtype
        self.matmul = ops.MatMul(transpose_b=True)
        self.add_bias = ops.Add()
        self.lora_A = None
        self.lora_B = None
        self.lora_scaling = 0.0
        self.lora_dropout = None
        self.lora_a_matmul = ops.MatMul(transpose_b=True)
        self.lora_b_matmul = ops.MatMul(transpose_b=True)
        self.fused = _on_ascend() and spec.bits == 8 and self.groups == 1
        if self.fused:
            from mindspore.ops.auto_generate import WeightQuantBatchMatmul

            self.qmatmul = WeightQuantBatchMatmul(transpose_x=False, transpose_weight=True, antiquant_group_size=0)
            # the dequantisation serves only code that reads the matrix itself (``effective_weight``: decoding)
            self.graph_unused = DEQUANT_PRIMITIVES

    def construct(self, x):
        lead = x.shape[:-1]
        cdt = self.compute_dtype
        x2 = x.reshape(-1, self.in_features).astype(cdt)  # [N, in]
        if self.fused:  # Ascend W8A16: scale / offset [out, 1] -> [out], in the activation dtype
            y = self.qmatmul(
                x2, self.weight, self.weight_scale.astype(cdt).reshape(-1), self.weight_offset.astype(cdt).reshape(-1)
            )
        else:
            y = self.matmul(x2, self.weight_cast(self.dequantized(), cdt))  # [N, out]
        if self.lora_A is not None:
            h = x2 if self.lora_dropout is None else self.lora_dropout(x2)
            h = self.lora_a_matmul(h, self.lora_A.weight.astype(cdt))  # [N, r]
            y = y + self.lora_b_matmul(h, self.lora_B.weight.astype(cdt)) * self.lora_scaling
        return y.reshape(lead + (self.out_features,))


class QuantStackedWeight(_Dequant, StackedWeight):
    """A frozen int8 / int4 stacked expert projection [E, out, in] (dequantised, then the batched matmul)."""

    def __init__(self, shape, spec: QuantSpec):
        nn.Cell.__init__(self)
        E, out_f, in_f = shape
        self._init_quant((E,), out_f, in_f, spec)
        self._init_adapter_slots()

    def project(self, x, bmm, lora_a_bmm, lora_b_bmm, cdt, broadcast: bool):
        """x [D, E, C, in] -> [D, E, C, out] (as StackedWeight.project, on the dequantised stack)."""
        weight = self.weight_cast(self.dequantized(), cdt)
        return stacked_project(self, weight, x, bmm, lora_a_bmm, lora_b_bmm, cdt, broadcast)

    def rows(self, idx, cdt):
        """The experts ``idx`` [n] of the dequantised stack -> [n, out, in]."""
        return ops.gather(self.dequantized(), idx, 0).astype(cdt)

    def dense(self, cdt):
        """The dequantised stack [E, out, in] in the compute dtype."""
        return self.weight_cast(self.dequantized(), cdt)

    def grouped(self, x, group_list, gmm, cdt):
        """x [M, in] sorted by expert -> [M, out] (as StackedWeight.grouped, on the dequantised stack)."""
        return grouped_project(self, self.weight_cast(self.dequantized(), cdt), x, group_list, gmm, cdt)


# ------------------------------------------------------------------------------ building
def _host(p) -> np.ndarray:
    return p.astype(ms.float32).asnumpy() if p.dtype == ms.bfloat16 else p.asnumpy().astype(np.float32)


def _name(cell, path: str) -> None:
    for suffix in ("weight", "weight_scale", "weight_offset"):
        getattr(cell, suffix).name = f"{path}.{suffix}"


def quantizable_cells(model) -> List[Tuple[str, object, str, object]]:
    """(path, parent cell, attribute, cell) of every float Linear / stacked projection the base quantizes."""
    cells = dict(model.cells_and_names())
    out = []
    for path, cell in cells.items():
        if isinstance(cell, (_Dequant,)):
            continue
        if isinstance(cell, Linear) and is_quantized_weight(f"{path}.weight"):
            parent, attr = path.rsplit(".", 1)
            out.append((path, cells[parent], attr, cell))
        elif isinstance(cell, RoutedExperts):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                sub = getattr(cell, proj)
                if not isinstance(sub, _Dequant):
                    out.append((f"{path}.{proj}", cell, proj, sub))
    return out


def is_quantized(model) -> bool:
    return any(isinstance(c, _Dequant) for _p, c in model.cells_and_names())


def quantize_model(model, spec: QuantSpec, from_weights: bool = True) -> int:
    """Swap every quantizable layer for its quantized twin; returns how many.

    ``from_weights``: quantize the layer's current float weight (a loaded or random base, in
    memory, one layer at a time); otherwise leave placeholders for :func:`load_quantized`."""
    done = 0
    for path, parent, attr, cell in quantizable_cells(model):
        if getattr(cell, "lora_A", None) is not None:
            raise UserError("quant: the base must be quantized before LoRA adapters are attached")
        shape = tuple(cell.weight.shape)
        if spec.group_size is not None and shape[-1] % spec.group_size:
            raise UserError(
                f"quant.group_size: {spec.group_size} does not divide the input width {shape[-1]} of {path}"
            )
        if spec.bits == 4 and group_of(spec, shape[-1]) % 2:
            raise UserError(f"quant.group_size: int4 pairs columns; {path} has an odd input width {shape[-1]}")
        if isinstance(cell, Linear):
            new = QuantLinear(shape[1], shape[0], spec, cell.compute_dtype)
        else:
            new = QuantStackedWeight(shape, spec)
        if from_weights:
            new.set_quantized(*stored_array(_host(cell.weight), spec))
        setattr(parent, attr, new)
        _name(new, path)
        done += 1
    return done


def _stacked_pieces(source, name: str, E: int) -> Optional[List[str]]:
    """HF per-expert names of a stacked ``...mlp.experts.P.<suffix>`` tensor, or None."""
    parts = name.split(".")
    if len(parts) == 7 and parts[3] == "mlp" and parts[4] == "experts" and not parts[5].isdigit():
        stem, proj, suffix = ".".join(parts[:5]), parts[5], parts[6]
        return [f"{stem}.{e}.{proj}.{suffix}" for e in range(E)]
    return None


def load_quantized(model, opened, show_progress: bool = False) -> None:
    """Every parameter of a model built with quantized placeholders, from a quantized checkpoint."""
    from ms_deepseek.checkpoint.slice_readers import memmap, to_float32

    tensors = opened.weights.tensors
    E = opened.config.n_routed_experts or 0

    def raw(info):
        value = np.array(memmap(info)) if info.nbytes else np.zeros(info.shape)
        return value if info.dtype in ("I8", "U8") else to_float32(value, info.dtype).astype(np.float32)

    for name, param in model.parameters_and_names():
        if name.endswith("expert_placement") or ".lora_" in name:
            continue
        if name in tensors:
            value = raw(tensors[name])
        else:
            pieces = _stacked_pieces(opened.model, name, E)
            if pieces is None or any(p not in tensors for p in pieces):
                raise UserError(f"{opened.folder}: quantized checkpoint is missing tensor {name}")
            value = np.stack([raw(tensors[p]) for p in pieces])
        if tuple(value.shape) != tuple(param.shape):
            raise UserError(
                f"{opened.folder}: tensor {name} has shape {list(value.shape)}, the model expects {list(param.shape)}"
            )
        if param.dtype in (ms.int8, ms.uint8):
            param.set_data(Tensor(np.ascontiguousarray(value)))
        else:
            np_dtype = np.float16 if param.dtype == ms.float16 else np.float32
            param.set_data(Tensor(np.ascontiguousarray(value, np_dtype), dtype=param.dtype))
