"""Apply the sharding plan to a built model, from outside, in one fixed order.

:func:`apply_plan` (runs anywhere, compiles nothing):

1. tensor / expert / vocabulary parallel: every Cell or primitive whose path matches
   the plan table gets ``Primitive.shard(in_strategy, out_strategy)``; parameter
   layouts follow from the primitive that consumes them (checked here);
2. expert placement and the MoE's parallel degrees, all from the plan's layout (the
   config's ``ep_size`` is never read): each MoE layer's ``expert_placement`` [E, 2]
   table is written for ``parallel.ep`` (the lookup's experts-per-rank = E / ep), its
   token groups = ``parallel.dp`` and exchange view = ``parallel.ep`` (per-group
   dispatch), and the router's balance-loss device groups = ``parallel.ep``;
3. pipeline: decoder layers get ``pipeline_stage`` (embedding on the first stage,
   final norm and lm_head on the last);
4. recompute: "full" recomputes whole decoder layers, "selective" the attention scores.

The rest of the operators get their strategies by MindSpore's sharding propagation
(``AutoParallel(..., parallel_mode="sharding_propagation")``), so the model files
hold no strategies and the plan stays one table. On CPU (stand-alone) the strategies
are recorded but have no effect: the same model runs unsharded.

:func:`pipeline_wrap` + :func:`auto_parallel_wrap` (the ``AutoParallel`` API) set up the
distributed run (Ascend only: SEMI/AUTO parallel cannot compile on CPU).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import numpy as np

from ms_deepseek.config.parallel import ParallelConfig
from ms_deepseek.core.errors import UserError
from ms_deepseek.parallel_plan.custom_shard import custom_layouts
from ms_deepseek.parallel_plan.placement import buffer_order, placement_table
from ms_deepseek.parallel_plan.plan import STRATEGIC_PRIMITIVES, Plan, layer_stages
from ms_deepseek.parallel_plan.ranks import dataset_strategy
from ms_deepseek.parallel_plan.styles import Mesh, fit_layout, style_spec


@dataclass
class AppliedPlan:
    strategies: Dict[str, tuple] = field(default_factory=dict)  # primitive path -> (in, out)
    param_layouts: Dict[str, Tuple[int, ...]] = field(default_factory=dict)
    stage_of_cell: Dict[str, int] = field(default_factory=dict)  # cell path -> pipeline stage
    recomputed: List[str] = field(default_factory=list)  # cell / primitive paths
    placements: Dict[str, np.ndarray] = field(default_factory=dict)  # placement param name -> table
    expert_orders: Dict[str, np.ndarray] = field(default_factory=dict)  # experts path -> buffer order


def _is_primitive(obj) -> bool:
    from mindspore.ops.primitive import Primitive

    return isinstance(obj, Primitive)


def primitives_of(cell):
    """(attribute, primitive) pairs held directly by a cell."""
    for attr, value in vars(cell).items():
        if _is_primitive(value):
            yield attr, value
    for attr, value in getattr(cell, "_primitives", {}).items():
        if _is_primitive(value):
            yield attr, value


def _shard_custom(prim, layouts) -> None:
    """``prim.shard`` with ``mindspore.parallel.Layout`` objects for every input and output."""
    from mindspore.parallel import Layout

    layout = Layout(layouts.device_matrix, ("dp", "tp"))
    prim.shard(
        in_strategy=tuple(layout(*names) for names in layouts.inputs),
        out_strategy=tuple(layout(*names) for names in layouts.outputs),
    )


def _shard_named(prim, named) -> None:
    """``prim.shard`` with one ``mindspore.parallel.Layout`` per input (``named_layout.NamedLayout``)."""
    from mindspore.parallel import Layout

    layout = Layout(named.device_matrix, named.axes)
    prim.shard(in_strategy=tuple(layout(*names) for names in named.inputs))


def join_path(path: str, attr: str) -> str:
    return f"{path}.{attr}" if path else attr


def apply_plan(model, parallel: ParallelConfig, cfg=None, plan: Optional[Plan] = None) -> AppliedPlan:
    """Shard, place, stage and recompute ``model`` (a DeepseekV2ForCausalLM) per ``parallel``."""
    plan = plan or Plan()
    mesh = Mesh.from_parallel(parallel)
    cfg = cfg or getattr(model, "config", None)
    applied = AppliedPlan()
    cells = dict(model.cells_and_names())
    params = {p.name: p for p in model.get_parameters()}

    # 0. under SEMI_AUTO_PARALLEL, dropless MoE layers take the bounded exchange, whose primitives are the capacity
    # path's (model/moe.py); on one device and in plain data parallel they keep the sorted grouped-matmul path
    if parallel.uses_semi_auto:
        for cell in cells.values():
            if callable(getattr(cell, "use_bounded_exchange", None)):
                cell.use_bounded_exchange()
        cells = dict(model.cells_and_names())  # without the sorted path's cells it removed

    # 1. strategies on matched cells' primitives and on matched primitive paths
    for path, cell in cells.items():
        _shard_cell(path, cell, plan, mesh, applied)
        _shard_primitives(path, cell, plan, mesh, applied)
    _check_strategic(cells, applied, _sorted_dropless_paths(cells) if not parallel.uses_semi_auto else ())
    _param_layouts(params, plan, mesh, applied)
    _check_consumers(plan, mesh, cells, applied)

    # 2. expert placement
    if cfg is not None and cfg.has_moe:
        _place_experts(cells, parallel, cfg, applied)

    # 3. pipeline stages
    if cfg is not None:
        _assign_stages(cells, parallel, cfg, applied)

    # 4. recompute
    _recompute(cells, parallel, applied)

    # 5. frozen weights (a LoRA base) are not cut by the parallel optimizer: MindSpore would shard them too
    # (parallel_optimizer/opt_param_mgr.cc SplitParam checks size, not trainability) and all-gather them in
    # every forward; a quantized (uint8) base then fails to compile (its gradient path's ReduceScatter takes
    # no integer tensor). Whole on each replica is what the planner counts (parallel_plan.costs).
    if parallel.optimizer_shard:
        for param in params.values():
            if not param.requires_grad:
                param.parallel_optimizer = False
    return applied


def _shard_cell(path: str, cell, plan: Plan, mesh: Mesh, applied: AppliedPlan) -> None:
    """A cell the plan matches: its form for this layout and the strategies of its primitives."""
    hit = plan.match(path)
    if hit is None:
        return
    spec = style_spec(hit[1], mesh)
    if spec.is_primitive:
        raise UserError(f"parallel plan: {hit[0]!r} ({hit[1]}) names a primitive but {path!r} is a Cell")
    for attr, value in spec.attrs.items():  # the cell's form for this layout (the loss's split_vocab)
        setter = getattr(cell, f"set_{attr}", None)
        setter(value) if callable(setter) else setattr(cell, attr, value)
    for attr, (in_s, out_s) in spec.prims.items():
        prim = getattr(cell, attr, None)
        if prim is None or not _is_primitive(prim):
            continue  # e.g. a router without group top-k
        prim.shard(in_s, out_s) if out_s is not None else prim.shard(in_s)
        applied.strategies[join_path(path, attr)] = (in_s, out_s)
    for attr, named in spec.layouts.items():
        prim = getattr(cell, attr, None)
        if prim is None or not _is_primitive(prim):
            continue  # e.g. an int8 layer has no nibbles
        _shard_named(prim, named)
        applied.strategies[join_path(path, attr)] = (named.strategy(), None)


def _shard_primitives(path: str, cell, plan: Plan, mesh: Mesh, applied: AppliedPlan) -> None:
    """The primitives of a cell the plan matches by their own path (not already set through the cell)."""
    for attr, prim in primitives_of(cell):
        ppath = join_path(path, attr)
        if ppath in applied.strategies:
            continue
        phit = plan.match(ppath)
        if phit is None:
            continue
        spec = style_spec(phit[1], mesh)
        if not spec.is_primitive:
            raise UserError(f"parallel plan: {phit[0]!r} ({phit[1]}) names a Cell but {ppath!r} is a primitive")
        in_s, out_s = spec.prims[""]
        if type(prim).__name__ == "Custom":
            # the op Cell's non-data inputs (e.g. a CPU kernel's config tensor), replicated
            in_s = tuple(in_s) + tuple(getattr(cell, "strategy_tail", ()))
            # MindSpore 2.9 compiles a Custom op only with Layout objects (parallel_plan.custom_shard)
            _shard_custom(prim, custom_layouts(in_s, getattr(cell, "num_outputs", 1), mesh.dp, mesh.tp))
        else:
            prim.shard(in_s, out_s) if out_s is not None else prim.shard(in_s)
        applied.strategies[ppath] = (in_s, out_s)


def _sorted_dropless_paths(cells) -> tuple:
    """Paths of the sorted dropless MoE path's primitives and cells (``DeepseekV2MoE.sorted_path_members``)."""
    found = []
    for path, cell in cells.items():
        members = getattr(cell, "sorted_path_members", None)
        if callable(members):
            found += [join_path(path, m) for m in members()]
    return tuple(found)


