"""How a run is laid out over its workers, as one strategy object: data parallel or sharded.

:class:`DataParallel` (``parallel.dp`` only: every rank holds the whole model, gradients are averaged by a
``DistributedGradReducer``, rank 0 writes whole checkpoints) and :class:`Sharded` (tp / pp / ep / optimizer
sharding, Ascend: the model is built unallocated, the step is wrapped by ``AutoParallel`` and compiled before
any weight is read, every rank reads and writes only its slices, the checkpoint has a ``layout.json``).
The trainer asks its layout (:func:`parallelism_of`) instead of branching on the layout itself. A strategy
is given the run (:class:`~.context.RunContext`) and its tensors (:class:`~.context.TrainTensors`), never
the trainer; it writes and reads the checkpoint's tensors for the checkpointer (``components.Checkpointer``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, Optional

import numpy as np

from ms_deepseek.core.errors import UserError
from ms_deepseek.train.context import RunContext, TrainTensors


class DataParallel:
    """Whole model on every rank; gradients and logged values averaged over the ranks here."""

    sharded = False
    static_shapes = False

    def check(self, recipe, device: str) -> None:
        """Refusals about the layout on ``device`` that need nothing built (none for data parallel)."""

    def workers_message(self, par) -> str:
        return f"parallel.dp: {par.dp}"

    def log_rank(self, par) -> int:
        return 0

    def data_coordinates(self, rank: int, world: int, par, micro_batch: int):
        return rank, world, micro_batch

    def block_rows(self, par, micro_batch: int, micro_batches: int) -> int:
        return 1  # each worker cuts its own micro-batches from its own rows

    def build_model(self, cfg, weights_folder, show_progress: bool, config_changes: Dict):
        from ms_deepseek.model.causal_lm import DeepseekV2ForCausalLM

        if weights_folder is not None:
            return DeepseekV2ForCausalLM.from_pretrained(weights_folder, show_progress=show_progress, **config_changes)
        return DeepseekV2ForCausalLM(cfg)

    def grad_reducer(self, optimizer, world: int):
        from mindspore import nn

        return nn.DistributedGradReducer(optimizer.parameters, mean=True, degree=world) if world > 1 else None

    def wrap_step(self, step_cell, par, strategy_file):
        return step_cell

    def stats_mean(self, world: int):
        from ms_deepseek.jobs.distributed import RankMean

        return RankMean(world) if world > 1 else None  # logged values are averaged over the workers

    def eval_parallel(self, par):
        return None

    def materialize(self, ctx: RunContext, tensors: TrainTensors, converter, fresh: bool):
        """The model was built whole and read its weights then: nothing to do; whole tensors (no layout)."""
        return None

    def replica_state(self, ctx: RunContext, tensors: TrainTensors) -> Dict:
        """``replica_sha1``: every rank's digest of its model tensors, which must be the same (every rank takes
        part); nothing on one worker."""
        from ms_deepseek.jobs.distributed import replica_digests

        return {"replica_sha1": replica_digests(tensors.model_tensors, ctx.world)} if ctx.world > 1 else {}

    def save(self, ctx: RunContext, tensors: TrainTensors, manager, step: int, state: Dict) -> Optional[Path]:
        """Rank 0 writes whole tensors (experts in HF order whatever the placement)."""
        from ms_deepseek.checkpoint.tensors import hf_ordered

        if ctx.rank != 0:
            return None
        return manager.save(
            step,
            hf_ordered(tensors.model_tensors, tensors.applied),
            hf_ordered(tensors.opt_tensors, tensors.applied),
            ctx.cfg,
            state,
            ctx.recipe.to_yaml(),
        )

    def load(self, ctx: RunContext, tensors: TrainTensors, folder: Path) -> None:
        """The checkpoint's model and optimizer tensors, whole, whatever layout wrote them."""
        read_checkpoint(ctx, tensors, folder, None)


