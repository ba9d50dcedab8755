"""Recipe -> trained model: the training loop of one worker (data-parallel under msrun).

``train(recipe, run_dir, options)`` runs one call of a recipe with the command's :class:`~.context.TrainOptions`:
:func:`start_run` settles what needs nothing built (the refusals about the layout, the device, the collective
group, the run folder's lease, the resume point, the steps of this call), :func:`build_trainer` builds a
complete :class:`Trainer` (the rank's batches, the model, our AdamW and the compiled step, every part at the
resume point, the run folder's outputs open) and :meth:`Trainer.run` runs the steps. Every
``logging.log_interval`` steps a record goes to ``RUN_DIR/metrics.jsonl`` and TensorBoard and a line is
printed; every ``checkpoint.save_interval`` steps (and at the end) ``RUN_DIR/checkpoints/step_N`` is saved.
A resume continues from a checkpoint exactly: same data position, optimizer state, step count and RNG state.
The parts live where their concern does: :mod:`.build` (data, model, step), :mod:`.parallelism` (the layout),
:mod:`.lora_run` (the model converter), :mod:`.components` (counters, RNG, throughput, the checkpointer),
:mod:`.guards` (lease, heartbeat, stop request), :mod:`.run_log` (records, console, alerts), :mod:`.evaluate`
and :mod:`.resume`.

Under msrun (``MS_WORKER_NUM`` set) each worker joins the collective group
(``mindspore.communication.init``, mccl on CPU, HCCL on Ascend), reads its shard of each
global batch, and gradients are averaged with ``nn.DistributedGradReducer`` once per
optimizer step; rank 0 writes metrics and checkpoints.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import numpy as np

from ms_deepseek.checkpoint import training as ckpt_mod
from ms_deepseek.config.recipe import Recipe
from ms_deepseek.core.atomic import atomic_write_text
from ms_deepseek.core.runtime import skip_parameter_load_copies, use_device
from ms_deepseek.data.batches import stack_micro_batches
from ms_deepseek.jobs.distributed import any_rank, dry_run_level, init_distributed
from ms_deepseek.jobs.lease import RunLease
from ms_deepseek.jobs.preempt import Heartbeat, StopRequest
from ms_deepseek.train import metrics as metrics_mod
from ms_deepseek.train import run_log
from ms_deepseek.train.build import TrainData, build_data, build_model, build_step, check_layout, fit_plan
from ms_deepseek.train.components import Checkpointer, RunCounters, Throughput
from ms_deepseek.train.context import (
    LayoutStrategy,
    ModelConverter,
    ModelSource,
    RunContext,
    TrainOptions,
    TrainTensors,
)
from ms_deepseek.train.evaluate import Evaluation
from ms_deepseek.train.guards import RunGuards, take_lease
from ms_deepseek.train.lora_run import model_converter
from ms_deepseek.train.parallelism import parallelism_of
from ms_deepseek.train.resume import ResumePoint, resume_point
from ms_deepseek.train.run_log import RunLog, StepOut

__all__ = ["RunStart", "TrainResult", "Trainer", "build_trainer", "fit_plan", "start_run", "train"]


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


def train(recipe: Recipe, run_dir, options: TrainOptions, data=None) -> TrainResult:
    """Run the recipe with the command's ``options`` (``resume``, ``force``, ``progress``, ``max_steps``,
    ``allow_changes``, ``skip_damaged``, ``take_over``). ``max_steps`` stops early after that many total steps
    (the schedule still spans ``train.steps``), which is how a run is split into resumable pieces. A resume
    whose recipe changes the checkpoint's settings in a way that breaks exactness is refused unless
    ``allow_changes`` (train/resume.py, check_settings). A damaged checkpoint is refused naming the newest
    intact one, which ``skip_damaged`` takes (train/resume.py, intact). ``data``: the recipe's data as the
    preflight resolved it (``data.sources.ResolvedData``; None: resolved when the data is built)."""
    start = start_run(recipe, run_dir, options, data)
    try:
        if start.finished:
            # a finished run re-run by a restart loop is a success, not an error (exit 0, nothing written)
            return finished_result(start)
        parts = build_parts(start)
        if dry_run_level() is not None:
            return compile_only(start, parts)
        return build_trainer(start, parts).run()
    finally:
        start.release()


# ------------------------------------------------------------------------------------------ the builders
@dataclass(frozen=True)
class RunStart:
    """What one call settles before anything is built: who runs (``ctx``), the layout and the model converter,
    the planner's verdict, the resume point every rank agrees on, the steps of this call, rank 0's lease and the
    recipe's data as the preflight resolved it (None: resolved when the data is built)."""

    ctx: RunContext
    options: TrainOptions
    strategy: LayoutStrategy
    converter: ModelConverter
    plan: Any  # the planner's verdict (build.fit_plan): sizes the device memory pool
    resume: ResumePoint
    stop_at: int  # the last step of this call
    is_log_rank: bool  # the rank that sees the real loss (with pipeline parallelism, the last stage)
    lease: Optional[RunLease]
    started: float
    resolved_data: Any = None  # data.sources.ResolvedData

    @property
    def finished(self) -> bool:
        """The resumed checkpoint is at ``train.steps`` already: nothing to run."""
        return self.resume.step >= self.ctx.recipe.train.steps

    def release(self) -> None:
        if self.lease is not None:
            self.lease.release()