def _check_strategic(cells, applied: AppliedPlan, exempt: tuple = ()) -> None:
    """Every primitive that moves sharded data must have a strategy; ``exempt``: paths (and what is under them)
    that run only outside SEMI_AUTO_PARALLEL, where MindSpore reads no strategy."""
    for path, cell in cells.items():
        for attr, prim in primitives_of(cell):
            ppath = join_path(path, attr)
            if any(ppath == e or ppath.startswith(e + ".") for e in exempt):
                continue
            if type(prim).__name__ in STRATEGIC_PRIMITIVES and ppath not in applied.strategies:
                raise UserError(
                    f"parallel plan: primitive {join_path(path, attr)} ({type(prim).__name__}) matches no rule"
                )


def _param_layouts(params, plan: Plan, mesh: Mesh, applied: AppliedPlan) -> None:
    """Parameter layouts (checked against the primitive that consumes each parameter by
    :func:`_check_consumers`)."""
    for name, param in params.items():
        pattern, layout = plan.param_layout(name, mesh)
        layout = fit_layout(tuple(param.shape), layout) if len(layout) == len(param.shape) else layout
        if len(layout) != len(param.shape):
            raise UserError(
                f"parallel plan: {name} has shape {tuple(param.shape)} but rule {pattern!r} "
                f"gives a {len(layout)}-axis layout {layout}"
            )
        for axis, (dim, k) in enumerate(zip(param.shape, layout)):
            if dim % k:
                raise UserError(f"parallel plan: {name} axis {axis} ({dim}) is not divisible by {k} (rule {pattern!r})")
        applied.param_layouts[name] = layout


