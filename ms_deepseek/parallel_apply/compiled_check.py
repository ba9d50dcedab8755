"""Before step 1 on Ascend: does the graph MindSpore compiled hold the layouts the plan says?

Used after every sharded compile: by ``train`` before step 1 on the cluster, and by the compile check
(``plan --recipe R --compile``: MindSpore's dry run on any machine, ``verification.compile.check``). It
compares MindSpore's answer with the plan and stops with one line naming the parameter or primitive
and both layouts (:class:`ms_deepseek.core.errors.UserError`), instead of training for hours on a
silent mismatch.

* Parameters: the compiled cell's ``parameter_layout_dict`` (``mindspore/train/serialization.py``
  and ``mindspore/parallel/_tensor.py`` ``_load_tensor_by_layout`` read each entry as
  ``[dev_matrix, tensor_map, slice_shape, field_size, uniform_split, opt_shard_group,
  full_shape, ...]``) against the plan's :class:`ms_deepseek.checkpoint.layout.ShardLayout`:
  for every device of the stage, the slice index MindSpore computes
  (``_tensor._get_tensor_slice_index``) must be the plan's, and the optimizer-shard group
  must be present exactly when the plan expects the parallel optimizer to cut the parameter
  (:func:`ms_deepseek.parallel_plan.plan.optimizer_shard_group`). Every parameter of this rank's
  stage must be in the compiled graph. A LoRA run's frozen base (float or quantized: what its loader reads
  by the plan) is compared the same way, and must have no optimizer-shard group.
* Primitives: the strategies MindSpore compiled (its graph executor's ``get_strategy``, keyed by
  operator scope) against the plan's, primitive by primitive. (Reading ``prim.attrs`` after the
  compile, as this check first did, could never fire: MindSpore marks a ``BatchParallel`` fallback on
  its C++ copy of the primitive, not on the Python object.)
"""

from __future__ import annotations

from typing import AbstractSet, Dict, List, Mapping, Optional, Sequence, Set, Tuple

import numpy as np

from ms_deepseek.core.dtypes import itemsize
from ms_deepseek.core.errors import UserError


def _fmt(dev, tmap) -> str:
    return f"dev_matrix {list(dev)} tensor_map {list(tmap)}"


def check_parameter_layouts(
    compiled: Mapping[str, Sequence],
    layout,
    rank: int,
    optimizer_shard: bool = False,
    threshold_kb: int = 64,
    frozen: Optional[Set[str]] = None,
) -> int:
    """Compare every tensor of ``rank``'s stage in ``layout`` with MindSpore's compiled entry.

    ``frozen``: with it, ``layout`` is a LoRA run's frozen base (float or quantized, ``checkpoint.layout.build_layout``)
    and only these names of it are compared: what the loader reads (``train/lora_run.py``) and the planner prices
    (``parallel_plan/costs.py``: whole slices by the plan, never cut by the parallel optimizer, as
    ``parallel_apply/apply.py`` marks them) must be what MindSpore compiled. A frozen tensor the step does not
    read (a quantized layer's ``weight_offset`` outside Ascend's fused int8 matmul) is not in the compiled
    graph, and is skipped. Returns how many parameters were compared; raises UserError naming the first mismatch."""
    from mindspore.parallel._tensor import _get_tensor_slice_index, _get_tensor_strategy

    from ms_deepseek.parallel_plan.plan import optimizer_shard_group

    devices = layout.stage_devices
    compared = 0
    for name in layout.tensors_of_rank(rank):
        t = layout.tensors[name]
        if t.stage < 0 or (frozen is not None and name not in frozen):
            continue
        if frozen is not None and name not in compiled:
            continue
        if name not in compiled:
            raise UserError(
                f"compiled layout: parameter {name} (stage {t.stage}) is not in the compiled graph of "
                f"rank {rank}; the plan puts it there with {_fmt(t.dev_matrix, t.tensor_map)}"
            )
        entry = compiled[name]
        dev, tmap = [int(k) for k in entry[0]], [int(m) for m in entry[1]]
        strategy = [int(k) for k in _get_tensor_strategy(dev, tmap)]
        ours = f"plan {_fmt(t.dev_matrix, t.tensor_map)} (splits {list(t.split)})"
        theirs = f"MindSpore {_fmt(dev, tmap)} (splits {strategy})"
        if len(tmap) != len(t.shape) or tuple(strategy) != tuple(t.split):
            raise UserError(f"compiled layout: parameter {name}: {theirs}, {ours}")
        for d in range(devices):
            mine = (
                int(np.ravel_multi_index([t.coordinate(d, a) for a in range(len(t.shape))], t.split)) if t.shape else 0
            )
            got = int(_get_tensor_slice_index(dev, strategy, tmap, d))
            if mine != got:
                raise UserError(
                    f"compiled layout: parameter {name}: device {d} of the stage holds slice {got} "
                    f"under {theirs}, slice {mine} under the {ours}"
                )
        group = str(entry[5]) if len(entry) > 5 and entry[5] else ""
        want = (
            frozen is None
            and optimizer_shard
            and optimizer_shard_group(t.shape, t.split, devices, itemsize(t.dtype), threshold_kb) > 1
        )
        if bool(group) != bool(want):
            raise UserError(
                f"compiled layout: parameter {name}: MindSpore's optimizer-shard group is "
                f"{group or 'none'}, the plan {'expects one' if want else 'expects none'} "
                f"({theirs})"
            )
        compared += 1
    return compared