def start_run(recipe: Recipe, run_dir, options: TrainOptions, data=None) -> RunStart:
    """Refusals that need nothing built, the device, the collective group, the run folder's lease (rank 0),
    the resume point every rank agrees on, and the range of steps this call runs. The lease is released when
    this raises after taking it."""
    started = time.time()
    skip_parameter_load_copies()  # before any graph compiles: no copy of each weight per step (runtime.py)
    converter = model_converter(recipe)
    strategy = parallelism_of(recipe.parallel.uses_semi_auto)
    plan = check_layout(recipe, strategy, options.force)
    use_device()
    rank, world = init_distributed(recipe.parallel)
    ctx = RunContext(recipe, Path(run_dir), rank, world)
    lease = take_lease(ctx, options)  # one writer per run folder, before anything there is read or written
    try:
        resume = resume_point(ctx, options)
    except BaseException:
        if lease is not None:
            lease.release()
        raise
    total = recipe.train.steps
    stop_at = min(total, options.max_steps) if options.max_steps is not None else total
    is_log_rank = rank == strategy.log_rank(recipe.parallel)
    return RunStart(ctx, options, strategy, converter, plan, resume, stop_at, is_log_rank, lease, started, data)


@dataclass(frozen=True)
class RunParts:
    """A started call's parts, built and at the resume point (:meth:`~.components.Checkpointer.restore`)."""

    data: TrainData
    tensors: TrainTensors
    stats_mean: Optional[Callable]  # the logged values' mean over the ranks (None: nothing to reduce)
    checkpointer: Checkpointer


def build_parts(start: RunStart) -> RunParts:
    """This rank's data, the model, the compiled step and the checkpointer over them, every part restored:
    the data at its position (first batch read), the tensors (a sharded step compiles and reads its slices;
    a resume reads the checkpoint's), the RNG and the counters."""
    ctx, strategy, converter, resume = start.ctx, start.strategy, start.converter, start.resume
    loud = start.options.progress and start.is_log_rank
    data = build_data(ctx, strategy, loud, start.resolved_data)
    base = converter.weights_folder(ctx.recipe, ctx.run_dir)
    source = ModelSource(base, converter.loads_weights(resume.folder), base is None and start.is_log_rank)
    built = build_model(ctx, strategy, converter, source, start.plan, loud)
    tensors, stats_mean = build_step(ctx, strategy, converter, built, (data.rows, data.seq_len))
    manager = ckpt_mod.CheckpointManager(
        ctx.run_dir / "checkpoints", ctx.recipe.checkpoint.keep_last, protected=resume.folder
    )  # the resumed checkpoint is never pruned
    counters = RunCounters(start.started)
    checkpointer = Checkpointer(ctx, strategy, converter, tensors, data, counters, manager, start.stop_at)
    checkpointer.restore(resume.folder, resume.state)
    return RunParts(data, tensors, stats_mean, checkpointer)


def build_trainer(start: RunStart, parts: Optional[RunParts] = None) -> "Trainer":
    """The complete trainer of a started call: its parts (:func:`build_parts` unless given), then the run
    folder (logging rank: partial saves removed, metrics past the resume point cut, the recipe written), the
    log, the throughput counters, the guards and the validation schedule."""
    parts = parts if parts is not None else build_parts(start)
    ctx, recipe = start.ctx, start.ctx.recipe
    if start.is_log_rank:
        ctx.run_dir.mkdir(parents=True, exist_ok=True)
        parts.checkpointer.manager.remove_partial()
        metrics_mod.truncate_after(ctx.run_dir / "metrics.jsonl", start.resume.step)  # before the writer opens it
        atomic_write_text(ctx.run_dir / "recipe.yaml", recipe.to_yaml())
    parallel = start.strategy.eval_parallel(ctx.par)
    return Trainer(
        ctx=ctx,
        options=start.options,
        converter=start.converter,
        resume=start.resume,
        stop_at=start.stop_at,
        is_log_rank=start.is_log_rank,
        started=start.started,
        data=parts.data,
        tensors=parts.tensors,
        stats_mean=parts.stats_mean,
        checkpointer=parts.checkpointer,
        log=RunLog(ctx, start.is_log_rank, start.options.progress, start.resume.step, start.stop_at),
        throughput=Throughput(recipe.global_batch_size * parts.data.seq_len),
        guards=RunGuards(start.lease, Heartbeat(ctx.run_dir, ctx.rank), StopRequest()),
        evaluation=Evaluation(
            parts.tensors.model, parts.data, ctx.world, parallel, recipe.train.eval_interval, start.stop_at
        ),
    )