def _assign_stages(cells, parallel: ParallelConfig, cfg, applied: AppliedPlan) -> None:
    """Pipeline stages: the embedding on the first, the final norm, lm_head and loss on the last."""
    stages = layer_stages(cfg.num_hidden_layers, parallel.pp, parallel.stage_layers)
    assignment = {
        "model.embed_tokens": 0,
        "model.norm": parallel.pp - 1,
        "lm_head": parallel.pp - 1,
        "loss_fn": parallel.pp - 1,
    }
    assignment.update({f"model.layers.{i}": s for i, s in enumerate(stages)})
    for path, stage in assignment.items():
        if path in cells:
            if parallel.pp > 1:
                cells[path].pipeline_stage = stage
            applied.stage_of_cell[path] = stage


def _check_consumers(plan: Plan, mesh: Mesh, cells, applied: AppliedPlan) -> None:
    for path, _cell in cells.items():
        hit = plan.match(path)
        if hit is None:
            continue
        spec = style_spec(hit[1], mesh)
        for suffix, (attr, index) in spec.consumers.items():
            name = join_path(path, suffix)
            ppath = join_path(path, attr)
            if name not in applied.param_layouts or ppath not in applied.strategies:
                continue
            strategy = applied.strategies[ppath][0][index]
            if tuple(strategy) != tuple(applied.param_layouts[name]):
                raise UserError(
                    f"parallel plan: {name} layout {applied.param_layouts[name]} differs from "
                    f"{ppath} input {index} strategy {strategy}"
                )


def _place_experts(cells, parallel: ParallelConfig, cfg, applied: AppliedPlan) -> None:
    import mindspore as ms

    E, ep, dp = cfg.n_routed_experts, parallel.ep, parallel.dp
    if dp % ep:
        raise UserError(f"parallel: ep={ep} must divide dp={dp} (the expert-parallel groups are carved out of dp)")
    table = placement_table(E, ep, parallel.expert_placement)
    order = buffer_order(table)
    identity = bool((order == np.arange(E)).all())
    for path, cell in cells.items():
        if not callable(getattr(cell, "set_expert_placement", None)):  # the MoE layers (DeepseekV2MoE)
            continue
        # one token group per data-parallel rank (capacity and slots per rank); the dp -> ep exchange view
        cell.set_expert_placement(table, groups=dp, ep=ep)
        applied.placements[cell.expert_placement.name] = table
        if not identity:
            # Buffer row r holds the tokens of expert order[r]; the batched matmul multiplies row r
            # by stacked weight r, so the stacked weights are permuted into buffer order.
            experts = cell.experts
            for attr in ("gate_proj", "up_proj", "down_proj"):
                holder = getattr(experts, attr)
                weight = getattr(holder, "weight", holder)  # a Parameter or a cell holding ``weight``
                if not weight.has_init:  # a lazy build (no data yet) loads its experts' slices in buffer order
                    weight.set_data(ms.Tensor(weight.asnumpy()[order]))
                for factor in (getattr(holder, "lora_A", None), getattr(holder, "lora_B", None)):
                    if factor is not None:  # a stacked LoRA adapter follows its expert weights
                        factor.weight.set_data(ms.Tensor(factor.weight.asnumpy()[order]))
            applied.expert_orders[join_path(path, "experts")] = order