def _scope_cell_path(scope: str) -> Optional[str]:
    """The model's cell path of one compiled operator's scope name, or None outside the model.

    MindSpore names an operator ``Default/<attr>-<Class>/.../<Type>-op<N>`` (``recompute_Default/...``
    when recomputed): the model's own path starts after the ``-DeepseekV2ForCausalLM`` component, and a
    CellList's item is ``<index>-<Class>``."""
    parts = scope.split("/")[:-1]
    for i, part in enumerate(parts):
        if part.endswith("-DeepseekV2ForCausalLM"):
            return ".".join(p.split("-", 1)[0] for p in parts[i + 1 :])
    return None


def compiled_strategies(cell) -> Dict[str, list]:
    """The operator strategies MindSpore compiled for ``cell`` (scope name -> per-input strategies):
    ``mindspore/graph/api.py`` ``_CellGraphExecutor._get_shard_strategy`` (the graph executor's
    ``get_strategy``), what it also writes to a strategy file."""
    from mindspore.graph.api import _cell_graph_executor

    return dict(_cell_graph_executor._get_shard_strategy(cell) or {})


def check_compiled_strategies(
    compiled: Mapping[str, Sequence],
    planned: Mapping[str, Tuple[str, tuple]],
    unreported: AbstractSet[str] = frozenset(),
) -> int:
    """The primitives the plan gives a strategy were compiled with that strategy.

    ``compiled``: :func:`compiled_strategies`; ``planned``: primitive path (``model.layers.1.mlp.to_experts``)
    -> (primitive type, in_strategy), see :func:`planned_primitives`. The compiled names carry the cell and
    the type, not the attribute, so the operators of one type in one cell are matched as multisets: a
    cell holds primitives the graph may not use (a Linear's LoRA matmuls without adapters) and the
    graph may hold functional operators of the same type with propagated strategies. A mismatch is a
    planned strategy found nowhere in its cell *and* a compiled one that is none of the planned: one of
    ours compiled with another strategy (e.g. MindSpore's ``BatchParallel`` fallback,
    ``step_parallel_utils.cc`` ``OperatorInstance``). ``unreported``: planned primitives MindSpore may leave out of
    its strategies (sharded by ``Layout`` objects, :func:`layout_sharded`: under semi_auto ``get_strategy`` omits
    them, under sharding propagation it lists them): their strategies count among the planned, their absence is
    no mismatch. Returns how many planned strategies were found."""
    by_cell: Dict[Tuple[str, str], List[tuple]] = {}
    for scope, strategy in compiled.items():
        path = _scope_cell_path(scope)
        if path is None:
            continue
        kind = scope.rsplit("/", 1)[-1].rsplit("-op", 1)[0]
        by_cell.setdefault((path, kind), []).append(tuple(tuple(int(k) for k in s) for s in strategy))
    wanted: Dict[Tuple[str, str], List[Tuple[str, tuple]]] = {}
    for ppath, (kind, in_s) in sorted(planned.items()):
        cell = ppath.rsplit(".", 1)[0] if "." in ppath else ""
        wanted.setdefault((cell, kind), []).append((ppath, tuple(tuple(int(k) for k in s) for s in in_s)))
    found = 0
    for key, entries in sorted(wanted.items()):
        got = by_cell.get(key)
        if not got:
            continue  # not in this graph (another stage's cell, or unused)
        planned_set = {s for _, s in entries}
        missing = [(p, s) for p, s in entries if s not in got and p not in unreported]
        stray = [s for s in got if s not in planned_set]
        found += sum(1 for _, s in entries if s in got)
        if missing and stray:
            path, want = missing[0]
            raise UserError(
                f"compiled strategy: primitive {path} ({key[1]}): the plan's strategy is "
                f"{[list(x) for x in want]}, MindSpore compiled {[list(x) for x in stray[0]]} "
                f"for a {key[1]} of that cell"
            )
    return found


