"""How our custom operators (``ops.Custom``) are sharded the way the plan says, in the form MindSpore reads.

MindSpore's rule (``mindspore/ccsrc/frontend/parallel/step_parallel_utils.cc``,
``OperatorInstance`` / ``OperatorInstanceByName``): a primitive named ``Custom`` gets an
OperatorInfo of its own only

* with ``self_define_shard=True`` (then ``SelfDefineShardInfo``,
  ``ops_info/self_define_shard_info.cc``, which accepts only ``Layout`` objects for its
  inputs *and* outputs: ``CheckStrategy`` fails on plain strategies), or
* with all four attributes ``as_loss_divisor``, ``dev_matrix_shape``,
  ``inputs_tensor_map``, ``outputs_tensor_map`` (then ``CustomInfo``,
  ``ops_info/custom_info.cc``: ``InferDevMatrixShape`` / ``InferTensorMap`` /
  ``InferAsLossDivisor`` read exactly those attributes, ``CheckStrategy`` accepts any
  strategy).

Otherwise MindSpore logs "The attr for parallelization settings is not found in the custom
op", ignores ``shard()`` and makes the op BatchParallel (only axis 0 of each tensor split,
``batch_parallel_info.cc``) or, when axis 0 does not divide by the stage's device count,
StandAlone (every device computes the whole tensor).

We use the **CustomInfo** form: the plan's strategies are per-axis split counts, and the
four attributes are a direct, checkable translation of them (computed here, set by
:func:`ms_deepseek.sharding.apply.apply_plan` next to ``shard()``); ``self_define_shard``
would need ``mindspore.parallel.Layout`` objects with named device axes for every input and
output, a second description of the same thing. The device matrix is input 0's strategy
followed by the repeat (``stage devices / prod(strategy)``) as its **last** (fastest) axis,
which is MindSpore's own default for ordinary operators
(``operator_info.cc``, ``OperatorInfo::SetRepeatedCalcDevMatrix``: "set the
repeated_calc_num as the last dimension of dev-matrix in default"): the custom op then
agrees with the MatMul / BatchMatMul producers around it and needs no redistribution. The
matrix covers every device of the stage, so ``OperatorInfo::InferRepeatedCalcInfo`` finds
``repeated_calc_num_ = 1`` and does not add an axis of its own.

Tensor maps follow MindSpore's convention (``tensor_layout.cc`` / ``_tensor.py``
``_get_tensor_strategy``): entry ``j`` of a tensor's map names device-matrix axis
``len(dev_matrix) - 1 - j``, ``-1`` = not split.

``RepetitionPenalty`` runs only in PyNative generation (``ms_deepseek.generate``), never in a
sharded graph, so it gets no attributes.

Pure Python (no MindSpore import): the lint and ``plan --simulate`` use it.
"""

from __future__ import annotations

from typing import Dict, Mapping, Sequence, Tuple

from ms_deepseek.core.errors import UserError

# step_parallel_utils.cc OperatorInstanceByName: all four must be present (custom_info.cc reads them)
CUSTOM_INFO_ATTRS = ("as_loss_divisor", "dev_matrix_shape", "inputs_tensor_map", "outputs_tensor_map")
SELF_DEFINE_SHARD = "self_define_shard"  # step_parallel_utils.cc OperatorInstance: SELF_DEFINE_SHARD


def _prod(xs) -> int:
    out = 1
    for x in xs:
        out *= int(x)
    return out


def custom_info_attrs(in_strategy: Sequence[Sequence[int]], num_outputs: int,
                      stage_devices: int) -> Dict[str, object]:
    """The four CustomInfo attributes for a custom op whose outputs are split like its input 0.

    Every other input must be split like input 0 on the same axes or be replicated (our ops:
    ExpertLookup's placement table and the CPU kernels' config tensor are replicated)."""
    s0 = tuple(int(k) for k in in_strategy[0])
    used = _prod(s0)
    if used <= 0 or stage_devices % used:
        raise UserError(f"custom op strategy {tuple(map(tuple, in_strategy))}: {used} slices do not divide "
                        f"the stage's {stage_devices} devices")
    repeat = stage_devices // used
    dev = list(s0) + ([repeat] if repeat > 1 else [])
    n = len(dev)
    map0 = [n - 1 - j if k > 1 else -1 for j, k in enumerate(s0)]
    maps = [map0]
    for i, s in enumerate(in_strategy[1:], start=1):
        s = tuple(int(k) for k in s)
        if all(k == 1 for k in s):
            maps.append([-1] * len(s))
        elif s == s0:
            maps.append(list(map0))
        else:
            raise UserError(f"custom op strategy {tuple(map(tuple, in_strategy))}: input {i} {s} is neither "
                            f"replicated nor split like input 0 {s0} (CustomInfo needs one device matrix)")
    return {
        # custom_info.cc InferAsLossDivisor: output 0's repeat count (devices holding the same slice)
        "as_loss_divisor": repeat,
        "dev_matrix_shape": tuple(dev),
        "inputs_tensor_map": tuple(tuple(m) for m in maps),
        "outputs_tensor_map": tuple(tuple(map0) for _ in range(num_outputs)),
    }


def splits_of(dev_matrix: Sequence[int], tensor_map: Sequence[int]) -> Tuple[int, ...]:
    """Per-axis split counts a tensor map gives on a device matrix (MindSpore's convention)."""
    n = len(dev_matrix)
    return tuple(1 if m == -1 else int(dev_matrix[n - 1 - int(m)]) for m in tensor_map)


def check_custom_attrs(path: str, attrs: Mapping[str, object], in_strategy, stage_devices: int) -> str:
    """'' when the primitive's attributes make MindSpore shard it as ``in_strategy`` says, else why not."""
    if attrs.get(SELF_DEFINE_SHARD) is True:
        return ""  # SelfDefineShardInfo: the in/out layouts given to shard() are what MindSpore uses
    missing = [a for a in CUSTOM_INFO_ATTRS if a not in attrs]
    if missing:
        return (f"{path} (Custom): no {', '.join(missing)} attribute(s): MindSpore ignores its shard() strategy "
                f"and makes it BatchParallel or StandAlone (step_parallel_utils.cc OperatorInstanceByName: "
                f"'The attr for parallelization settings is not found in the custom op'); set CustomInfo's four "
                f"attributes (parallel.custom_shard.custom_info_attrs) or self_define_shard with layouts")
    dev = tuple(int(k) for k in attrs["dev_matrix_shape"])
    if _prod(dev) != stage_devices:
        return (f"{path} (Custom): dev_matrix_shape {dev} covers {_prod(dev)} devices, the stage has "
                f"{stage_devices} (operator_info.cc InferRepeatedCalcInfo would add a repeat axis)")
    maps = attrs["inputs_tensor_map"]
    if len(maps) != len(in_strategy):
        return f"{path} (Custom): inputs_tensor_map has {len(maps)} entries, the strategy {len(in_strategy)} inputs"
    for i, (m, s) in enumerate(zip(maps, in_strategy)):
        got = splits_of(dev, m)
        if got != tuple(int(k) for k in s):
            return (f"{path} (Custom): input {i} tensor map {tuple(m)} on dev matrix {dev} splits it {got}, "
                    f"the plan's strategy says {tuple(s)} (custom_info.cc uses the attributes, not shard())")
    return ""
