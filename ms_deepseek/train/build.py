"""The parts of a run, built from the recipe and the :class:`~.context.RunContext`, in the trainer's order.

* :func:`check_layout`: refusals about the layout that need nothing built, and the planner's verdict
  (:func:`fit_plan`);
* :func:`build_data`: this rank's training batches and validation sets (:class:`TrainData`, a stateful part);
* :func:`build_model`: the model, its converter (LoRA) and the parallel plan applied to it;
* :func:`build_step`: the optimizer and the compiled step, as :class:`~.context.TrainTensors`.

:class:`ms_deepseek.train.trainer.Trainer` builds a run from these; so do the compile check's worker
(``verification/compile/worker.py``, shapes only) and ``plan --execute``'s one-device reference
(``verification/execute/one_device.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Tuple

import numpy as np

from ms_deepseek.config.recipe import Recipe
from ms_deepseek.core.errors import UserError
from ms_deepseek.core.runtime import allow_graph_depth, detect_device, skip_parameter_load_copies
from ms_deepseek.jobs.distributed import is_distributed
from ms_deepseek.train.context import ModelConverter, ModelSource, RunContext, TrainTensors


def fit_plan(recipe: Recipe, force: bool = False):
    """The memory planner's verdict (``ms_deepseek.parallel_plan.planner``) on the recipe's layout.

    UserError when it does not fit, unless ``force`` / ``parallel.force``; the result also
    sizes the device memory pool reserved before compile."""
    from ms_deepseek.parallel_plan.planner import check_recipe_fits

    result = check_recipe_fits(recipe)  # its sequence length, batch, LoRA and quantized base
    if not result.fits and not (force or recipe.parallel.force):
        why = (
            "; ".join(result.problems)
            if result.problems
            else f"needs {result.peak_gb:.1f} GB per NPU of {result.usable_gb:.1f} GB usable"
        )
        if not result.problems and result.eval_note:  # validation sets the peak: say how to lower it
            why += f"; {result.eval_note}: set it, or remove data.validation"
        raise UserError(
            f"parallel: {recipe.parallel.describe()} does not fit ({why}); see `ms-deepseek plan`, "
            "or pass --force (parallel.force: true) to run anyway"
        )
    return result


def check_layout(recipe: Recipe, strategy, force: bool, device: Optional[str] = None):
    """Refusals about the layout on this machine that need nothing built; returns the planner's verdict."""
    device = device or detect_device()
    par = recipe.parallel
    strategy.check(recipe, device)
    if recipe.model_config.use_flash_attention and device == "CPU":
        # the model refuses it too, but only when called from Python; the step calls it inside a graph
        raise UserError(
            "model.overrides.use_flash_attention: FlashAttentionScore runs only on Ascend; "
            "set it to false to train on CPU"
        )
    plan = fit_plan(recipe, force)
    if par.world_size > 1 and not is_distributed():
        raise UserError(
            f"{strategy.workers_message(par)} needs {par.world_size} workers; start them with "
            "`ms-deepseek launch` (msrun), or set parallel.dp=1 for one worker"
        )
    return plan


@dataclass
class TrainData:
    """This rank's training batches and its validation sets; a stateful part of the run: its state is the data
    position a checkpoint records (the dataset's own ``state_dict``).

    The position is set (:meth:`load_state_dict`) before the batches are opened (:meth:`open`, which reads the
    first one: a bad shard stops the run there)."""

    dataset: Any  # data.dataset.TrainDataset or data.mixture.MixtureDataset
    rows: int  # rows per micro-batch on this rank
    validation: Any  # data.validation.Validation, or None
    validation_by_source: Dict[str, Any]  # a weighted mixture's held-out set per source
    validation_notes: List[str]
    batches: Optional[Iterator] = None  # the micro-batches from the position on, once opened

    @property
    def seq_len(self) -> int:
        return self.dataset.seq_len

    def state_dict(self) -> Dict:
        return self.dataset.state_dict()

    def load_state_dict(self, state: Dict) -> None:
        if self.batches is not None:
            raise RuntimeError("TrainData.load_state_dict: the batches are already open at another position")
        self.dataset.load_state_dict(state)

    def open(self) -> None:
        """The batches from the position on, the first one read (an unreadable shard fails here, as one line)."""
        from ms_deepseek.data.batches import first_batch_checked

        self.batches = first_batch_checked(self.dataset)


def build_data(ctx: RunContext, strategy, progress: bool, resolved=None) -> TrainData:
    """This rank's training data at the start of the sample stream (its position and first batch come with the
    run's restore: :meth:`TrainData.load_state_dict`, :meth:`TrainData.open`) and its validation sets, read
    once. A sharded rank reads its rows by the training rule (``data_coordinates``, ``block_rows``): one
    micro-batch ``[rows, T]`` each. ``resolved``: the recipe's data as the preflight resolved it
    (``data.sources.ResolvedData``), which the batches and the validation sets share; None: resolved here, once
    for both."""
    from ms_deepseek.data.dataset import build_train_dataset
    from ms_deepseek.data.sources import resolve_data
    from ms_deepseek.data.validation import build_validation, build_validation_by_source

    recipe, cfg = ctx.recipe, ctx.cfg
    if resolved is None:
        bounds = dict(max_positions=cfg.max_position_embeddings, vocab_size=cfg.vocab_size)
        resolved = resolve_data(recipe.data, progress=progress, **bounds)
    data_rank, data_world, rows = strategy.data_coordinates(ctx.rank, ctx.world, ctx.par, recipe.train.micro_batch_size)
    dataset = build_train_dataset(
        resolved,
        rows,
        data_rank,
        data_world,
        static_shapes=strategy.static_shapes,
        block_rows=strategy.block_rows(ctx.par, recipe.train.micro_batch_size, micro_batches(recipe)),
    )
    held_out = (resolved, rows, data_rank, data_world, recipe.train.eval_batches)
    validation = build_validation(*held_out)
    # a weighted mixture with a held-out fraction: val_loss/<source> beside val_loss, one set per source
    by_source, notes = build_validation_by_source(*held_out)
    return TrainData(dataset, rows, validation, by_source, notes)