def restore_expert_order(name: str, array: np.ndarray, applied: AppliedPlan) -> np.ndarray:
    """A stacked expert tensor (weight or its optimizer state) back in expert order, for saving."""
    for path, order in applied.expert_orders.items():
        # our names ("model.layers.1.mlp.experts.up_proj.weight") and optimizer states ("adam_m.<name>")
        if name.startswith(path + ".") or ("." + path + ".") in name:
            out = np.empty_like(array)
            out[order] = array
            return out
    return array


def recompute_segments(path: str) -> bool:
    """Whether ``path`` is a segment "full" recompute marks: a decoder layer, ``model.layers.<i>``, with or without a
    pipeline (MindFormers and Megatron recompute whole layers too). MindSpore must then replay each layer as its own
    region, which the compile check verifies (``verification/compile/check.py`` recompute_regions). With one region
    per layer a recomputed layer keeps one [tokens, H] for its backward; segments of each layer's sub-cells keep four
    (MindSpore's level-1 accounting of v2-lora-16npu: docs/measurements.md, "One recompute region per layer")."""
    parts = path.split(".")
    return parts[:2] == ["model", "layers"] and len(parts) == 3


def _recompute(cells, parallel: ParallelConfig, applied: AppliedPlan) -> None:
    if parallel.recompute == "none":
        return
    for path, cell in cells.items():
        if parallel.recompute == "full" and recompute_segments(path):
            if parallel.uses_semi_auto:
                # The layer's collectives are replayed with it (mp_comm_recompute); the optimizer shard's gathers
                # are not (MindSpore's default: nn/cell.py Cell.recompute only warns that True "is replaced with
                # zero3", and its gathers stay once per step: plan --compile counts them).
                cell.recompute(mp_comm_recompute=True, parallel_optimizer_comm_recompute=False)
            else:
                cell.recompute()
            applied.recomputed.append(path)
        elif parallel.recompute == "selective" and path.startswith("model.layers.") and path.endswith(".self_attn"):
            # The [B, nh, T, S] score tensors: the score matmul and the softmax are replayed in backward.
            cell.qk_bmm.recompute()
            applied.recomputed.append(join_path(path, "qk_bmm"))
            cell.softmax.recompute()
            applied.recomputed.append(join_path(path, "softmax"))


# ------------------------------------------------------------------ distributed context
def pipeline_stage_config(applied: AppliedPlan, prefix: str = "") -> Dict[str, int]:
    """``stage_config`` for ``mindspore.parallel.nn.Pipeline`` (cell paths under ``prefix``)."""
    return {join_path(prefix, path): stage for path, stage in applied.stage_of_cell.items()}


def pipeline_wrap(net_with_loss, parallel: ParallelConfig, applied: AppliedPlan, model_prefix: str = ""):
    """``mindspore.parallel.nn.Pipeline`` over the loss network when pp > 1 (micro-batches and the
    plan's stage of every cell; ``model_prefix`` is the model's attribute path inside the loss
    network), else the network itself. Ascend only. The step built around it must also hold the
    ``accu_grads.*`` buffers the pipeline pass accumulates into
    (:class:`ms_deepseek.train.step.PipelineGrads`, ``build_step(..., pipeline=True)``)."""
    if parallel.pp == 1:
        return net_with_loss
    from mindspore.parallel.nn import Pipeline

    return Pipeline(net_with_loss, parallel.micro_batches, stage_config=pipeline_stage_config(applied, model_prefix))


