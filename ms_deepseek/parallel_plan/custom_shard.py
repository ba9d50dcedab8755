"""How our custom operators (``ops.Custom``) are sharded the way the plan says, in the form MindSpore reads.

MindSpore 2.9.0's rule, found by compiling (``plan --recipe R --compile``): every
``Custom`` primitive gets a ``SelfDefineShardInfo`` (``ops_info/self_define_shard_info.cc``), which
accepts **only** ``mindspore.parallel.Layout`` objects for its inputs *and* outputs: a tuple strategy
is refused at compile ("self define shard op ... only support config layout rather than strategy"),
no shard at all fails ("tuple in tuple input does not support GenerateBatchParallelStrategy"). The
four CustomInfo attributes of ``custom_info.cc`` (``dev_matrix_shape``, ``inputs_tensor_map``,
``outputs_tensor_map``, ``as_loss_divisor``) are not among what it reads.

:func:`custom_layouts` turns the plan's per-axis split counts into the named axes of one layout:
the stage's device matrix ``(dp, tp)`` (``Layout((dp, tp), ("dp", "tp"))``; tp is the fastest axis,
as in the rank geometry, ``parallel_plan.ranks``), each tensor axis split by dp, tp, both or none. The
outputs are laid out like input 0 (our ops are element- or row-wise in their split axes). MindSpore
only checks the layouts' shape ("User needs to ensure the accuracy and correctness of input/output
layout"), so the op must compute on those slices: ours are independent per row / group.
:mod:`ms_deepseek.parallel_apply.apply` builds the ``Layout`` objects; the lint reads them back from the
primitive's ``in_layout`` / ``out_layout`` attributes (``mindspore/ops/primitive.py`` ``shard``).

``RepetitionPenalty`` runs only in PyNative generation (``ms_deepseek.generate``), never in a
sharded graph, so it gets no layouts.

Pure Python (no MindSpore import): the lint and ``plan --simulate`` use it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence, Tuple

from ms_deepseek.core.errors import UserError

AXES = ("dp", "tp")  # the stage's device matrix (dp, tp), tp fastest


@dataclass(frozen=True)
class CustomLayouts:
    device_matrix: Tuple[int, int]  # (dp, tp)
    inputs: Tuple[Tuple[object, ...], ...]  # per input, per axis: "dp", "tp", ("dp", "tp") or "None"
    outputs: Tuple[Tuple[object, ...], ...]


def _prod(xs) -> int:
    out = 1
    for x in xs:
        out *= int(x)
    return out


def _axis_names(strategy: Sequence[int], dp: int, tp: int, where: str) -> Tuple[object, ...]:
    """Per-axis alias of one tensor's split counts on the (dp, tp) matrix (each device axis used once)."""
    names, used = [], set()
    for k in (int(x) for x in strategy):
        if k == 1:
            names.append("None")
        elif k == dp * tp and dp > 1 and tp > 1 and not used:
            names.append(("dp", "tp"))
            used |= {"dp", "tp"}
        elif k == dp and "dp" not in used:
            names.append("dp")
            used.add("dp")
        elif k == tp and "tp" not in used:
            names.append("tp")
            used.add("tp")
        else:
            raise UserError(
                f"custom op strategy {where}: a split of {k} is not dp ({dp}), tp ({tp}) or dp x tp "
                "on the stage's device matrix"
            )
    return tuple(names)


def custom_layouts(in_strategy: Sequence[Sequence[int]], num_outputs: int, dp: int, tp: int) -> CustomLayouts:
    """The named-axis layouts of a custom op whose outputs are split like its input 0.

    Every other input must be split like input 0 or be replicated (our ops: ExpertLookup's placement
    table and the CPU kernels' config tensor are replicated)."""
    s0 = tuple(int(k) for k in in_strategy[0])
    where = str(tuple(map(tuple, in_strategy)))
    first = _axis_names(s0, dp, tp, where)
    inputs = [first]
    for i, s in enumerate(in_strategy[1:], start=1):
        s = tuple(int(k) for k in s)
        if all(k == 1 for k in s):
            inputs.append(("None",) * len(s))
        elif s == s0:
            inputs.append(first)
        else:
            raise UserError(
                f"custom op strategy {where}: input {i} {s} is neither replicated nor split like input 0 {s0}"
            )
    return CustomLayouts((dp, tp), tuple(inputs), tuple(first for _ in range(num_outputs)))


def splits_of(dev_matrix: Sequence[int], tensor_map: Sequence) -> Tuple[int, ...]:
    """Per-axis split counts a tensor map gives on a device matrix (MindSpore's convention: entry j of a
    map names device-matrix axis ``len(dev_matrix) - 1 - j``, -1 = not split; a tuple entry, several)."""
    n = len(dev_matrix)
    out = []
    for m in tensor_map:
        ms = m if isinstance(m, (tuple, list)) else (m,)
        out.append(_prod(1 if int(x) == -1 else int(dev_matrix[n - 1 - int(x)]) for x in ms))
    return tuple(out)


def check_custom_layouts(path: str, attrs: Mapping[str, object], in_strategy, stage_devices: int) -> str:
    """'' when the primitive's ``in_layout`` / ``out_layout`` (what ``shard`` with Layouts records) shard it as
    ``in_strategy`` says over the whole stage, else why not."""
    ins, outs = attrs.get("in_layout"), attrs.get("out_layout")
    if not ins or not outs:
        return (
            f"{path} (Custom): no in/out layouts: MindSpore 2.9 compiles a Custom op only with "
            f"mindspore.parallel.Layout objects for its inputs and outputs (SelfDefineShardInfo; "
            f"parallel.custom_shard.custom_layouts)"
        )
    if len(ins) != len(in_strategy):
        return f"{path} (Custom): {len(ins)} input layouts, the strategy has {len(in_strategy)} inputs"
    for i, (lay, s) in enumerate(zip(ins, in_strategy)):
        dev = tuple(int(k) for k in lay["device_matrix"])
        if _prod(dev) != stage_devices:
            return (
                f"{path} (Custom): input {i}'s device matrix {dev} covers {_prod(dev)} devices, the stage has "
                f"{stage_devices}"
            )
        got = splits_of(dev, lay["tensor_map"])
        if got != tuple(int(k) for k in s):
            return (
                f"{path} (Custom): input {i} layout {tuple(lay['tensor_map'])} on {dev} splits it {got}, the "
                f"plan's strategy says {tuple(s)}"
            )
    return ""
