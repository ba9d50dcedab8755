"""Recipe -> trained model: the training loop of one worker (data-parallel under msrun).

``train(recipe, run_dir, resume=None)`` runs a :class:`Trainer`: it builds the model
(random init, or a checkpoint folder's weights), the data-parallel rank's batches,
our AdamW and the compiled train step (one graph per optimizer step), then runs
``train.steps`` optimizer steps. Every ``logging.log_interval`` steps it writes a record
to ``RUN_DIR/metrics.jsonl`` and TensorBoard and prints a line; every
``checkpoint.save_interval`` steps (and at the end) it saves ``RUN_DIR/checkpoints/step_N``.
``resume`` continues from a checkpoint exactly: same data position, optimizer state, step
count and RNG state. Batches, checkpoint tensors, RNG state and the rank collectives the
loop uses live where their concern does: :mod:`ms_deepseek.data.batches`, :mod:`ms_deepseek.checkpoint`
(all checkpoint I/O, any layout) and :mod:`ms_deepseek.train.distributed`.

Under msrun (``MS_WORKER_NUM`` set) each worker joins the collective group
(``mindspore.communication.init``, mccl on CPU, HCCL on Ascend), reads its shard of each
global batch, and gradients are averaged with ``nn.DistributedGradReducer`` once per
optimizer step; rank 0 writes metrics and checkpoints.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np

from ms_deepseek.core.atomic import atomic_write_text
from ms_deepseek.core.errors import UserError
from ms_deepseek.core.runtime import detect_device, use_device
from ms_deepseek.checkpoint import training as ckpt_mod
from ms_deepseek.checkpoint.opener import open_checkpoint, open_for_resume
from ms_deepseek.checkpoint.tensors import hf_ordered, model_tensors, restore_into, restore_rng, rng_state
from ms_deepseek.data.batches import first_batch_checked, stack_micro_batches
from ms_deepseek.train import metrics as metrics_mod
from ms_deepseek.spec.recipe import Recipe
from ms_deepseek.train.distributed import RankMean, any_rank, replica_digests
from ms_deepseek.train.preempt import Heartbeat, StopRequest
from ms_deepseek.train.resume import agree_on_resume, check_settings, set_aside_newer


@dataclass
class TrainResult:
    run_dir: Path
    steps: int                      # optimizer steps completed (total, including resumed ones)
    final_loss: float
    losses: List[float] = field(default_factory=list)  # LM loss of every step run in this call
    checkpoint: Optional[Path] = None
    metrics_path: Optional[Path] = None
    tokens_per_s: float = 0.0       # steady state: steps after the first (compile) step of this call
    wall_s: float = 0.0
    complete: bool = False          # the resumed checkpoint had already reached train.steps: nothing was run
    preempted: Optional[str] = None  # the stop signal's name: stopped early, after saving a checkpoint


def is_distributed() -> bool:
    # msrun workers, or one rank of MindSpore's dry run (MS_SIMULATION_LEVEL with RANK_SIZE /
    # RANK_ID, tools/ascend_dryrun.sh), where init() is simulated
    dryrun = bool(os.environ.get("MS_SIMULATION_LEVEL")) and int(os.environ.get("RANK_SIZE", "1") or 1) > 1
    return int(os.environ.get("MS_WORKER_NUM", "1") or 1) > 1 or os.environ.get("MS_ROLE") == "MS_WORKER" or dryrun


def init_distributed(par):
    """Join the collective group; returns (rank, world size)."""
    import mindspore as ms
    from mindspore.communication import get_group_size, get_rank, init

    init()
    rank, world = get_rank(), get_group_size()
    if world != par.world_size:
        raise UserError(f"parallel: {par.describe()} needs {par.world_size} workers (dp x tp x pp) but msrun "
                        f"started {world}")
    if not par.uses_semi_auto:  # sharded layouts get their context from the AutoParallel wrapper
        ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.DATA_PARALLEL, gradients_mean=True,
                                     device_num=world)
    return rank, world


def _print(msg: str, bar) -> None:
    if bar is not None:
        bar.write(msg)
    else:
        print(msg, flush=True)


def train(recipe: Recipe, run_dir, resume: Optional[str] = None, force: bool = False,
          progress: bool = True, max_steps: Optional[int] = None, allow_changes: bool = False) -> TrainResult:
    """Run the recipe. ``max_steps`` stops early after that many total steps (the schedule still
    spans ``train.steps``), which is how a run is split into resumable pieces. A resume whose recipe
    changes the checkpoint's settings in a way that breaks exactness is refused unless ``allow_changes``
    (train/resume.py, check_settings)."""
    return Trainer(recipe, run_dir, resume, force, progress, max_steps, allow_changes).run()


@dataclass
class _StepOut:
    """What one optimizer step hands to logging: host floats, plus device scalars read only when logged."""
    loss: float
    aux: float
    stats: np.ndarray               # [L_moe, E + 4] per-MoE-layer routing statistics
    grad_norm: float
    lr: object                      # Tensor
    overflow: object                # Tensor (bool)
    loss_scale: object              # Tensor
    stop: bool = False              # some rank got SIGTERM: save this step and stop (train/preempt.py)


class Trainer:
    """One worker's run of a recipe. :meth:`run` is the whole algorithm; each phase is one method:

    ``_check_layout`` (refusals that need nothing built) -> ``_setup_run`` (device, collective
    group, resume state, step range) -> ``_build_data`` (this rank's batches, first one read)
    -> ``_build_model`` -> ``_build_step`` (optimizer, compiled step) -> ``_restore`` (resume:
    tensors + RNG) -> ``_open_outputs`` (run folder, metrics, progress) -> per step
    ``_run_step``, ``_account``, ``_log``, ``_maybe_save``.
    Refusals about the layout, the workers, the resume state and the data come before anything
    is written to the run folder."""

    def __init__(self, recipe: Recipe, run_dir, resume: Optional[str], force: bool, progress: bool,
                 max_steps: Optional[int], allow_changes: bool = False):
        self.started = time.time()
        self.allow_changes = allow_changes
        self.recipe = recipe
        self.run_dir = Path(run_dir)
        self.cfg = recipe.model_config
        self.par = recipe.parallel
        self.sharded = self.par.uses_semi_auto
        self.resume, self.force, self.progress, self.max_steps = resume, force, progress, max_steps

    def run(self) -> TrainResult:
        self._check_layout()
        self._setup_run()
        if self.complete:
            return self._complete_result()
        self._build_data()    # a bad dataset stops the run before anything is compiled
        self._build_model()
        self._build_step()
        self._restore()
        self._open_outputs()
        self.preempted: Optional[str] = None
        step = self.start_step
        try:
            for step in range(self.start_step + 1, self.stop_at + 1):
                t0 = time.time()
                self.heartbeat.beat(step, step - 1)  # launch's watchdog: who did not reach a step
                if self.dropout_keyed:  # LoRA dropout masks keyed by (seed, step, rank): replayed on resume
                    from ms_deepseek.model.lora import set_dropout_step

                    set_dropout_step(self.model, self.recipe.train.seed, step, self.rank)
                out = self._run_step()
                self._account(step, out, t0)
                val = self._maybe_evaluate(step)  # a validation step is always logged
                if val or step % self.recipe.logging.log_interval == 0 or step == self.stop_at:
                    self._log(step, out, val)
                self._maybe_save(step)
                # the watchdog's step time: every step of this call but the first (the compile)
                self.heartbeat.beat(step, step, time.time() - t0 if step > self.start_step + 1 else None)
                if out.stop:  # some rank got SIGTERM: every rank saves this step and stops (train/preempt.py)
                    if self.saved_step != step:
                        self._save(step)
                    self.preempted = self.stop.name
                    break
        except Exception:
            self.heartbeat.failed(step)  # under launch: the stacks of the ranks behind are dumped first
            raise
        finally:
            self.stop.restore()
            self.bar.close()
            self.writer.close()
        return self._result()

    # ---- setup

    def _check_layout(self) -> None:
        par = self.par
        if self.sharded and detect_device() == "CPU":
            raise UserError(f"parallel: {par.describe()} shards the model (tp / pp / ep / optimizer sharding), "
                            "which MindSpore compiles only on Ascend; on CPU train data-parallel layouts "
                            "(parallel.dp only), and size this one with `ms-deepseek plan` / `launch --dry-run`")
        if self.sharded and self.recipe.data.bucket_boundaries is not None:
            raise UserError(f"data.bucket_boundaries: {par.describe()} compiles one graph shape on every rank, so "
                            "SFT batches are padded to seq_len (no length buckets); leave it out for this layout")
        if self.cfg.use_flash_attention and detect_device() == "CPU":
            # the model refuses it too, but only when called from Python; the step calls it inside a graph
            raise UserError("model.overrides.use_flash_attention: FlashAttentionScore runs only on Ascend; "
                            "set it to false to train on CPU")
        self.plan = fit_plan(self.recipe, self.force)
        if par.world_size > 1 and not is_distributed():
            what = f"parallel: {par.describe()}" if self.sharded else f"parallel.dp: {par.dp}"
            raise UserError(f"{what} needs {par.world_size} workers; start them with `ms-deepseek launch` (msrun), "
                            "or set parallel.dp=1 for one worker")

    def _setup_run(self) -> None:
        par = self.par
        use_device()
        self.rank, self.world = init_distributed(par) if is_distributed() else (0, 1)
        # Rank 0 coordinates checkpoints; the logging rank sees the real loss (with pipeline
        # parallelism only the last stage computes it).
        log_rank = (par.pp - 1) * par.dp * par.tp if self.sharded else 0
        self.is_main = self.rank == log_rank

        existing = ckpt_mod.CheckpointManager(self.run_dir / "checkpoints").latest()
        resume = self.resume or self.recipe.checkpoint.resume  # the command line wins over the recipe
        if self.world > 1 and resume:
            self.resume_dir = agree_on_resume(resume, existing, self.run_dir, self.rank)
        elif resume == "auto":  # newest complete checkpoint when there is one, else a fresh start
            self.resume_dir = existing
        else:
            self.resume_dir = ckpt_mod.resolve_checkpoint(resume, ckpt_mod.RESUME, self.run_dir) if resume else None
        if self.resume_dir is None and existing is not None:
            raise UserError(f"--output {self.run_dir}: already holds checkpoints (newest {existing.name}); pass "
                            "--resume to continue that run, or choose another --output")
        self.state = ckpt_mod.read_state(self.resume_dir) if self.resume_dir else {}
        self.start_step = int(self.state.get("step", 0))
        # a resume continues the run it resumes: the command's changes to its settings are named, and
        # those that break exactness are refused unless --allow-changes
        self.resume_notes = check_settings(self.recipe, ckpt_mod.read_recipe(self.resume_dir, missing_ok=True),
                                           self.state, self.resume_dir, self.run_dir, self.allow_changes) \
            if self.resume_dir is not None else []
        if self.resume_dir is not None:
            set_aside_newer(self.run_dir, self.start_step, self.resume_dir, self.force, self.rank)
        self.total = self.recipe.train.steps
        self.stop_at = min(self.total, self.max_steps) if self.max_steps is not None else self.total
        # A finished run re-run by a restart loop is a success, not an error (exit 0, nothing written).
        self.complete = self.start_step >= self.total

    def _build_data(self) -> None:
        from ms_deepseek.data.dataset import build_train_dataset
        from ms_deepseek.parallel.ranks import data_coordinates

        recipe, cfg = self.recipe, self.cfg
        data_rank, data_world, self.rows = (
            data_coordinates(self.rank, self.par, recipe.train.micro_batch_size) if self.sharded
            else (self.rank, self.world, recipe.train.micro_batch_size))
        self.dataset = build_train_dataset(recipe.data, self.rows, data_rank, data_world,
                                           state=self.state.get("data"), max_positions=cfg.max_position_embeddings,
                                           vocab_size=cfg.vocab_size, progress=self.progress and self.is_main,
                                           static_shapes=self.sharded)
        self.seq_len = self.dataset.seq_len
        self.batches = first_batch_checked(self.dataset)
        from ms_deepseek.data.validation import build_validation

        # read once now (a bad validation set fails before compiling); the same batches every time. A
        # sharded rank reads its rows by the training rule (data_coordinates): one micro-batch [rows, T] each
        self.validation = build_validation(recipe.data, self.rows, data_rank, data_world, recipe.train.eval_batches,
                                           max_positions=cfg.max_position_embeddings, vocab_size=cfg.vocab_size)
        # a weighted mixture with a held-out fraction: val_loss/<source> beside val_loss, one set per source
        from ms_deepseek.data.validation import build_validation_by_source

        self.validation_by_source, self.validation_notes = build_validation_by_source(
            recipe.data, self.rows, data_rank, data_world, recipe.train.eval_batches,
            max_positions=cfg.max_position_embeddings, vocab_size=cfg.vocab_size)

    def _build_model(self) -> None:
        """Random init (or the weights folder's weights), then the plan: strategies (inert in data
        parallel), expert placement, recompute; on Ascend the device memory pool is reserved."""
        import mindspore as ms

        from ms_deepseek.train.mf_adapter import mindformers_classes

        # MindFormers (the cosine schedule) logs into the run folder; its import resets the
        # execution mode, so it comes before set_context(mode=...) in _build_step.
        mindformers_classes(self.run_dir / "logs")
        ms.set_seed(self.recipe.train.seed)
        np.random.seed(self.recipe.train.seed)
        from ms_deepseek.model.causal_lm import DeepseekV2ForCausalLM

        weights_folder = self.recipe.weights_folder
        lora = self.recipe.lora
        if lora is not None:  # the frozen base is loaded on resume too: LoRA checkpoints hold adapters only
            from ms_deepseek.train import lora_run

            weights_folder = lora_run.base_folder(self.recipe, self.run_dir)
        if self.sharded:
            # Sharded layouts build without allocating (no_init_parameters); after the step compiles
            # each rank reads only its slices of the weights folder (a LoRA run: of its frozen base)
            # or checkpoint (_restore). LoRA adapters are attached after this, with their data.
            from mindspore.nn.utils import no_init_parameters

            with no_init_parameters():
                model = DeepseekV2ForCausalLM(self.cfg)
        elif weights_folder is not None and (self.resume_dir is None or lora is not None):
            model = DeepseekV2ForCausalLM.from_pretrained(weights_folder,
                                                          show_progress=self.progress and self.is_main,
                                                          **_config_changes(self.recipe, weights_folder))
        else:
            model = DeepseekV2ForCausalLM(self.cfg)
        if lora is not None:  # adapters + frozen base; a random base is saved once to RUN_DIR/base
            lora_run.prepare(model, self.recipe, self.run_dir, write_base=weights_folder is None and self.is_main,
                             base=weights_folder, sharded=self.sharded)
        model.set_train(True)
        from ms_deepseek.model.lora import dropout_key

        self.dropout_keyed = dropout_key(model) is not None
        from ms_deepseek.sharding.apply import apply_plan
        from ms_deepseek.parallel.memory import reserve_device_memory
        from ms_deepseek.parallel.ranks import stage_of_rank

        par = self.par
        self.applied = apply_plan(model, par, self.cfg)
        if par.reserve_memory:  # Ascend: pool up to HBM - runtime - HCCL, estimate up front (no-op on CPU)
            reserve_device_memory(self.plan, par.memory_headroom_gb, stage=stage_of_rank(self.rank, par)
                                  if par.pp > 1 else None, hbm_gb=par.hbm_gb)
        self.model = model

    def _build_step(self) -> None:
        """Optimizer, execution mode and the compiled step (one graph per optimizer step)."""
        import mindspore as ms
        from mindspore import nn

        from ms_deepseek.sharding.apply import auto_parallel_wrap, pipeline_wrap
        from ms_deepseek.train import optim

        recipe, cfg, par, world = self.recipe, self.cfg, self.par, self.world
        tc = recipe.train
        optimizer = optim.build_optimizer(self.model.trainable_params(), recipe.optim, self.total,
                                          self.run_dir / "logs")
        ms.set_context(mode=ms.GRAPH_MODE if tc.mode == "graph" else ms.PYNATIVE_MODE)
        if tc.mode == "pynative" and detect_device() == "CPU":
            # asynchronous launch costs ~0.8 ms per op on 2 cores: synchronous is 2.2x faster here
            ms.runtime.launch_blocking()
        # data parallel: average gradients here; sharded layouts: AutoParallel inserts the reductions
        reducer = nn.DistributedGradReducer(optimizer.parameters, mean=True, degree=world) \
            if world > 1 and not self.sharded else None
        self.dynamic = cfg.compute_dtype == "float16"
        from ms_deepseek.train.step import build_step

        self.moe_layers = cfg.moe_layer_indices
        self.E = cfg.n_routed_experts or 0
        self.k = par.micro_batches if par.pp > 1 else tc.grad_accum_steps  # micro-batches per step
        wrap = (lambda net: pipeline_wrap(net, par, self.applied, model_prefix="model")) if par.pp > 1 else None
        # what a checkpoint holds (before build_step, which may mark a frozen embedding trainable for the graph)
        self.model_tensors = model_tensors(self.model) if self.recipe.lora is None else \
            lora_checkpoint_tensors(self.model)  # LoRA: adapters (+ trained routers) only
        self.step_cell, update = build_step(self.model, optimizer, tc, par, dynamic_loss_scale=self.dynamic,
                                            grad_reducer=reducer, wrap_net=wrap)
        self.opt_shards = None  # sharded + parallel.optimizer_shard: set after the compile (_restore)
        self.strategy_file = self.run_dir / "strategy" / f"rank_{self.rank:05d}.ckpt"
        if self.sharded:  # Ascend only (refused on CPU in _check_layout)
            self.strategy_file.parent.mkdir(parents=True, exist_ok=True)
            self.step_cell = auto_parallel_wrap(self.step_cell, par, str(self.strategy_file))
        self.opt_tensors = dict(optim.optimizer_state(optimizer))
        self.opt_tensors["loss_scale"] = update.loss_scale
        self.opt_tensors["loss_scale_good_steps"] = update.good_steps
        # logged values are averaged over data-parallel workers
        self.stats_mean = RankMean(world) if world > 1 and not self.sharded else None

    def _restore(self) -> None:
        """Resume: model + optimizer tensors and the RNG state of the checkpoint, read for this run's layout.

        The checkpoint may be whole or sharded and of another layout: each tensor (or, in a sharded
        run, this rank's slice of it) is read from whatever the checkpoint holds. A sharded run
        compiles first (its parameters are slices then) and, without a checkpoint, reads its slices
        of the weights folder (it was built without allocating)."""
        if self.resume_dir is None and not self.sharded:
            return
        layout = None
        if self.sharded:
            from mindspore import Tensor

            shape = (self.k * self.rows, self.seq_len)  # [k * b, T]
            self.step_cell.compile(Tensor(np.zeros(shape, np.int32)), Tensor(np.zeros(shape, np.int32)))
            if self.par.optimizer_shard:  # the parallel optimizer's cut of each parameter, as compiled
                from ms_deepseek.checkpoint.opt_shard import OptimizerShards

                self.opt_shards = OptimizerShards.from_compiled(self.step_cell)
            layout = self._layout()
            # MindSpore's compiled layouts against the plan, before step 1: a mismatch stops here in one line,
            # on every rank (the others would wait in the step's first collective for this one)
            from ms_deepseek.sharding import compiled_check as cc
            from ms_deepseek.train.distributed import checked_on_every_rank

            def check():
                cc.check_parameter_layouts(cc.compiled_layouts(self.step_cell), layout, self.rank,
                                           self.par.optimizer_shard)
                cc.check_compiled_strategies(cc.compiled_strategies(self.step_cell),
                                             cc.planned_primitives(self.model, self.applied.strategies))

            checked_on_every_rank(check, self.rank, self.world)
            if self.recipe.lora is not None:  # the frozen base is never in a LoRA checkpoint
                self._load_base_slices()
            elif self.resume_dir is None:
                self._load_weights_slices(layout, self.model_tensors)
        if self.resume_dir is None:
            return
        resumed = open_for_resume(self.resume_dir)
        model_src, opt_src = resumed.model, resumed.optimizer
        opt_layout = layout and layout.for_optimizer()
        restore_into(self._this_stage(self.model_tensors, layout), model_src, "model", layout=layout, rank=self.rank,
                     applied=self.applied, part=self._opt_part)
        restore_into(self._this_stage(self.opt_tensors, opt_layout), opt_src, "optimizer", layout=opt_layout,
                     rank=self.rank, applied=self.applied, part=self._opt_part)
        restore_rng(self.state.get("rng", {}))

    def _this_stage(self, tensors: Dict[str, object], layout) -> Dict[str, object]:
        """The tensors this rank's pipeline stage holds (and those on every rank), as MindSpore's
        ``Cell.init_parameters_data`` (``mindspore/nn/cell.py``) initialises only the compiled stage's
        ``parallel_parameter_name_list``: the other stages' parameters are neither read, initialised
        nor saved here (``ShardLayout.tensors_of_rank``)."""
        if layout is None or self.par.pp == 1:
            return tensors
        mine = set(layout.tensors_of_rank(self.rank))
        return {n: t for n, t in tensors.items() if n in mine or n not in layout.tensors}

    @property
    def _opt_part(self):
        """restore_into's ``part`` hook: the parallel optimizer's cut (None without optimizer sharding)."""
        return self.opt_shards.part if self.opt_shards is not None else None

    def _layout(self):
        """Which slice of every checkpointed model tensor (a LoRA run: adapters and trained routers) and
        optimizer tensor this run's ranks hold (checkpoint.layout)."""
        from ms_deepseek.checkpoint.layout import build_layout

        layout = build_layout(self.cfg, self.par, lora=self.recipe.lora)
        full = {n: t.shape for n, t in layout.tensors.items()}
        return layout.with_optimizer({n: (full.get(n.split(".", 1)[-1], tuple(p.shape)), "F32")
                                      for n, p in self.opt_tensors.items()})

    def _load_base_slices(self) -> None:
        """Sharded LoRA run: this rank's slices of the frozen base (a QLoRA run: its quantized tensors, read
        from a quantized model.source or quantized here from a float one: lora_run.load_base_slices)."""
        from ms_deepseek.checkpoint.layout import build_layout

        if self.recipe.quant is None:
            base = build_layout(self.cfg, self.par)
            self._load_weights_slices(base, {n: p for n, p in model_tensors(self.model).items()
                                             if n in base.tensors})
            return
        from ms_deepseek.train import lora_run

        layout = build_layout(self.cfg, self.par, quant=self.recipe.quant)
        params = {n: p for n, p in model_tensors(self.model).items() if n in layout.tensors}
        lora_run.load_base_slices(self._this_stage(params, layout), lora_run.base_folder(self.recipe, self.run_dir),
                                  self.cfg, self.par, self.recipe.quant, self.rank, part=self._opt_part)

    def _load_weights_slices(self, layout, params) -> None:
        """Sharded run: this rank's slices of ``params`` from the weights folder, or a seeded random init."""
        weights = self.recipe.weights_folder
        if weights is None:
            mine = self._this_stage({p.name: p for p in self.model.get_parameters()}, layout)
            for param in mine.values():  # nothing to read: materialise the seeded init (this stage only)
                if param.has_init:
                    param.init_data()
            return
        restore_into(self._this_stage(params, layout), open_checkpoint(weights).model, "model", layout=layout,
                     rank=self.rank, part=self._opt_part)

    def _open_outputs(self) -> None:
        """Run folder (main rank), metrics writer, alerts, counters, progress bar and the start line."""
        from ms_deepseek.core.progress import progress_bar

        recipe, run_dir, is_main = self.recipe, self.run_dir, self.is_main
        self.manager = ckpt_mod.CheckpointManager(run_dir / "checkpoints", recipe.checkpoint.keep_last,
                                                  protected=self.resume_dir)  # never pruned
        if is_main:
            run_dir.mkdir(parents=True, exist_ok=True)
            self.manager.remove_partial()
            metrics_mod.truncate_after(run_dir / "metrics.jsonl", self.start_step)  # before the writer opens it
            atomic_write_text(run_dir / "recipe.yaml", recipe.to_yaml())
        self.writer = metrics_mod.MetricsWriter(run_dir, recipe.logging.tensorboard and is_main, enabled=is_main)
        self.monitor = _alert_monitor() if (is_main and recipe.logging.alerts) else None
        self.memory_fn = _memory_metrics_fn()

        self.tokens_per_step = recipe.global_batch_size * self.seq_len
        self.elapsed_before = float(self.state.get("elapsed_s", 0.0))
        self.tokens_seen = int(self.state.get("tokens_seen", 0))
        self.losses: List[float] = []
        self.last_ckpt: Optional[Path] = None
        self.interval_tokens, self.interval_start = 0, time.time()
        # per logged interval: seconds spent in validation (not training throughput) and waiting for batches
        self.interval_eval_s, self.interval_wait_s, self.interval_steps = 0.0, 0.0, 0
        self.steady_tokens, self.steady_time = 0, 0.0  # steps after the first (compile) step
        self.compile_s: Optional[float] = None  # the first step's time (graph compile + one step), logged once
        self.evaluator = None  # built (and its graph compiled) at the first validation
        self.saved_step: Optional[int] = None
        self.stop = StopRequest().install()  # SIGTERM: save at the next step boundary, then stop
        self.heartbeat = Heartbeat(run_dir, self.rank)

        self.bar = progress_bar(total=self.stop_at, initial=self.start_step, desc="train", unit="step",
                                dynamic_ncols=True, leave=False,
                                enabled=self.progress and is_main and recipe.logging.progress_bar)
        if is_main:
            cfg, world = self.cfg, self.world
            what = f"resuming {self.resume_dir} at step {self.start_step}" if self.resume_dir else "starting"
            self._print(f"{what}: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
                        f"{self.E} routed experts; global batch {recipe.global_batch_size} x {self.seq_len} tokens "
                        f"({world} worker{'s' if world > 1 else ''}); output {run_dir}")
            for line in self.resume_notes:
                self._print(line)
            if recipe.lora is not None:
                from ms_deepseek.train.lora_run import describe

                self._print(describe(recipe))
            from ms_deepseek.spec.recipe import recipe_warnings

            warnings = recipe_warnings(recipe)
            if hasattr(self.dataset, "repeat_warnings"):  # a weighted mixture: a source read too many times
                warnings += self.dataset.repeat_warnings(self.stop_at * recipe.global_batch_size)
            for warning in warnings:
                self._print(f"warning: {warning}")
            if self.validation is not None:
                every = recipe.train.eval_interval
                per_source = "".join(f"; val_loss/{name}: {v.used_samples} of its {v.total_samples} held-out samples"
                                     for name, v in self.validation_by_source.items())
                self._print(f"validation: {self.validation.description}, "
                            + (f"every {every} steps and at the end" if every else "at the end") + per_source)
                for note in self.validation_notes:
                    self._print(f"warning: {note}")

    # ---- the loop's pieces

    def _run_step(self) -> _StepOut:
        """Read the step's k micro-batches, run the compiled step, read its outputs on the host."""
        from mindspore import Tensor

        fetch = time.time()
        parts = [next(self.batches) for _ in range(self.k)]
        self.interval_wait_s += time.time() - fetch  # the step waited this long for its batch
        self.interval_steps += 1
        input_ids, labels = stack_micro_batches(parts, self.dataset.pad_id)  # [k * b, T] each
        outputs, grad_norm, lr, overflow, cur_scale = self.step_cell(Tensor(input_ids), Tensor(labels))
        vec = outputs.asnumpy()  # host read: the step is finished
        grad_norm = float(grad_norm.asnumpy())
        loss_v, aux_v = float(vec[1]), float(vec[2])
        n_moe = len(self.moe_layers)
        # [3 + L_moe * (E + 4)] -> [L_moe, E + 4]
        stats_v = vec[3:].reshape(n_moe, self.E + 4) if n_moe else np.zeros((0, self.E + 4), np.float32)
        stop = self.stop.flag > 0
        if self.stats_mean is not None:  # the stop request rides on the AllReduce of the logged values
            loss_v, aux_v, stats_v, stop = self.stats_mean(loss_v, aux_v, stats_v, self.stop.flag)
        elif self.world > 1:
            stop = any_rank(self.stop.flag)
        return _StepOut(loss_v, aux_v, stats_v, grad_norm, lr, overflow, cur_scale, stop)

    def _account(self, step: int, out: _StepOut, t0: float) -> None:
        """Counters (tokens, throughput) and the progress bar."""
        self.losses.append(out.loss)
        self.tokens_seen += self.tokens_per_step
        if step == self.start_step + 1:  # it compiled the graph: tokens/s is measured from its end
            self.compile_s = time.time() - t0
            self.interval_start = time.time()
        else:
            self.interval_tokens += self.tokens_per_step
            self.steady_tokens += self.tokens_per_step
            self.steady_time += time.time() - t0
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{out.loss:.3f}", refresh=False)

    def _maybe_evaluate(self, step: int) -> Optional[Dict[str, float]]:
        """val_loss / val_ppl every ``train.eval_interval`` steps and at the end (needs data.validation)."""
        if self.validation is None:
            return None
        every = self.recipe.train.eval_interval
        if not ((every and step % every == 0) or step == self.stop_at):
            return None
        if self.evaluator is None:
            from ms_deepseek.train.evaluate import Evaluator

            self.evaluator = Evaluator(self.model, self.validation.batches, self.world,
                                       parallel=self.par if self.sharded else None)
        start = time.time()
        result = self.evaluator()
        for name, per_source in self.validation_by_source.items():  # the same compiled eval graph
            result[f"val_loss/{name}"] = self.evaluator.loss(per_source.batches)
        self.interval_eval_s += time.time() - start  # kept out of tokens/s
        return result

    def _log(self, step: int, out: _StepOut, val: Optional[Dict[str, float]] = None) -> None:
        """One metrics record (every rank computes it; the main rank writes, prints, raises alerts)."""
        now = time.time()
        record = {"step": step, "loss": out.loss, "total_loss": out.loss + out.aux, "lr": float(out.lr.asnumpy()),
                  "grad_norm": out.grad_norm, "elapsed_s": self.elapsed_before + now - self.started}
        if self.interval_tokens:  # none when the interval is the compile step alone; validation time excluded
            record["tokens_per_s"] = self.interval_tokens / max(now - self.interval_start - self.interval_eval_s, 1e-9)
        if self.interval_steps:  # mean seconds a step of the interval waited for its batch
            record["data_wait_s"] = self.interval_wait_s / self.interval_steps
        if self.compile_s is not None:
            record["compile_s"], self.compile_s = self.compile_s, None
        record.update(metrics_mod.moe_fields(out.stats, self.moe_layers, self.E))
        if val:
            record.update(val)
        if hasattr(self.dataset, "source_counts"):  # a weighted mixture: samples drawn per source so far
            record["samples_by_source"] = self.dataset.source_counts
        if self.dynamic:
            record["loss_scale"] = float(out.loss_scale.asnumpy())
            record["overflow"] = bool(out.overflow.asnumpy())
        metrics_mod.optional_memory(record, self.memory_fn() if self.memory_fn else None)
        self.interval_tokens, self.interval_start = 0, now
        self.interval_eval_s, self.interval_wait_s, self.interval_steps = 0.0, 0.0, 0
        if self.is_main:
            self.writer.write(record)
            self._print(metrics_mod.console_line(record, self.total))
            for alert in (self.monitor.observe(record) if self.monitor is not None else []):
                self._print(f"ALERT {alert}")

    def _maybe_save(self, step: int) -> None:
        """Checkpoint every ``checkpoint.save_interval`` steps and at the last step (``save_final``)."""
        ck = self.recipe.checkpoint
        if not ((ck.save_interval and step % ck.save_interval == 0) or (step == self.stop_at and ck.save_final)):
            return
        self._save(step)

    def _save(self, step: int) -> None:
        """One checkpoint of this step (every rank takes part; rank 0 completes it)."""
        self.saved_step = step
        state = {
            "step": step, "data": self.dataset.state_dict(), "rng": rng_state(),
            "tokens_seen": self.tokens_seen, "elapsed_s": self.elapsed_before + time.time() - self.started,
            "world_size": self.world, "global_batch_size": self.recipe.global_batch_size, "seq_len": self.seq_len,
        }
        if self.sharded:  # every rank writes its slices (experts in HF order by construction), rank 0 completes
            layout = self._layout()  # a rank file holds only its stage's tensors (layout.json: which stage)
            model = self._this_stage(self.model_tensors, layout)
            opt = self._this_stage(self.opt_tensors, layout.for_optimizer())
            if self.opt_shards is not None:  # files hold model-parallel slices: gather the optimizer's parts
                model, opt = self.opt_shards.gathered(model), self.opt_shards.gathered(opt)
            self.last_ckpt = ckpt_mod.save_sharded(self.manager, step, self.rank, layout, model, opt,
                                                   self.cfg, state, self.recipe.to_yaml(), self.strategy_file)
            return
        if self.world > 1:  # every rank takes part: the replicas must hold the same weights
            state["replica_sha1"] = replica_digests(self.model_tensors, self.world)
        if self.rank == 0:
            # experts in HF order whatever the placement (a whole run's placement is contiguous today)
            self.last_ckpt = self.manager.save(step, hf_ordered(self.model_tensors, self.applied),
                                               hf_ordered(self.opt_tensors, self.applied), self.cfg, state,
                                               self.recipe.to_yaml())

    def _print(self, msg: str) -> None:
        _print(msg, self.bar if not self.bar.disable else None)

    def _complete_result(self) -> TrainResult:
        metrics = self.run_dir / "metrics.jsonl"
        return TrainResult(run_dir=self.run_dir, steps=self.start_step, final_loss=float("nan"),
                           checkpoint=self.resume_dir, metrics_path=metrics if metrics.is_file() else None,
                           complete=True)

    def _result(self) -> TrainResult:
        return TrainResult(run_dir=self.run_dir, steps=self.saved_step if self.preempted else self.stop_at,
                           final_loss=self.losses[-1] if self.losses else float("nan"), losses=self.losses,
                           checkpoint=self.last_ckpt or self.manager.latest(),  # rank 0's path (shared folder)
                           metrics_path=self.writer.path if self.is_main else None,
                           tokens_per_s=self.steady_tokens / self.steady_time if self.steady_time else 0.0,
                           wall_s=time.time() - self.started, preempted=self.preempted)


def lora_checkpoint_tensors(model) -> Dict[str, object]:
    from ms_deepseek.train.lora_run import checkpoint_tensors

    return checkpoint_tensors(model)


def _config_changes(recipe: Recipe, folder=None) -> Dict:
    """Fields of the resolved config that differ from the folder's config.json (overrides, alphas)."""
    from ms_deepseek.spec.config import load_model_config

    base = load_model_config(str(folder) if folder is not None else recipe.model.source)
    cfg = recipe.model_config
    return {k: getattr(cfg, k) for k in cfg.__dataclass_fields__ if getattr(cfg, k) != getattr(base, k)}


def fit_plan(recipe: Recipe, force: bool = False):
    """The memory planner's verdict (``ms_deepseek.parallel.planner``) on the recipe's layout.

    UserError when it does not fit, unless ``force`` / ``parallel.force``; the result also
    sizes the device memory pool reserved before compile."""
    from ms_deepseek.parallel.planner import check_recipe_fits

    result = check_recipe_fits(recipe)  # its sequence length, batch, LoRA and quantized base
    if not result.fits and not (force or recipe.parallel.force):
        why = "; ".join(result.problems) if result.problems else \
            f"needs {result.peak_gb:.1f} GB per NPU of {result.usable_gb:.1f} GB usable"
        if not result.problems and result.eval_note:  # validation sets the peak: say how to lower it
            why += f"; {result.eval_note}: set it, or remove data.validation"
        raise UserError(f"parallel: {recipe.parallel.describe()} does not fit ({why}); see `ms-deepseek plan`, "
                        "or pass --force (parallel.force: true) to run anyway")
    return result


def _alert_monitor():
    from ms_deepseek.train.alerts import AlertMonitor

    return AlertMonitor()


def _memory_metrics_fn():
    """Device memory numbers for the record; None on CPU, where MindSpore keeps no device pool."""
    if detect_device() == "CPU":
        return None
    from ms_deepseek.parallel.memory import memory_metrics

    return memory_metrics
