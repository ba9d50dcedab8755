"""Before step 1 on Ascend: does the graph MindSpore compiled hold the layouts the plan says?

A sharded graph cannot be compiled on this CPU, so the plan, the lint and ``--simulate`` are
checked against MindSpore only by reading its sources. The first compile on a cluster is the
first time MindSpore itself answers; this module compares its answer with the plan and stops
the run with one line naming the parameter or primitive and both layouts
(:class:`ms_deepseek.core.errors.UserError`), instead of training for hours on a silent mismatch.

* Parameters: the compiled cell's ``parameter_layout_dict`` (``mindspore/train/serialization.py``
  and ``mindspore/parallel/_tensor.py`` ``_load_tensor_by_layout`` read each entry as
  ``[dev_matrix, tensor_map, slice_shape, field_size, uniform_split, opt_shard_group,
  full_shape, ...]``) against the plan's :class:`ms_deepseek.checkpoint.layout.ShardLayout`:
  for every device of the stage, the slice index MindSpore computes
  (``_tensor._get_tensor_slice_index``) must be the plan's, and the optimizer-shard group
  must be present exactly when the plan expects the parallel optimizer to cut the parameter
  (:func:`ms_deepseek.parallel.plan.optimizer_shard_group`). Every parameter of this rank's
  stage must be in the compiled graph.
* Primitives: a primitive MindSpore found no OperatorInfo for carries ``BatchParallel`` or
  ``StandAlone`` after the compile (``step_parallel_utils.cc`` ``OperatorInstance``:
  ``prim->AddAttr(BATCH_PARALLEL / STAND_ALONE, true)``); one of ours with a plan strategy
  must not.
"""

from __future__ import annotations

from typing import Dict, Mapping, Optional, Sequence

import numpy as np

from ms_deepseek.core.errors import UserError
from ms_deepseek.core.dtypes import itemsize

# ops_utils.h BATCH_PARALLEL = "BatchParallel"; StandAloneInfo's name (stand_alone_info.cc)
FALLBACK_ATTRS = ("BatchParallel", "StandAlone", "stand_alone")


def _fmt(dev, tmap) -> str:
    return f"dev_matrix {list(dev)} tensor_map {list(tmap)}"


def check_parameter_layouts(compiled: Mapping[str, Sequence], layout, rank: int,
                            optimizer_shard: bool = False, threshold_kb: int = 64) -> int:
    """Compare every tensor of ``rank``'s stage in ``layout`` with MindSpore's compiled entry.

    Returns how many parameters were compared; raises UserError naming the first mismatch."""
    from mindspore.parallel._tensor import _get_tensor_slice_index, _get_tensor_strategy

    from ms_deepseek.parallel.plan import optimizer_shard_group

    devices = layout.stage_devices
    compared = 0
    for name in layout.tensors_of_rank(rank):
        t = layout.tensors[name]
        if t.stage < 0:
            continue
        if name not in compiled:
            raise UserError(f"compiled layout: parameter {name} (stage {t.stage}) is not in the compiled graph of "
                            f"rank {rank}; the plan puts it there with {_fmt(t.dev_matrix, t.tensor_map)}")
        entry = compiled[name]
        dev, tmap = [int(k) for k in entry[0]], [int(m) for m in entry[1]]
        strategy = [int(k) for k in _get_tensor_strategy(dev, tmap)]
        ours = f"plan {_fmt(t.dev_matrix, t.tensor_map)} (splits {list(t.split)})"
        theirs = f"MindSpore {_fmt(dev, tmap)} (splits {strategy})"
        if len(tmap) != len(t.shape) or tuple(strategy) != tuple(t.split):
            raise UserError(f"compiled layout: parameter {name}: {theirs}, {ours}")
        for d in range(devices):
            mine = int(np.ravel_multi_index([t.coordinate(d, a) for a in range(len(t.shape))], t.split)) \
                if t.shape else 0
            got = int(_get_tensor_slice_index(dev, strategy, tmap, d))
            if mine != got:
                raise UserError(f"compiled layout: parameter {name}: device {d} of the stage holds slice {got} "
                                f"under {theirs}, slice {mine} under the {ours}")
        group = str(entry[5]) if len(entry) > 5 and entry[5] else ""
        want = optimizer_shard and optimizer_shard_group(t.shape, t.split, devices, itemsize(t.dtype),
                                                         threshold_kb) > 1
        if bool(group) != bool(want):
            raise UserError(f"compiled layout: parameter {name}: MindSpore's optimizer-shard group is "
                            f"{group or 'none'}, the plan {'expects one' if want else 'expects none'} "
                            f"({theirs})")
        compared += 1
    return compared


def check_primitives(prim_attrs: Mapping[str, Mapping[str, object]], strategies: Mapping[str, tuple]) -> int:
    """No primitive the plan gives a strategy was made BatchParallel / StandAlone by MindSpore."""
    compared = 0
    for path, (in_s, _) in sorted(strategies.items()):
        attrs = prim_attrs.get(path)
        if attrs is None:
            continue
        fallback = next((a for a in FALLBACK_ATTRS if attrs.get(a)), None)
        if fallback is not None:
            raise UserError(f"compiled layout: primitive {path}: MindSpore made it {fallback} "
                            f"(no OperatorInfo: step_parallel_utils.cc OperatorInstance), the plan's strategy "
                            f"is {tuple(map(tuple, in_s))}")
        compared += 1
    return compared


def primitive_attrs(model, strategies: Mapping[str, tuple]) -> Dict[str, Mapping[str, object]]:
    """path -> the attributes of each planned primitive of ``model`` (after the compile)."""
    from ms_deepseek.sharding.apply import _join, _primitives_of

    out: Dict[str, Mapping[str, object]] = {}
    for path, cell in model.cells_and_names():
        for attr, prim in _primitives_of(cell):
            p = _join(path, attr)
            if p in strategies:
                out[p] = dict(getattr(prim, "attrs", {}) or {})
    return out


def compiled_layouts(cell) -> Optional[Mapping[str, Sequence]]:
    """The compiled ``parameter_layout_dict`` (as ``checkpoint.opt_shard.OptimizerShards.from_compiled``)."""
    layouts = getattr(cell, "parameter_layout_dict", None)
    if not layouts:
        from mindspore.graph.api import _get_parameter_layout

        layouts = _get_parameter_layout() or {}
    return layouts
