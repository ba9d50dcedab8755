"""Shards named by device axis (``mindspore.parallel.Layout`` form), for operators whose tuple strategy would
not say which device axis a split takes: the primitives of a quantized layer's dequantisation.

The styles of :mod:`ms_deepseek.parallel_plan.styles` carry them in ``StyleSpec.layouts``;
:func:`ms_deepseek.parallel_apply.apply.apply_plan` gives them to ``Primitive.shard``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

Strategy = Tuple[Tuple[int, ...], ...]


@dataclass(frozen=True)
class NamedLayout:
    """A primitive's shard in ``mindspore.parallel.Layout`` form: the stage's device matrix with named axes and,
    per input, the device axis each tensor axis is split over ("None": whole; a scalar input has no axes).

    A tuple strategy names only split counts: a split that uses fewer than all the stage's devices takes the
    device matrix's leading (slowest) axes, the rest repeating rightmost (MindSpore
    ``ops_info/operator_info.cc`` ``OperatorInfo::SetRepeatedCalcDevMatrix``), so
    a weight split tp ways by an elementwise operator lands on the devices' dp index, where the plan's MatMuls
    put tp fastest (checkpoint/layout.py ``_dev_matrix_for``): on dp 2 x tp 2 an ExpandDims sharded ``((2, 1),)``
    gives the weight it reads the tensor map [1, -1] on a [2, 2] matrix, ``Layout((2, 2), ("dp", "tp"))("tp",
    "None")`` gives [0, -1], the MatMul's."""

    device_matrix: Tuple[int, ...]
    axes: Tuple[str, ...]
    inputs: Tuple[Tuple[str, ...], ...]

    def strategy(self) -> Strategy:
        """The same shard as split counts per input axis."""
        size = dict(zip(self.axes, self.device_matrix))
        return tuple(tuple(size.get(name, 1) for name in names) for names in self.inputs)


def dequant_layouts(device_matrix: Tuple[int, ...], axes: Tuple[str, ...], weight: Tuple[str, ...]):
    """The shards of a quantized layer's dequantisation (model/quant.py ``DEQUANT_PRIMITIVES``), all split like
    its weight [.., out, in] (``weight``: the device axis of each weight axis; the stored int8 [.., out, in] or
    packed int4 [.., out, in/2] splits the same way, a byte holding two adjacent columns).

    Every step is named: an operator without a strategy takes semi_auto's default (under a pipeline), its first
    axis split over all the stage's devices (MindSpore ``frontend/parallel/step_parallel.cc``
    ``ExtractStrategyAndInit`` -> ``GenerateBatchParallelStrategy``; ``ops_info/operator_info.cc``
    ``GenerateBatchStrategiesBySplitFlag``), and the weight and its scales take the layout of the operator that
    reads them: at dp 2 tp 2 pp 2 a replicated int4 weight [48, 32] would be held as [12, 32] on each device.
    The scale / offset [.., out, in/G] split like the weight on both axes: the dequantisation Mul on
    [.., out, in/G, G] keeps the weight's split of ``in`` (group-wise: on the groups, which the scale shares;
    per channel: on G = in, against a scale [.., out, 1, 1] whose one-group axis stays whole, see ``fit_layout``)."""
    w = tuple(weight)
    ints = w + ("None",)  # the unpacked integers [.., out, in, 1] / [.., out, in/2, 2]
    lead = w[:-1]
    inputs = {
        "unpack_first": (w,),  # ExpandDims of the stored weight
        "unpack_cast": (ints,),
        "nibble_div": (ints, ("None",)),  # against the divisors (1, 16)
        "nibble_bias": (ints, ()),
        "nibble_mod": (ints, ()),
        "nibble_center": (ints, ()),
        "int_cast": (ints,),
        "scale_expand": (lead + ("None",),),  # a per-channel scale [.., out, 1]
        "group_scale_expand": (w,),  # group-wise [.., out, in/G]
        "dequant_mul": (lead + ("None", w[-1]), lead + ("None", "None")),
        "group_dequant_mul": (ints, ints),
        "weight_cast": (w,),  # the dequantised weight [.., out, in] to the compute dtype
    }
    return {attr: NamedLayout(tuple(device_matrix), tuple(axes), ins) for attr, ins in inputs.items()}