class Sharded:
    """tp / pp / ep / optimizer sharding (Ascend): slices per rank, AutoParallel inserts the reductions."""

    sharded = True
    static_shapes = True

    def check(self, recipe, device: str) -> None:
        par = recipe.parallel
        if device == "CPU":
            raise UserError(
                f"parallel: {par.describe()} shards the model (tp / pp / ep / optimizer sharding), "
                "which MindSpore compiles only on Ascend; on CPU train data-parallel layouts "
                "(parallel.dp only), and size this one with `ms-deepseek plan` / `launch --dry-run`"
            )
        if recipe.data.bucket_boundaries is not None:
            raise UserError(
                f"data.bucket_boundaries: {par.describe()} compiles one graph shape on every rank, so "
                "SFT batches are padded to seq_len (no length buckets); leave it out for this layout"
            )

    def workers_message(self, par) -> str:
        return f"parallel: {par.describe()}"

    def log_rank(self, par) -> int:
        return (par.pp - 1) * par.dp * par.tp  # with pipeline parallelism only the last stage has the loss

    def data_coordinates(self, rank: int, world: int, par, micro_batch: int):
        from ms_deepseek.parallel_plan.ranks import data_coordinates

        return data_coordinates(rank, par, micro_batch)

    def block_rows(self, par, micro_batch: int, micro_batches: int) -> int:
        from ms_deepseek.parallel_plan.ranks import block_rows

        return block_rows(par, micro_batch, micro_batches)

    def build_model(self, cfg, weights_folder, show_progress: bool, config_changes: Dict):
        # Built without allocating (no_init_parameters); after the step compiles each rank reads only its
        # slices of the weights folder (a LoRA run: of its frozen base) or checkpoint (materialize, load).
        # LoRA adapters are attached after this, with their data.
        from mindspore.nn.utils import no_init_parameters

        from ms_deepseek.model.causal_lm import DeepseekV2ForCausalLM

        with no_init_parameters():
            return DeepseekV2ForCausalLM(cfg)

    def grad_reducer(self, optimizer, world: int):
        return None

    def wrap_step(self, step_cell, par, strategy_file):
        from ms_deepseek.parallel_apply.apply import auto_parallel_wrap

        strategy_file.parent.mkdir(parents=True, exist_ok=True)
        return auto_parallel_wrap(step_cell, par, str(strategy_file))

    def stats_mean(self, world: int):
        return None

    def eval_parallel(self, par):
        return par

    def materialize(self, ctx: RunContext, tensors: TrainTensors, converter, fresh: bool):
        """Compile the step (its parameters are slices then), find the parallel optimizer's cut, check the
        compiled layouts against the plan on every rank, and read this rank's slices of the weights or the
        frozen base (``fresh``: no checkpoint is read after this); returns the checkpoint layout."""
        from mindspore import Tensor

        from ms_deepseek.jobs.distributed import checked_on_every_rank

        zeros = Tensor(np.zeros(tensors.input_shape, np.int32))  # [k * b, T]
        tensors.step_cell.compile(zeros, zeros)
        if ctx.par.optimizer_shard:  # the parallel optimizer's cut of each parameter, as compiled
            from ms_deepseek.checkpoint.opt_shard import OptimizerShards

            tensors.opt_shards = OptimizerShards.from_compiled(tensors.step_cell)
        layout = checkpoint_layout(ctx, tensors.opt_tensors)
        # MindSpore's compiled layouts against the plan, before step 1: a mismatch stops here in one line,
        # on every rank (the others would wait in the step's first collective for this one)
        checked_on_every_rank(lambda: check_compiled(ctx, tensors, layout), ctx.rank, ctx.world)
        converter.load_slices(ctx, tensors, layout, fresh)
        return layout

    def replica_state(self, ctx: RunContext, tensors: TrainTensors) -> Dict:
        """Nothing: the ranks hold different slices (the digests of every rank's files are in ``files``)."""
        return {}

    def save(self, ctx: RunContext, tensors: TrainTensors, manager, step: int, state: Dict) -> Optional[Path]:
        """Every rank writes its slices (experts in HF order by construction), rank 0 completes."""
        from ms_deepseek.checkpoint import training as ckpt_mod

        layout = checkpoint_layout(ctx, tensors.opt_tensors)  # a rank file holds only its stage's tensors
        model = this_stage(tensors.model_tensors, layout, ctx.rank, ctx.par)
        opt = this_stage(tensors.opt_tensors, layout.for_optimizer(), ctx.rank, ctx.par)
        if tensors.opt_shards is not None:  # files hold model-parallel slices: gather the optimizer's parts
            model, opt = tensors.opt_shards.gathered(model), tensors.opt_shards.gathered(opt)
        content = ckpt_mod.RankCheckpoint(model, opt, ctx.cfg, state, ctx.recipe.to_yaml(), tensors.strategy_file)
        return ckpt_mod.save_sharded(manager, step, ctx.rank, layout, content)

    def load(self, ctx: RunContext, tensors: TrainTensors, folder: Path) -> None:
        """This rank's slices of the checkpoint's model and optimizer tensors, whatever layout wrote them."""
        read_checkpoint(ctx, tensors, folder, checkpoint_layout(ctx, tensors.opt_tensors))


DATA_PARALLEL, SHARDED = DataParallel(), Sharded()


def parallelism_of(sharded: bool):
    """:class:`Sharded` for a layout that shards the model (``ParallelConfig.uses_semi_auto``), else
    :class:`DataParallel`."""
    return SHARDED if sharded else DATA_PARALLEL


