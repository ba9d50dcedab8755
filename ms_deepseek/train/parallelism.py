"""How a run is laid out over its workers, as one strategy object: data parallel or sharded.

:class:`DataParallel` (``parallel.dp`` only: every rank holds the whole model, gradients are averaged by a
``DistributedGradReducer``, rank 0 writes whole checkpoints) and :class:`Sharded` (tp / pp / ep / optimizer
sharding, Ascend: the model is built unallocated, the step is wrapped by ``AutoParallel`` and compiled before
any weight is read, every rank reads and writes only its slices, the checkpoint has a ``layout.json``).
The trainer asks its layout (:func:`parallelism_of`) instead of branching on the layout itself.
"""

from __future__ import annotations

from typing import Dict

import numpy as np

from ms_deepseek.core.errors import UserError


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
        from ms_deepseek.train.distributed import RankMean

        return RankMean(world) if world > 1 else None  # logged values are averaged over the workers

    def eval_parallel(self, par):
        return None

    def prepare_restore(self, trainer):
        """Before a resume's tensors are read; the checkpoint layout to read for (None: whole tensors)."""
        return None

    def save(self, trainer, step: int, state: Dict):
        """Rank 0 writes whole tensors (experts in HF order whatever the placement); every rank takes part in
        the replicas' digest."""
        from ms_deepseek.checkpoint.tensors import hf_ordered
        from ms_deepseek.train.distributed import replica_digests

        if trainer.world > 1:  # every rank takes part: the replicas must hold the same weights
            state["replica_sha1"] = replica_digests(trainer.model_tensors, trainer.world)
        if trainer.rank != 0:
            return None
        # experts in HF order whatever the placement (a whole run's placement is contiguous today)
        return trainer.manager.save(
            step,
            hf_ordered(trainer.model_tensors, trainer.applied),
            hf_ordered(trainer.opt_tensors, trainer.applied),
            trainer.cfg,
            state,
            trainer.recipe.to_yaml(),
        )


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

    def build_model(self, cfg, weights_folder, show_progress: bool, config_changes: Dict):
        # Built without allocating (no_init_parameters); after the step compiles each rank reads only its
        # slices of the weights folder (a LoRA run: of its frozen base) or checkpoint (prepare_restore).
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

    def prepare_restore(self, trainer):
        """Compile the step (its parameters are slices then), find the parallel optimizer's cut, check the
        compiled layouts against the plan on every rank, and read this rank's slices of the weights (or the
        frozen base); returns the checkpoint layout a resume reads for."""
        from mindspore import Tensor

        shape = (trainer.k * trainer.rows, trainer.seq_len)  # [k * b, T]
        trainer.step_cell.compile(Tensor(np.zeros(shape, np.int32)), Tensor(np.zeros(shape, np.int32)))
        if trainer.par.optimizer_shard:  # the parallel optimizer's cut of each parameter, as compiled
            from ms_deepseek.checkpoint.opt_shard import OptimizerShards

            trainer.opt_shards = OptimizerShards.from_compiled(trainer.step_cell)
        layout = trainer._layout()
        # MindSpore's compiled layouts against the plan, before step 1: a mismatch stops here in one line,
        # on every rank (the others would wait in the step's first collective for this one)
        from ms_deepseek.parallel_apply import compiled_check as cc
        from ms_deepseek.parallel_plan.ranks import stage_of_rank
        from ms_deepseek.train.distributed import checked_on_every_rank

        def check():
            cc.check_parameter_layouts(
                cc.compiled_layouts(trainer.step_cell), layout, trainer.rank, trainer.par.optimizer_shard
            )
            cc.check_compiled_strategies(
                cc.compiled_strategies(trainer.step_cell),
                cc.planned_primitives(
                    trainer.model,
                    trainer.applied.strategies,
                    trainer.applied.stage_of_cell,
                    stage_of_rank(trainer.rank, trainer.par),
                ),
            )

        checked_on_every_rank(check, trainer.rank, trainer.world)
        trainer.converter.load_slices(trainer, layout)
        return layout

    def save(self, trainer, step: int, state: Dict):
        """Every rank writes its slices (experts in HF order by construction), rank 0 completes."""
        from ms_deepseek.checkpoint import training as ckpt_mod

        layout = trainer._layout()  # a rank file holds only its stage's tensors (layout.json: which stage)
        model = trainer._this_stage(trainer.model_tensors, layout)
        opt = trainer._this_stage(trainer.opt_tensors, layout.for_optimizer())
        if trainer.opt_shards is not None:  # files hold model-parallel slices: gather the optimizer's parts
            model, opt = trainer.opt_shards.gathered(model), trainer.opt_shards.gathered(opt)
        return ckpt_mod.save_sharded(
            trainer.manager,
            step,
            trainer.rank,
            layout,
            model,
            opt,
            trainer.cfg,
            state,
            trainer.recipe.to_yaml(),
            trainer.strategy_file,
        )


DATA_PARALLEL, SHARDED = DataParallel(), Sharded()


def parallelism_of(sharded: bool):
    """:class:`Sharded` for a layout that shards the model (``ParallelConfig.uses_semi_auto``), else
    :class:`DataParallel`."""
    return SHARDED if sharded else DATA_PARALLEL


def this_stage(tensors: Dict[str, object], layout, rank: int, par) -> Dict[str, object]:
    """The tensors this rank's pipeline stage holds (and those on every rank), as MindSpore's
    ``Cell.init_parameters_data`` (``mindspore/nn/cell.py``) initialises only the compiled stage's
    ``parallel_parameter_name_list``: the other stages' parameters are neither read, initialised
    nor saved here (``ShardLayout.tensors_of_rank``)."""
    if layout is None or par.pp == 1:
        return tensors
    mine = set(layout.tensors_of_rank(rank))
    return {n: t for n, t in tensors.items() if n in mine or n not in layout.tensors}