def search_mode(parallel: ParallelConfig) -> str:
    """How MindSpore completes the strategies the plan does not give.

    ``sharding_propagation`` (the plan's strategies spread to their neighbours) for one-stage layouts; with a
    pipeline (pp > 1) ``semi_auto`` (the operators without a strategy default to data parallel, MindSpore
    redistributes where they meet the plan's), MindFormers' mode for its pipeline models. Found by
    compiling: under a pipeline, sharding propagation across the stages' cell subgraphs fails
    ("tensor_redistribution init failed": a redistribution between tensors of unrelated cells,
    ``tensor_redistribution.cc`` "from shape size must be equal to to shape size") for every pipeline
    layout tried (the 16-, 64- and 256-NPU recipes, and dp, tp, pp and ep all 2), while ``semi_auto``
    compiles them and the compiled layouts and strategies match the plan."""
    if not parallel.uses_semi_auto:
        return "semi_auto"
    return "semi_auto" if parallel.pp > 1 else "sharding_propagation"


def auto_parallel_wrap(top_cell, parallel: ParallelConfig, strategy_file: Optional[str] = None):
    """Ascend only (needs ``communication.init``): the outermost training cell (forward, gradients and
    optimizer update) in ``AutoParallel`` with sharding propagation from the plan's strategies,
    optimizer sharding (``hsdp``), the 1F1B pipeline and the dataset strategy
    (:func:`ms_deepseek.parallel_plan.ranks.dataset_strategy`: what each rank really reads)."""
    from mindspore.parallel.auto_parallel import AutoParallel

    wrapped = AutoParallel(top_cell, parallel_mode=search_mode(parallel))
    wrapped.dataset_strategy(dataset_strategy(parallel))  # the same rule as the context API
    # No gradients mean: under (semi-)auto parallel the loss is the global batch's mean, so each rank's gradient
    # is its share of the global gradient and the mirror's AllReduce sum is the whole of it. With the mean on, the
    # mirror's backward multiplies that sum by 1 / replicas (mindspore/ops/_grad_experimental/grad_comm_ops.py,
    # the mean_flag branches of the mirror operators): every replicated parameter would get a fraction of its
    # gradient while the ep-split experts (no mirror) get all of theirs; plan --execute compares the compiled ranks
    # with one device and fails on it. MindFormers' semi-auto recipes run with gradients_mean: False.
    if parallel.optimizer_shard:
        wrapped.hsdp(shard_size=-1, threshold=64, optimizer_level="level1")
    if parallel.pp > 1:
        wrapped.pipeline(stages=parallel.pp, scheduler="1f1b")
    if strategy_file:
        wrapped.save_param_strategy_file(strategy_file)
    return wrapped


def eval_parallel_wrap(eval_cell, parallel: ParallelConfig):
    """Ascend only: the validation Cell (model + loss, no gradients) under ``AutoParallel`` with the
    training plan. The strategies need no second table: :func:`apply_plan` set them on the model's
    own primitives, which the eval graph shares with the training step; what is repeated here is
    the wrapper's context: sharding propagation, the dataset strategy (each rank feeds the same
    rows as in training, ``ranks.dataset_strategy``) and the pipeline stages.

    MindFormers' pattern for evaluation inside training (``mindformers/trainer/base_trainer.py``:
    ``wrap_eval_network_with_tool_cells`` wraps the bare network, no ``PipelineCell``, in the same
    parallel context as the train network; ``create_eval_dataset`` divides the eval batch by
    ``micro_batch_num`` under pp > 1): one micro-batch [rows, T] per call, the Cells' pipeline
    stages as in training, the last stage computing the loss (broadcast to the others). No micro-batch Pipeline wrapper:
    there is no backward to overlap. Optimizer-sharded parameters are gathered by the graph as
    in the training forward. Never compiled on CPU (SEMI/AUTO parallel needs Ascend)."""
    from mindspore.parallel.auto_parallel import AutoParallel

    wrapped = AutoParallel(eval_cell, parallel_mode=search_mode(parallel))
    wrapped.dataset_strategy(dataset_strategy(parallel))  # the training rule: (input_ids, labels)
    if parallel.optimizer_shard:
        wrapped.hsdp(shard_size=-1, threshold=64, optimizer_level="level1")  # the layouts training compiled
    if parallel.pp > 1:
        # pipeline inference: the last stage computes the loss; output_broadcast sends it to the other
        # stages (mindspore/parallel/auto_parallel.py AutoParallel.pipeline, "pipeline_result_broadcast"),
        # so every rank returns the same value
        wrapped.pipeline(stages=parallel.pp, output_broadcast=True)
    return wrapped
