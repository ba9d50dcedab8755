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

from ms_deepseek.checkpoint import training as ckpt_mod
from ms_deepseek.checkpoint.opener import open_checkpoint, open_for_resume
from ms_deepseek.checkpoint.tensors import restore_into
from ms_deepseek.config.recipe import Recipe
from ms_deepseek.core.atomic import atomic_write_text
from ms_deepseek.core.errors import UserError
from ms_deepseek.core.runtime import allow_graph_depth, detect_device, skip_parameter_load_copies, use_device
from ms_deepseek.data.batches import first_batch_checked, stack_micro_batches
from ms_deepseek.train import metrics as metrics_mod
from ms_deepseek.train.components import Checkpointer, RngState, RunCounters, Throughput
from ms_deepseek.train.distributed import any_rank
from ms_deepseek.train.lease import RunLease
from ms_deepseek.train.lora_run import LoraModel, model_converter
from ms_deepseek.train.parallelism import parallelism_of, this_stage
from ms_deepseek.train.preempt import Heartbeat, StopRequest
from ms_deepseek.train.resume import agree_on_resume, check_settings, intact, set_aside_newer


@dataclass
class TrainResult:
    run_dir: Path
    steps: int  # optimizer steps completed (total, including resumed ones)
    final_loss: float
    losses: List[float] = field(default_factory=list)  # LM loss of every step run in this call
    checkpoint: Optional[Path] = None
    metrics_path: Optional[Path] = None
    tokens_per_s: float = 0.0  # steady state: steps after the first (compile) step of this call
    wall_s: float = 0.0
    complete: bool = False  # the resumed checkpoint had already reached train.steps: nothing was run
    preempted: Optional[str] = None  # the stop signal's name: stopped early, after saving a checkpoint
    dry_run: Optional[str] = None  # MS_SIMULATION_LEVEL of MindSpore's dry run: the step compiled, nothing ran


def dry_run_level() -> Optional[str]:
    """``MS_SIMULATION_LEVEL`` when MindSpore's dry run is on, else None.

    Under the dry run a compiled step returns placeholders, not its outputs (an int where the step
    returns a tuple; ``diagnostics/compile_worker.py`` never runs a step at level 0 for that reason),
    so training cannot go on past the compile."""
    level = os.environ.get("MS_SIMULATION_LEVEL", "").strip()
    return level or None


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
        raise UserError(
            f"parallel: {par.describe()} needs {par.world_size} workers (dp x tp x pp) but msrun started {world}"
        )
    if not par.uses_semi_auto:  # sharded layouts get their context from the AutoParallel wrapper
        ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.DATA_PARALLEL, gradients_mean=True, device_num=world)
    return rank, world


def _print(msg: str, bar) -> None:
    if bar is not None:
        bar.write(msg)
    else:
        print(msg, flush=True)


def train(
    recipe: Recipe,
    run_dir,
    resume: Optional[str] = None,
    force: bool = False,
    progress: bool = True,
    max_steps: Optional[int] = None,
    allow_changes: bool = False,
    skip_damaged: bool = False,
    take_over: bool = False,
) -> TrainResult:
    """Run the recipe. ``max_steps`` stops early after that many total steps (the schedule still
    spans ``train.steps``), which is how a run is split into resumable pieces. A resume whose recipe
    changes the checkpoint's settings in a way that breaks exactness is refused unless ``allow_changes``
    (train/resume.py, check_settings). A damaged checkpoint is refused naming the newest intact one, which
    ``skip_damaged`` takes (train/resume.py, intact)."""
    return Trainer(recipe, run_dir, resume, force, progress, max_steps, allow_changes, skip_damaged, take_over).run()


@dataclass
class _StepOut:
    """What one optimizer step hands to logging: host floats, plus device scalars read only when logged."""

    loss: float
    aux: float
    stats: np.ndarray  # [L_moe, E + 4] per-MoE-layer routing statistics
    grad_norm: float
    lr: object  # Tensor
    overflow: object  # Tensor (bool)
    loss_scale: object  # Tensor
    stop: bool = False  # some rank got SIGTERM: save this step and stop (train/preempt.py)