def config_changes(recipe: Recipe, folder=None) -> Dict:
    """Fields of the resolved config that differ from the folder's config.json (overrides, alphas)."""
    from ms_deepseek.config.model import load_model_config

    base = load_model_config(str(folder) if folder is not None else recipe.model.source)
    cfg = recipe.model_config
    return {k: getattr(cfg, k) for k in cfg.__dataclass_fields__ if getattr(cfg, k) != getattr(base, k)}


def build_model(ctx: RunContext, strategy, converter: ModelConverter, source: ModelSource, plan, show_progress=False):
    """Random init (or the weights folder's weights; ``source.shapes_only``: unallocated), the converter
    (LoRA), then the plan: strategies (inert in data parallel), expert placement, recompute; on Ascend the
    device memory pool is reserved. Returns (model, the applied plan)."""
    import mindspore as ms

    from ms_deepseek.parallel_apply.apply import apply_plan
    from ms_deepseek.parallel_plan.memory import reserve_device_memory
    from ms_deepseek.parallel_plan.ranks import stage_of_rank

    skip_parameter_load_copies()  # before any graph compiles: no copy of each weight per step (runtime.py)
    recipe, cfg, par = ctx.recipe, ctx.cfg, ctx.par
    ms.set_seed(recipe.train.seed)
    np.random.seed(recipe.train.seed)
    if source.shapes_only:
        from mindspore.nn.utils import no_init_parameters

        from ms_deepseek.model.causal_lm import DeepseekV2ForCausalLM

        with no_init_parameters():  # shapes only: nothing allocated, nothing read
            model = DeepseekV2ForCausalLM(cfg)
    else:
        load = source.base if source.load else None
        changes = config_changes(recipe, load) if load is not None else {}
        model = strategy.build_model(cfg, load, show_progress, changes)
    converter.convert(model, ctx, source)
    model.set_train(True)
    applied = apply_plan(model, par, cfg)
    if par.reserve_memory:  # Ascend: pool up to HBM - runtime - HCCL, estimate up front (no-op on CPU)
        stage = stage_of_rank(ctx.rank, par) if par.pp > 1 else None
        reserve_device_memory(plan, par.memory_headroom_gb, stage=stage, hbm_gb=par.hbm_gb)
    return model, applied


def micro_batches(recipe: Recipe) -> int:
    """k, the micro-batches of one optimizer step: ``parallel.micro_batches`` under a pipeline, else
    ``train.grad_accum_steps``."""
    par = recipe.parallel
    return par.micro_batches if par.pp > 1 else recipe.train.grad_accum_steps


def build_step(ctx: RunContext, strategy, converter: ModelConverter, built: Tuple, batch: Tuple[int, int]):
    """Optimizer, execution mode and the compiled step (one graph per optimizer step) for the built
    ``(model, applied plan)`` and this rank's micro-batch ``(rows, seq_len)``; returns the
    :class:`~.context.TrainTensors` and the step's logged-values reduction (None: nothing to reduce)."""
    import mindspore as ms

    from ms_deepseek.parallel_apply.apply import pipeline_wrap
    from ms_deepseek.train import optim
    from ms_deepseek.train.step import build_step as step_of

    model, applied = built
    recipe, cfg, par = ctx.recipe, ctx.cfg, ctx.par
    tc = recipe.train
    optimizer = optim.build_optimizer(model.trainable_params(), recipe.optim, tc.steps)
    ms.set_context(mode=ms.GRAPH_MODE if tc.mode == "graph" else ms.PYNATIVE_MODE)
    allow_graph_depth(cfg.num_hidden_layers)  # past ~16 layers MindSpore's default refuses the step
    if tc.mode == "pynative" and detect_device() == "CPU":
        ms.runtime.launch_blocking()  # synchronous launch: each op's asynchronous dispatch costs more on CPU
    # data parallel: average gradients here; sharded layouts: AutoParallel inserts the reductions
    reducer = strategy.grad_reducer(optimizer, ctx.world)
    wrap = (lambda net: pipeline_wrap(net, par, applied, model_prefix="model")) if par.pp > 1 else None
    # what a checkpoint holds (before the step is built, which may mark a frozen embedding trainable)
    kept = converter.checkpoint_tensors(model)
    dynamic = cfg.compute_dtype == "float16"
    step_cell, update = step_of(
        model, optimizer, tc, par, dynamic_loss_scale=dynamic, grad_reducer=reducer, wrap_net=wrap
    )
    strategy_file = ctx.run_dir / "strategy" / f"rank_{ctx.rank:05d}.ckpt"
    step_cell = strategy.wrap_step(step_cell, par, strategy_file)
    opt_tensors = dict(optim.optimizer_state(optimizer))
    opt_tensors["loss_scale"] = update.loss_scale
    opt_tensors["loss_scale_good_steps"] = update.good_steps
    tensors = TrainTensors(model, applied, kept, opt_tensors, step_cell, strategy_file, micro_batches(recipe), *batch)
    return tensors, strategy.stats_mean(ctx.world)