def planned_primitives(
    model,
    strategies: Mapping[str, tuple],
    stage_of_cell: Optional[Mapping[str, int]] = None,
    stage: Optional[int] = None,
) -> Dict[str, Tuple[str, tuple]]:
    """path -> (primitive type, in_strategy) of every primitive of ``model`` the plan gave a strategy.

    With ``stage`` (the rank's pipeline stage; 0 without a pipeline, where every cell is on it) and the plan's
    ``stage_of_cell``, only the primitives of the cells on that stage (and of cells on none): MindSpore's scope names under a pipeline can carry another stage's
    cell (v2-sft-64npu, stage 7: the labels' shift named ``layers-CellList/1-DecoderLayer/mlp-DeepseekV2MoE/
    Concat``, where stage 7 holds layer 7 only), and layer 1's Concat then looked compiled with a strategy
    the plan never gave it."""
    from ms_deepseek.parallel_apply.apply import join_path, primitives_of

    def on_stage(path: str) -> bool:
        if stage is None or not stage_of_cell:
            return True
        owners = [c for c in stage_of_cell if path == c or path.startswith(c + ".")]
        return not owners or stage_of_cell[max(owners, key=len)] == stage

    out: Dict[str, Tuple[str, tuple]] = {}
    for path, cell in model.cells_and_names():
        if not on_stage(path):
            continue
        unused = set(getattr(cell, "graph_unused", ()))  # held for other code (model/quant.py's fused path)
        for attr, prim in primitives_of(cell):
            if attr in unused:
                continue
            p = join_path(path, attr)
            if p in strategies:
                out[p] = (getattr(prim, "name", type(prim).__name__), strategies[p][0])
    return out


def layout_sharded(model, planned: Mapping[str, Tuple[str, tuple]]) -> Set[str]:
    """The paths of ``planned`` whose primitive is sharded by ``mindspore.parallel.Layout`` objects (its ``in_layout``
    attribute, ``mindspore/ops/primitive.py`` ``shard``): ``check_compiled_strategies``' ``unreported``."""
    from ms_deepseek.parallel_apply.apply import join_path, primitives_of

    out: Set[str] = set()
    for path, cell in model.cells_and_names():
        for attr, prim in primitives_of(cell):
            p = join_path(path, attr)
            if p in planned and "in_layout" in (getattr(prim, "attrs", None) or {}):
                out.add(p)
    return out


def compiled_layouts(cell) -> Optional[Mapping[str, Sequence]]:
    """The compiled ``parameter_layout_dict`` (as ``checkpoint.opt_shard.OptimizerShards.from_compiled``)."""
    layouts = getattr(cell, "parameter_layout_dict", None)
    if not layouts:
        from mindspore.graph.api import _get_parameter_layout

        layouts = _get_parameter_layout() or {}
    return layouts