class Trainer:
    """One worker's run of a recipe. :meth:`run` is the whole algorithm over parts that own their state:

    the layout (:mod:`.parallelism`: data parallel or sharded), the model converter (:mod:`.lora_run`: a full
    model or LoRA / QLoRA), the data position (the dataset), :class:`~.components.RunCounters`,
    :class:`~.components.RngState`, the optimizer tensors, the metrics counters
    (:class:`~.components.Throughput`) and the :class:`~.components.Checkpointer` that saves them all.

    Phases: ``_check_layout`` (refusals that need nothing built) -> ``_setup_run`` (device, collective
    group, the run folder's lease, resume state, step range) -> ``_build_data`` (this rank's batches,
    first one read) -> ``_build_model`` -> ``_build_step`` (optimizer, compiled step) -> ``_restore``
    (resume: tensors + RNG; under MindSpore's dry run: compile and stop) -> ``_open_outputs`` (run
    folder, metrics, progress) -> per step ``_train_step``: ``_run_step``, ``_account``, ``_log``,
    ``_maybe_save``.
    Refusals about the layout, the workers, the resume state and the data come before anything
    is written to the run folder."""

    lease: Optional[RunLease] = None  # rank 0's lease of the run folder (train/lease.py), taken in _setup_run

    def __init__(
        self,
        recipe: Recipe,
        run_dir,
        resume: Optional[str],
        force: bool,
        progress: bool,
        max_steps: Optional[int],
        allow_changes: bool = False,
        skip_damaged: bool = False,
        take_over: bool = False,
    ):
        self.started = time.time()
        skip_parameter_load_copies()  # before any graph compiles: no copy of each weight per step (runtime.py)
        self.allow_changes = allow_changes
        self.recipe = recipe
        self.run_dir = Path(run_dir)
        self.cfg = recipe.model_config
        self.par = recipe.parallel
        self.sharded = self.par.uses_semi_auto
        self.converter = model_converter(recipe)
        self.resume, self.force, self.progress, self.max_steps = resume, force, progress, max_steps
        self.skip_damaged = skip_damaged  # --skip-damaged: a damaged checkpoint gives way to the newest intact one
        self.take_over = take_over  # --take-over: the run folder's lease is taken from a holder known to be dead

    @property
    def parallelism(self):
        """This run's layout strategy: data parallel or sharded (:mod:`.parallelism`)."""
        return parallelism_of(self.sharded)

    def run(self) -> TrainResult:
        try:
            return self._run()
        finally:
            if self.lease is not None:
                self.lease.release()

    def _run(self) -> TrainResult:
        self._check_layout()
        self._setup_run()
        if self.complete:
            return self._complete_result()
        self._build_data()  # a bad dataset stops the run before anything is compiled
        self._build_model()
        self._build_step()
        self._restore()
        if dry_run_level() is not None:
            return self._compile_only()
        self._open_outputs()
        self.preempted: Optional[str] = None
        step = self.start_step
        try:
            for step in range(self.start_step + 1, self.stop_at + 1):
                if self._train_step(step):
                    break
        except Exception:
            self.heartbeat.failed(step)  # under launch: the stacks of the ranks behind are dumped first
            raise
        finally:
            self.stop.restore()
            self.bar.close()
            self.writer.close()
        return self._result()

    def _train_step(self, step: int) -> bool:
        """One optimizer step with its logging, validation and checkpoint; True when the run stops here."""
        if self.lease is not None:
            self.lease.check()  # another job took the run folder over: stop before this step writes anything
        t0 = time.time()
        self.heartbeat.beat(step, step - 1)  # launch's watchdog: who did not reach a step
        self.converter.before_step(self.model, self.recipe.train.seed, step, self.rank)
        out = self._run_step()
        self._account(step, out, t0)
        val = self._maybe_evaluate(step)  # a validation step is always logged
        if val or step % self.recipe.logging.log_interval == 0 or step == self.stop_at:
            self._log(step, out, val)
        self._maybe_save(step)
        # the watchdog's step time: every step of this call but the first (the compile)
        self.heartbeat.beat(step, step, time.time() - t0 if step > self.start_step + 1 else None)
        if not out.stop:
            return False
        # some rank got SIGTERM: every rank saves this step and stops (train/preempt.py)
        if self.saved_step != step:
            self._save(step)
        self.preempted = self.stop.name
        return True

    # ---- setup

    def _check_layout(self) -> None:
        par = self.par
        self.parallelism.check(self.recipe, detect_device())
        if self.cfg.use_flash_attention and detect_device() == "CPU":
            # the model refuses it too, but only when called from Python; the step calls it inside a graph
            raise UserError(
                "model.overrides.use_flash_attention: FlashAttentionScore runs only on Ascend; "
                "set it to false to train on CPU"
            )
        self.plan = fit_plan(self.recipe, self.force)
        if par.world_size > 1 and not is_distributed():
            raise UserError(
                f"{self.parallelism.workers_message(par)} needs {par.world_size} workers; start them with "
                "`ms-deepseek launch` (msrun), or set parallel.dp=1 for one worker"
            )

    def _setup_run(self) -> None:
        use_device()
        self.rank, self.world = init_distributed(self.par) if is_distributed() else (0, 1)
        # one writer per run folder: rank 0 holds its lease before reading or writing anything there (a dry
        # run writes nothing there)
        if self.rank == 0 and dry_run_level() is None:
            if (self.resume or self.recipe.checkpoint.resume) == "latest" and not self.run_dir.exists():
                ckpt_mod.resolve_checkpoint("latest", ckpt_mod.RESUME, self.run_dir)  # says there is no such run
            self.lease = RunLease.acquire(self.run_dir, self.take_over)
        # Rank 0 coordinates checkpoints; the logging rank sees the real loss (with pipeline
        # parallelism only the last stage computes it).
        self.is_main = self.rank == self.parallelism.log_rank(self.par)
        self.resume_dir = self._resume_dir()
        self.state = ckpt_mod.read_state(self.resume_dir) if self.resume_dir else {}
        self.start_step = int(self.state.get("step", 0))
        # a resume continues the run it resumes: the command's changes to its settings are named, and
        # those that break exactness are refused unless --allow-changes
        self.resume_notes = (
            check_settings(
                self.recipe,
                ckpt_mod.read_recipe(self.resume_dir, missing_ok=True),
                self.state,
                self.resume_dir,
                self.run_dir,
                self.allow_changes,
            )
            if self.resume_dir is not None
            else []
        )
        if self.resume_dir is not None:
            set_aside_newer(self.run_dir, self.start_step, self.resume_dir, self.force, self.rank)
        self.total = self.recipe.train.steps
        self.stop_at = min(self.total, self.max_steps) if self.max_steps is not None else self.total
        # A finished run re-run by a restart loop is a success, not an error (exit 0, nothing written).
        self.complete = self.start_step >= self.total

    def _resume_dir(self) -> Optional[Path]:
        """The checkpoint this call continues (None: a fresh start); every rank agrees on it."""
        existing = ckpt_mod.CheckpointManager(self.run_dir / "checkpoints").latest()
        resume = self.resume or self.recipe.checkpoint.resume  # the command line wins over the recipe
        if self.world > 1 and resume:
            found = agree_on_resume(resume, existing, self.run_dir, self.rank, self.skip_damaged)
        elif resume == "auto":  # newest complete checkpoint when there is one, else a fresh start
            found = intact(existing, self.skip_damaged)
        else:
            found = ckpt_mod.resolve_checkpoint(resume, ckpt_mod.RESUME, self.run_dir) if resume else None
            found = intact(found, self.skip_damaged)
        if found is None and existing is not None:
            raise UserError(
                f"--output {self.run_dir}: already holds checkpoints (newest {existing.name}); pass "
                "--resume to continue that run, or choose another --output"
            )
        return found

    def _build_data(self) -> None:
        from ms_deepseek.data.dataset import build_train_dataset
        from ms_deepseek.data.validation import build_validation, build_validation_by_source

        recipe, cfg = self.recipe, self.cfg
        data_rank, data_world, self.rows = self.parallelism.data_coordinates(
            self.rank, self.world, self.par, recipe.train.micro_batch_size
        )
        self.dataset = build_train_dataset(
            recipe.data,
            self.rows,
            data_rank,
            data_world,
            state=self.state.get("data"),
            max_positions=cfg.max_position_embeddings,
            vocab_size=cfg.vocab_size,
            progress=self.progress and self.is_main,
            static_shapes=self.parallelism.static_shapes,
        )
        self.seq_len = self.dataset.seq_len
        self.batches = first_batch_checked(self.dataset)
        # read once now (a bad validation set fails before compiling); the same batches every time. A
        # sharded rank reads its rows by the training rule (data_coordinates): one micro-batch [rows, T] each
        self.validation = build_validation(
            recipe.data,
            self.rows,
            data_rank,
            data_world,
            recipe.train.eval_batches,
            max_positions=cfg.max_position_embeddings,
            vocab_size=cfg.vocab_size,
        )
        # a weighted mixture with a held-out fraction: val_loss/<source> beside val_loss, one set per source
        self.validation_by_source, self.validation_notes = build_validation_by_source(
            recipe.data,
            self.rows,
            data_rank,
            data_world,
            recipe.train.eval_batches,
            max_positions=cfg.max_position_embeddings,
            vocab_size=cfg.vocab_size,
        )

    def _build_model(self) -> None:
        """Random init (or the weights folder's weights), the converter (LoRA), then the plan: strategies
        (inert in data parallel), expert placement, recompute; on Ascend the device memory pool is reserved."""
        import mindspore as ms

        from ms_deepseek.parallel_apply.apply import apply_plan
        from ms_deepseek.parallel_plan.memory import reserve_device_memory
        from ms_deepseek.parallel_plan.ranks import stage_of_rank

        ms.set_seed(self.recipe.train.seed)
        np.random.seed(self.recipe.train.seed)
        weights_folder = self.converter.weights_folder(self.recipe, self.run_dir)
        load = weights_folder if self.converter.loads_weights(self.resume_dir) else None
        model = self.parallelism.build_model(
            self.cfg,
            load,
            self.progress and self.is_main,
            _config_changes(self.recipe, load) if load is not None else {},
        )
        self.converter.convert(
            model,
            self.recipe,
            self.run_dir,
            write_base=weights_folder is None and self.is_main,
            base=weights_folder,
            sharded=self.sharded,
        )
        model.set_train(True)
        par = self.par
        self.applied = apply_plan(model, par, self.cfg)
        if par.reserve_memory:  # Ascend: pool up to HBM - runtime - HCCL, estimate up front (no-op on CPU)
            reserve_device_memory(
                self.plan,
                par.memory_headroom_gb,
                stage=stage_of_rank(self.rank, par) if par.pp > 1 else None,
                hbm_gb=par.hbm_gb,
            )
        self.model = model

    def _build_step(self) -> None:
        """Optimizer, execution mode and the compiled step (one graph per optimizer step)."""
        import mindspore as ms

        from ms_deepseek.parallel_apply.apply import pipeline_wrap
        from ms_deepseek.train import optim
        from ms_deepseek.train.step import build_step

        recipe, cfg, par, world = self.recipe, self.cfg, self.par, self.world
        tc = recipe.train
        optimizer = optim.build_optimizer(self.model.trainable_params(), recipe.optim, self.total)
        ms.set_context(mode=ms.GRAPH_MODE if tc.mode == "graph" else ms.PYNATIVE_MODE)
        allow_graph_depth(cfg.num_hidden_layers)  # past ~16 layers MindSpore's default refuses the step
        if tc.mode == "pynative" and detect_device() == "CPU":
            # asynchronous launch costs ~0.8 ms per op on 2 cores: synchronous is 2.2x faster here
            ms.runtime.launch_blocking()
        # data parallel: average gradients here; sharded layouts: AutoParallel inserts the reductions
        reducer = self.parallelism.grad_reducer(optimizer, world)
        self.dynamic = cfg.compute_dtype == "float16"
        self.moe_layers = cfg.moe_layer_indices
        self.E = cfg.n_routed_experts or 0
        self.k = par.micro_batches if par.pp > 1 else tc.grad_accum_steps  # micro-batches per step
        wrap = (lambda net: pipeline_wrap(net, par, self.applied, model_prefix="model")) if par.pp > 1 else None
        # what a checkpoint holds (before build_step, which may mark a frozen embedding trainable for the graph)
        self.model_tensors = self.converter.checkpoint_tensors(self.model)
        step_cell, update = build_step(
            self.model, optimizer, tc, par, dynamic_loss_scale=self.dynamic, grad_reducer=reducer, wrap_net=wrap
        )
        self.opt_shards = None  # sharded + parallel.optimizer_shard: set after the compile (_restore)
        self.strategy_file = self.run_dir / "strategy" / f"rank_{self.rank:05d}.ckpt"
        self.step_cell = self.parallelism.wrap_step(step_cell, par, self.strategy_file)
        self.opt_tensors = dict(optim.optimizer_state(optimizer))
        self.opt_tensors["loss_scale"] = update.loss_scale
        self.opt_tensors["loss_scale_good_steps"] = update.good_steps
        self.stats_mean = self.parallelism.stats_mean(world)

    def _restore(self) -> None:
        """Resume: model + optimizer tensors and the RNG state of the checkpoint, read for this run's layout.

        The checkpoint may be whole or sharded and of another layout: each tensor (or, in a sharded
        run, this rank's slice of it) is read from whatever the checkpoint holds. A sharded run
        compiles first (its parameters are slices then) and, without a checkpoint, reads its slices
        of the weights folder (it was built without allocating): ``parallelism.Sharded.prepare_restore``."""
        layout = self.parallelism.prepare_restore(self)
        if self.resume_dir is None:
            return
        resumed = open_for_resume(self.resume_dir)
        opt_layout = layout and layout.for_optimizer()
        restore_into(
            self._this_stage(self.model_tensors, layout),
            resumed.model,
            "model",
            layout=layout,
            rank=self.rank,
            applied=self.applied,
            part=self._opt_part,
        )
        restore_into(
            self._this_stage(self.opt_tensors, opt_layout),
            resumed.optimizer,
            "optimizer",
            layout=opt_layout,
            rank=self.rank,
            applied=self.applied,
            part=self._opt_part,
        )
        RngState().load_state_dict(self.state.get("rng", {}))

    def _this_stage(self, tensors: Dict[str, object], layout) -> Dict[str, object]:
        """The tensors this rank's pipeline stage holds (``parallelism.this_stage``)."""
        return this_stage(tensors, layout, self.rank, self.par)

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
        return layout.with_optimizer(
            {n: (full.get(n.split(".", 1)[-1], tuple(p.shape)), "F32") for n, p in self.opt_tensors.items()}
        )

    def _load_base_slices(self) -> None:
        """Sharded LoRA run: this rank's slices of the frozen base (``lora_run.LoraModel.load_slices``)."""
        LoraModel().load_slices(self, None)

    def _load_weights_slices(self, layout, params) -> None:
        """Sharded run: this rank's slices of ``params`` from the weights folder, or a seeded random init."""
        weights = self.recipe.weights_folder
        if weights is None:
            mine = self._this_stage({p.name: p for p in self.model.get_parameters()}, layout)
            for param in mine.values():  # nothing to read: materialise the seeded init (this stage only)
                if param.has_init:
                    param.init_data()
            return
        restore_into(
            self._this_stage(params, layout),
            open_checkpoint(weights).model,
            "model",
            layout=layout,
            rank=self.rank,
            part=self._opt_part,
        )

    def _open_outputs(self) -> None:
        """Run folder (main rank), metrics writer, alerts, counters, checkpointer, progress bar, start lines."""
        from ms_deepseek.core.progress import progress_bar

        recipe, run_dir, is_main = self.recipe, self.run_dir, self.is_main
        self.manager = ckpt_mod.CheckpointManager(
            run_dir / "checkpoints", recipe.checkpoint.keep_last, protected=self.resume_dir
        )  # never pruned
        if is_main:
            run_dir.mkdir(parents=True, exist_ok=True)
            self.manager.remove_partial()
            metrics_mod.truncate_after(run_dir / "metrics.jsonl", self.start_step)  # before the writer opens it
            atomic_write_text(run_dir / "recipe.yaml", recipe.to_yaml())
        self.writer = metrics_mod.MetricsWriter(run_dir, recipe.logging.tensorboard and is_main, enabled=is_main)
        self.monitor = _alert_monitor() if (is_main and recipe.logging.alerts) else None
        self.memory_fn = _memory_metrics_fn()
        self._open_state()
        self.evaluator = None  # built (and its graph compiled) at the first validation
        self.stop = StopRequest().install()  # SIGTERM: save at the next step boundary, then stop
        self.heartbeat = Heartbeat(run_dir, self.rank)
        self.bar = progress_bar(
            total=self.stop_at,
            initial=self.start_step,
            desc="train",
            unit="step",
            dynamic_ncols=True,
            leave=False,
            enabled=self.progress and is_main and recipe.logging.progress_bar,
        )
        if is_main:
            self._print_start()

    def _open_state(self) -> None:
        """The counters (from the resumed state), the metrics counters and the checkpointer over them all."""
        self.counters = RunCounters(self.started)
        self.counters.load_state_dict(self.state)
        self.metrics = Throughput(self.recipe.global_batch_size * self.seq_len)
        self.last_ckpt: Optional[Path] = None
        self.saved_step: Optional[int] = None
        self.checkpointer = Checkpointer(
            self.manager,
            self.dataset,
            RngState(),
            self.counters,
            {"world_size": self.world, "global_batch_size": self.recipe.global_batch_size, "seq_len": self.seq_len},
        )

    def _print_start(self) -> None:
        """The start line, the resume's notes, the LoRA line, the recipe's warnings and the validation line."""
        recipe, cfg, world = self.recipe, self.cfg, self.world
        what = f"resuming {self.resume_dir} at step {self.start_step}" if self.resume_dir else "starting"
        self._print(
            f"{what}: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
            f"{self.E} routed experts; global batch {recipe.global_batch_size} x {self.seq_len} tokens "
            f"({world} worker{'s' if world > 1 else ''}); output {self.run_dir}"
        )
        for line in self.resume_notes:
            self._print(line)
        converted = self.converter.describe(recipe)
        if converted is not None:
            self._print(converted)
        from ms_deepseek.config.recipe import recipe_warnings

        warnings = recipe_warnings(recipe) + self._disk_warnings()
        if hasattr(self.dataset, "repeat_warnings"):  # a weighted mixture: a source read too many times
            warnings += self.dataset.repeat_warnings(self.stop_at * recipe.global_batch_size)
        for warning in warnings:
            self._print(f"warning: {warning}")
        if self.validation is not None:
            every = recipe.train.eval_interval
            per_source = "".join(
                f"; val_loss/{name}: {v.used_samples} of its {v.total_samples} held-out samples"
                for name, v in self.validation_by_source.items()
            )
            self._print(
                f"validation: {self.validation.description}, "
                + (f"every {every} steps and at the end" if every else "at the end")
                + per_source
            )
            for note in self.validation_notes:
                self._print(f"warning: {note}")

    def _disk_warnings(self) -> List[str]:
        """The run's planned saves against the free space of its checkpoints folder (each save is also
        checked before it is written: ``checkpoint.training.disk_full_as_one_line``)."""
        ck = self.recipe.checkpoint
        steps = range(self.start_step + 1, self.stop_at + 1)
        saves = sum(1 for s in steps if self._saves_at(s))
        if not saves:
            return []
        size = ckpt_mod.checkpoint_bytes(self.model_tensors, self.opt_tensors)
        held = len(self.manager.complete())
        # at most keep_last checkpoints stay, plus the one being written before the oldest is pruned
        more = max(0, min(held + saves, ck.keep_last + 1) - held)
        free = ckpt_mod.free_bytes(self.manager.folder)
        if more * size <= free:
            return []
        g = ckpt_mod.gigabytes
        return [
            f"checkpoint: this run writes {saves} checkpoint(s) of {g(size)}, up to {more} more at once "
            f"(checkpoint.keep_last {ck.keep_last}): {g(more * size)}, but {self.manager.folder} has {g(free)} "
            "free; a save that does not fit stops the run"
        ]

    # ---- the loop's pieces

    def _run_step(self) -> _StepOut:
        """Read the step's k micro-batches, run the compiled step, read its outputs on the host."""
        from mindspore import Tensor

        fetch = time.time()
        parts = [next(self.batches) for _ in range(self.k)]
        self.metrics.waited(time.time() - fetch)  # the step waited this long for its batch
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
        self.counters.tokens_seen += self.metrics.tokens_per_step
        # the first step of the call compiled the graph: tokens/s is measured from its end
        self.metrics.stepped(out.loss, step == self.start_step + 1, t0)
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

            self.evaluator = Evaluator(
                self.model, self.validation.batches, self.world, parallel=self.parallelism.eval_parallel(self.par)
            )
        start = time.time()
        result = self.evaluator()
        for name, per_source in self.validation_by_source.items():  # the same compiled eval graph
            result[f"val_loss/{name}"] = self.evaluator.loss(per_source.batches)
        self.metrics.evaluated(time.time() - start)  # kept out of tokens/s
        return result

    def _log(self, step: int, out: _StepOut, val: Optional[Dict[str, float]] = None) -> None:
        """One metrics record (every rank computes it; the main rank writes, prints, raises alerts)."""
        now = time.time()
        record = {
            "step": step,
            "loss": out.loss,
            "total_loss": out.loss + out.aux,
            "lr": float(out.lr.asnumpy()),
            "grad_norm": out.grad_norm,
            "elapsed_s": self.counters.elapsed(now),
        }
        record.update(self.metrics.interval_fields(now))
        record.update(metrics_mod.moe_fields(out.stats, self.moe_layers, self.E))
        if val:
            record.update(val)
        if hasattr(self.dataset, "source_counts"):  # a weighted mixture: samples drawn per source so far
            record["samples_by_source"] = self.dataset.source_counts
        if self.dynamic:
            record["loss_scale"] = float(out.loss_scale.asnumpy())
            record["overflow"] = bool(out.overflow.asnumpy())
        metrics_mod.optional_memory(record, self.memory_fn() if self.memory_fn else None)
        self.metrics.reset_interval(now)
        if self.is_main:
            self.writer.write(record)
            self._print(metrics_mod.console_line(record, self.total))
            for alert in self.monitor.observe(record) if self.monitor is not None else []:
                self._print(f"ALERT {alert}")

    def _maybe_save(self, step: int) -> None:
        """Checkpoint every ``checkpoint.save_interval`` steps and at the last step (``save_final``)."""
        if self._saves_at(step):
            self._save(step)

    def _saves_at(self, step: int) -> bool:
        ck = self.recipe.checkpoint
        return bool((ck.save_interval and step % ck.save_interval == 0) or (step == self.stop_at and ck.save_final))

    def _save(self, step: int) -> None:
        """One checkpoint of this step (every rank takes part; rank 0 completes it)."""
        self.saved_step = step
        if self.lease is not None:
            self.lease.check(read=True)
        saved = self.checkpointer.save(self, step)
        if saved is not None:
            self.last_ckpt = saved

    def _print(self, msg: str) -> None:
        _print(msg, self.bar if not self.bar.disable else None)

    def _compile_only(self) -> TrainResult:
        """MindSpore's dry run: compile the step for this rank's batch shape and stop (nothing is written)."""
        from mindspore import Tensor

        shape = (self.k * self.rows, self.seq_len)  # [k * b, T]; a sharded step compiled already (_restore)
        self.step_cell.compile(Tensor(np.zeros(shape, np.int32)), Tensor(np.zeros(shape, np.int32)))
        return TrainResult(
            run_dir=self.run_dir,
            steps=self.start_step,
            final_loss=float("nan"),
            wall_s=time.time() - self.started,
            dry_run=dry_run_level(),
        )

    def _complete_result(self) -> TrainResult:
        metrics = self.run_dir / "metrics.jsonl"
        return TrainResult(
            run_dir=self.run_dir,
            steps=self.start_step,
            final_loss=float("nan"),
            checkpoint=self.resume_dir,
            metrics_path=metrics if metrics.is_file() else None,
            complete=True,
        )

    def _result(self) -> TrainResult:
        losses = self.metrics.losses
        return TrainResult(
            run_dir=self.run_dir,
            steps=self.saved_step if self.preempted else self.stop_at,
            final_loss=losses[-1] if losses else float("nan"),
            losses=losses,
            checkpoint=self.last_ckpt or self.manager.latest(),  # rank 0's path (shared folder)
            metrics_path=self.writer.path if self.is_main else None,
            tokens_per_s=self.metrics.steady_tokens_per_s,
            wall_s=time.time() - self.started,
            preempted=self.preempted,
        )


def _config_changes(recipe: Recipe, folder=None) -> Dict:
    """Fields of the resolved config that differ from the folder's config.json (overrides, alphas)."""
    from ms_deepseek.config.model import load_model_config

    base = load_model_config(str(folder) if folder is not None else recipe.model.source)
    cfg = recipe.model_config
    return {k: getattr(cfg, k) for k in cfg.__dataclass_fields__ if getattr(cfg, k) != getattr(base, k)}


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


def _alert_monitor():
    from ms_deepseek.train.alerts import AlertMonitor

    return AlertMonitor()


def _memory_metrics_fn():
    """Device memory numbers for the record; None on CPU, where MindSpore keeps no device pool."""
    if detect_device() == "CPU":
        return None
    from ms_deepseek.parallel_plan.memory import memory_metrics

    return memory_metrics