def checkpoint_layout(ctx: RunContext, opt_tensors: Dict[str, object]):
    """Which slice of every checkpointed model tensor (a LoRA run: adapters and trained routers) and
    optimizer tensor this run's ranks hold (``checkpoint.layout``)."""
    from ms_deepseek.checkpoint.layout import build_layout

    layout = build_layout(ctx.cfg, ctx.par, lora=ctx.recipe.lora)
    full = {n: t.shape for n, t in layout.tensors.items()}
    return layout.with_optimizer(
        {n: (full.get(n.split(".", 1)[-1], tuple(p.shape)), "F32") for n, p in opt_tensors.items()}
    )


def frozen_base_layout(ctx: RunContext):
    """A LoRA run's whole model as its loader reads it (float, or quantized with a ``quant:`` section:
    ``lora_run.LoraModel.load_slices``), None for a run that checkpoints every tensor."""
    from ms_deepseek.checkpoint.layout import build_layout

    if ctx.recipe.lora is None:
        return None
    return build_layout(ctx.cfg, ctx.par, quant=ctx.recipe.quant)


def check_compiled(ctx: RunContext, tensors: TrainTensors, layout):
    """The compiled step's parameter layouts (a LoRA run: its frozen base's too) and primitive strategies against
    the plan; returns how many of each were compared (UserError on a mismatch, naming it)."""
    from ms_deepseek.parallel_apply import compiled_check as cc
    from ms_deepseek.parallel_plan.ranks import stage_of_rank

    step_cell, applied = tensors.step_cell, tensors.applied
    compiled = cc.compiled_layouts(step_cell)
    compared = cc.check_parameter_layouts(compiled, layout, ctx.rank, ctx.par.optimizer_shard)
    base = frozen_base_layout(ctx)
    if base is not None:  # a LoRA run's frozen base, read by the plan's layout (lora_run.LoraModel.load_slices)
        frozen = set(base.tensors) - set(layout.tensors)
        compared += cc.check_parameter_layouts(compiled, base, ctx.rank, ctx.par.optimizer_shard, frozen=frozen)
    planned = cc.planned_primitives(
        tensors.model, applied.strategies, applied.stage_of_cell, stage_of_rank(ctx.rank, ctx.par)
    )
    strategies = cc.check_compiled_strategies(
        cc.compiled_strategies(step_cell), planned, cc.layout_sharded(tensors.model, planned)
    )
    return compared, strategies


def this_stage(tensors: Dict[str, object], layout, rank: int, par) -> Dict[str, object]:
    """The tensors this rank's pipeline stage holds (and those on every rank), as MindSpore's
    ``Cell.init_parameters_data`` (``mindspore/nn/cell.py``) initialises only the compiled stage's
    ``parallel_parameter_name_list``: the other stages' parameters are neither read, initialised
    nor saved here (``ShardLayout.tensors_of_rank``)."""
    if layout is None or par.pp == 1:
        return tensors
    mine = set(layout.tensors_of_rank(rank))
    return {n: t for n, t in tensors.items() if n in mine or n not in layout.tensors}


def read_checkpoint(ctx: RunContext, tensors: TrainTensors, folder: Path, layout) -> None:
    """A resume's model and optimizer tensors (this rank's slices with a ``layout``), read for this run's
    layout from a checkpoint whole or sharded, of any layout."""
    from ms_deepseek.checkpoint.opener import open_for_resume
    from ms_deepseek.checkpoint.tensors import restore_into

    resumed = open_for_resume(folder)
    opt_layout = layout and layout.for_optimizer()
    for what, mine, src, lay in (
        ("model", tensors.model_tensors, resumed.model, layout),
        ("optimizer", tensors.opt_tensors, resumed.optimizer, opt_layout),
    ):
        restore_into(
            this_stage(mine, lay, ctx.rank, ctx.par),
            src,
            what,
            layout=lay,
            rank=ctx.rank,
            applied=tensors.applied,
            part=tensors.part,
        )


def read_weight_slices(ctx: RunContext, tensors: TrainTensors, layout, params: Dict[str, object]) -> None:
    """Sharded run: this rank's slices of ``params`` from the weights folder, or a seeded random init."""
    from ms_deepseek.checkpoint.opener import open_checkpoint
    from ms_deepseek.checkpoint.tensors import restore_into

    weights = ctx.recipe.weights_folder
    if weights is None:
        mine = this_stage({p.name: p for p in tensors.model.get_parameters()}, layout, ctx.rank, ctx.par)
        for param in mine.values():  # nothing to read: materialise the seeded init (this stage only)
            if param.has_init:
                param.init_data()
        return
    restore_into(
        this_stage(params, layout, ctx.rank, ctx.par),
        open_checkpoint(weights).model,
        "model",
        layout=layout,
        rank=ctx.rank,
        part=tensors.part,
    )