def compile_only(start: RunStart, parts: RunParts) -> TrainResult:
    """MindSpore's dry run: compile the step for this rank's batch shape and stop (nothing is written)."""
    from mindspore import Tensor

    zeros = Tensor(np.zeros(parts.tensors.input_shape, np.int32))  # a sharded step compiled already (restore)
    parts.tensors.step_cell.compile(zeros, zeros)
    return TrainResult(
        run_dir=start.ctx.run_dir,
        steps=start.resume.step,
        final_loss=float("nan"),
        wall_s=time.time() - start.started,
        dry_run=dry_run_level(),
    )


def finished_result(start: RunStart) -> TrainResult:
    metrics = start.ctx.run_dir / "metrics.jsonl"
    return TrainResult(
        run_dir=start.ctx.run_dir,
        steps=start.resume.step,
        final_loss=float("nan"),
        checkpoint=start.resume.folder,
        metrics_path=metrics if metrics.is_file() else None,
        complete=True,
    )


# ------------------------------------------------------------------------------------------ the loop
@dataclass(eq=False)
class Trainer:
    """One worker's call of a recipe, complete when :func:`build_trainer` returns it: :meth:`run` is the loop,
    :meth:`train_step` one step (the optimisation, its record and validation, its checkpoint), over parts that
    own their state: the data (:class:`~.build.TrainData`), the tensors and compiled step
    (:class:`~.context.TrainTensors`), the :class:`~.components.Checkpointer` (every stateful part and the save
    schedule), the log, the throughput counters, the guards (:mod:`.guards`) and the validation schedule."""

    ctx: RunContext
    options: TrainOptions
    converter: ModelConverter
    resume: ResumePoint
    stop_at: int
    is_log_rank: bool
    started: float
    data: TrainData
    tensors: TrainTensors
    stats_mean: Optional[Callable]
    checkpointer: Checkpointer
    log: RunLog
    throughput: Throughput
    guards: RunGuards
    evaluation: Evaluation

    @property
    def recipe(self) -> Recipe:
        return self.ctx.recipe

    @property
    def run_dir(self) -> Path:
        return self.ctx.run_dir

    @property
    def counters(self) -> RunCounters:
        """The run's counters: one of the checkpointer's parts."""
        return self.checkpointer.counters

    def run(self) -> TrainResult:
        """The start lines, then the steps of this call until its last or a stop request; the guards are
        closed (SIGTERM's handler back, the lease released) however it ends."""
        try:
            return self._steps()
        finally:
            self.guards.close()

    def _steps(self) -> TrainResult:
        self.guards.install()  # SIGTERM: save at the next step boundary, then stop
        if self.is_log_rank:
            for line in self._start_lines():
                self.log.print(line)
        preempted: Optional[str] = None
        step = self.resume.step
        try:
            for step in range(self.resume.step + 1, self.stop_at + 1):
                if self.train_step(step).stop:
                    preempted = self.guards.stop_name
                    break
        except Exception:
            self.guards.failed(step)  # under launch: the stacks of the ranks behind are dumped first
            raise
        finally:
            self.log.close()
        return self._result(preempted)

    def _start_lines(self) -> List[str]:
        """The start line, the resume's notes, the LoRA line, the recipe's warnings and the validation lines."""
        from ms_deepseek.config.recipe import recipe_warnings

        recipe, cfg, world, data = self.recipe, self.ctx.cfg, self.ctx.world, self.data
        what = f"resuming {self.resume.folder} at step {self.resume.step}" if self.resume.folder else "starting"
        lines = [
            f"{what}: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
            f"{cfg.n_routed_experts or 0} routed experts; global batch {recipe.global_batch_size} x "
            f"{data.seq_len} tokens ({world} worker{'s' if world > 1 else ''}); output {self.run_dir}"
        ]
        lines += self.resume.notes
        converted = self.converter.describe(recipe)
        lines += [converted] if converted is not None else []
        saves = sum(1 for s in range(self.resume.step + 1, self.stop_at + 1) if self.checkpointer.due(s))
        size = ckpt_mod.checkpoint_bytes(self.tensors.model_tensors, self.tensors.opt_tensors)
        warnings = recipe_warnings(recipe) + run_log.disk_warnings(recipe, saves, size, self.checkpointer.manager)
        if hasattr(data.dataset, "repeat_warnings"):  # a weighted mixture: a source read too many times
            warnings += data.dataset.repeat_warnings(self.stop_at * recipe.global_batch_size)
        return lines + [f"warning: {w}" for w in warnings] + run_log.validation_lines(recipe, data)

    # ---- one step

    def train_step(self, step: int) -> StepOut:
        """One optimizer step, its record (with validation) and its checkpoint, between the guards. When some
        rank got a stop signal every rank saves this step (``out.stop``) and the run stops after it."""
        t0 = time.time()
        self.guards.step_started(step)
        self.converter.before_step(self.tensors.model, self.recipe.train.seed, step, self.ctx.rank)
        out = self.run_step()
        self.record(step, out, t0)
        self.maybe_save(step)
        first = step == self.resume.step + 1  # compiled the graph: no step time for the watchdog
        self.guards.step_finished(step, None if first else time.time() - t0)
        if out.stop and self.checkpointer.saved_step != step:
            self.save(step)
        return out

    def run_step(self) -> StepOut:
        """Read the step's k micro-batches, run the compiled step, read its outputs on the host."""
        from mindspore import Tensor

        fetch, tensors, cfg = time.time(), self.tensors, self.ctx.cfg
        parts = [next(self.data.batches) for _ in range(tensors.micro_batches)]
        self.throughput.waited(time.time() - fetch)  # the step waited this long for its batch
        input_ids, labels = stack_micro_batches(parts, self.data.dataset.pad_id)  # [k * b, T] each
        outputs, grad_norm, lr, overflow, cur_scale = tensors.step_cell(Tensor(input_ids), Tensor(labels))
        vec = outputs.asnumpy()  # host read: the step is finished
        grad_norm = float(grad_norm.asnumpy())
        loss_v, aux_v = float(vec[1]), float(vec[2])
        n_moe, E = len(cfg.moe_layer_indices), cfg.n_routed_experts or 0
        # [3 + L_moe * (E + 4)] -> [L_moe, E + 4]
        stats_v = vec[3:].reshape(n_moe, E + 4) if n_moe else np.zeros((0, E + 4), np.float32)
        flag = self.guards.stop_flag
        stop = flag > 0
        if self.stats_mean is not None:  # the stop request rides on the AllReduce of the logged values
            loss_v, aux_v, stats_v, stop = self.stats_mean(loss_v, aux_v, stats_v, flag)
        elif self.ctx.world > 1:
            stop = any_rank(flag)
        return StepOut(loss_v, aux_v, stats_v, grad_norm, lr, overflow, cur_scale, stop)

    def record(self, step: int, out: StepOut, t0: float) -> None:
        """The step's counters and throughput; a record every ``logging.log_interval`` steps, at a validation
        and at the call's last step (every rank computes it; the logging rank writes it)."""
        self.counters.tokens_seen += self.throughput.tokens_per_step
        # the first step of the call compiled the graph: tokens/s is measured from its end
        self.throughput.stepped(out.loss, step == self.resume.step + 1, t0)
        self.log.stepped(out.loss)
        val = self.evaluate(step)  # a validation step is always logged
        if not (val or step % self.recipe.logging.log_interval == 0 or step == self.stop_at):
            return
        fields = run_log.elapsed_fields(self.counters, self.throughput)
        extra = dict(val or {})
        if hasattr(self.data.dataset, "source_counts"):  # a weighted mixture: samples drawn per source so far
            extra["samples_by_source"] = self.data.dataset.source_counts
        self.log.log(self.log.record(step, out, fields, extra))

    def evaluate(self, step: int) -> Optional[Dict[str, float]]:
        """The step's validation values (None when it does not validate), their time kept out of tokens/s."""
        start = time.time()
        result = self.evaluation(step)
        if result is not None:
            self.throughput.evaluated(time.time() - start)
        return result

    def maybe_save(self, step: int) -> None:
        """Checkpoint this step when the recipe saves at it (``Checkpointer.due``)."""
        if self.checkpointer.due(step):
            self.save(step)

    def save(self, step: int) -> None:
        """One checkpoint of this step (every rank takes part; rank 0 completes it), the lease checked first."""
        self.guards.before_save()
        self.checkpointer.save(step)

    def _result(self, preempted: Optional[str]) -> TrainResult:
        losses = self.throughput.losses
        return TrainResult(
            run_dir=self.run_dir,
            steps=self.checkpointer.saved_step if preempted else self.stop_at,
            final_loss=losses[-1] if losses else float("nan"),
            losses=losses,
            checkpoint=self.checkpointer.last or self.checkpointer.manager.latest(),  # rank 0's path (shared folder)
            metrics_path=self.log.writer.path if self.is_log_rank else None,
            tokens_per_s=self.throughput.steady_tokens_per_s,
            wall_s=time.time() - self.started,
            preempted=preempted,
        )
