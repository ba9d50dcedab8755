"""Recipe -> trained model: the training loop of one worker (data-parallel under msrun).

``train(recipe, run_dir, resume=None)`` runs a :class:`Trainer`: it builds the model
(random init, or a checkpoint folder's weights), the data-parallel rank's batches,
our AdamW and the compiled train step (one graph per optimizer step), then runs
``train.steps`` optimizer steps. Every ``logging.log_interval`` steps it writes a record
to ``RUN_DIR/metrics.jsonl`` and TensorBoard and prints a line; every
``checkpoint.save_interval`` steps (and at the end) it saves ``RUN_DIR/checkpoints/step_N``.
``resume`` continues from a checkpoint exactly: same data position, optimizer state, step
count and RNG state. The parts live where their concern does: :mod:`.build` (data, model, step),
:mod:`.parallelism` (the layout), :mod:`.lora_run` (the model converter), :mod:`.components` (counters,
RNG, throughput, the checkpointer), :mod:`.run_log` (records, console, alerts) and :mod:`.resume`.

Under msrun (``MS_WORKER_NUM`` set) each worker joins the collective group
(``mindspore.communication.init``, mccl on CPU, HCCL on Ascend), reads its shard of each
global batch, and gradients are averaged with ``nn.DistributedGradReducer`` once per
optimizer step; rank 0 writes metrics and checkpoints.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

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
from ms_deepseek.train.build import build_data, build_model, build_step, check_layout, fit_plan
from ms_deepseek.train.components import Checkpointer, RngState, RunCounters, Throughput
from ms_deepseek.train.context import ModelSource, RunContext, TrainOptions
from ms_deepseek.train.lora_run import model_converter
from ms_deepseek.train.parallelism import TensorFiles, parallelism_of
from ms_deepseek.train.resume import ResumePoint, resume_point
from ms_deepseek.train.run_log import RunLog, StepOut

__all__ = ["TrainResult", "Trainer", "fit_plan", "train"]


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


def train(recipe: Recipe, run_dir, data=None, **options) -> TrainResult:
    """Run the recipe with the command's :class:`~.context.TrainOptions` (``resume``, ``force``, ``progress``,
    ``max_steps``, ``allow_changes``, ``skip_damaged``, ``take_over``). ``max_steps`` stops early after that
    many total steps (the schedule still spans ``train.steps``), which is how a run is split into resumable
    pieces. A resume whose recipe changes the checkpoint's settings in a way that breaks exactness is refused
    unless ``allow_changes`` (train/resume.py, check_settings). A damaged checkpoint is refused naming the
    newest intact one, which ``skip_damaged`` takes (train/resume.py, intact). ``data``: the recipe's data as the
    preflight resolved it (``data.sources.ResolvedData``; None: resolved when the data is built)."""
    return Trainer(recipe, run_dir, TrainOptions(**options), data).run()


class Trainer:
    """One worker's run of a recipe. :meth:`run` is the whole algorithm over parts that own their state:

    the layout (:mod:`.parallelism`: data parallel or sharded), the model converter (:mod:`.lora_run`: a full
    model or LoRA / QLoRA), the data position (the dataset), :class:`~.components.RunCounters`,
    :class:`~.components.RngState`, the optimizer tensors, the metrics counters
    (:class:`~.components.Throughput`) and the :class:`~.components.Checkpointer` that saves and loads them.

    Phases: :meth:`setup` (refusals that need nothing built, device, collective group, the run folder's
    lease, the resume point, step range) -> :meth:`build` (this rank's batches, first one read; model;
    optimizer and compiled step; the checkpointer) -> :meth:`restore` (a sharded step compiles and reads its
    slices; a resume loads the checkpoint; under MindSpore's dry run: compile and stop) -> the run folder,
    metrics and progress -> per step :meth:`train_step`.
    Refusals about the layout, the workers, the resume state and the data come before anything
    is written to the run folder."""

    lease: Optional[RunLease] = None  # rank 0's lease of the run folder (jobs/lease.py), taken in setup

    def __init__(self, recipe: Recipe, run_dir, options: Optional[TrainOptions] = None, data=None):
        self.started = time.time()
        self.resolved_data = data  # the preflight's resolution of the recipe's data (None: build_data resolves)
        skip_parameter_load_copies()  # before any graph compiles: no copy of each weight per step (runtime.py)
        self.recipe, self.run_dir = recipe, Path(run_dir)
        self.options = options or TrainOptions()
        self.converter = model_converter(recipe)
        self.ctx = RunContext(recipe, self.run_dir)

    @property
    def parallelism(self):
        """This run's layout strategy: data parallel or sharded (:mod:`.parallelism`)."""
        return parallelism_of(self.recipe.parallel.uses_semi_auto)

    def run(self) -> TrainResult:
        try:
            return self._run()
        finally:
            if self.lease is not None:
                self.lease.release()

    def _run(self) -> TrainResult:
        self.setup()
        if self.resume.step >= self.recipe.train.steps:
            # a finished run re-run by a restart loop is a success, not an error (exit 0, nothing written)
            return self._complete_result()
        self.build()
        self.restore()
        if dry_run_level() is not None:
            return self._compile_only()
        self.open_outputs()
        self.preempted: Optional[str] = None
        step = self.resume.step
        try:
            for step in range(self.resume.step + 1, self.stop_at + 1):
                if self.train_step(step):
                    break
        except Exception:
            self.heartbeat.failed(step)  # under launch: the stacks of the ranks behind are dumped first
            raise
        finally:
            self.stop.restore()
            self.log.close()
        return self._result()

    # ---- setup

    def setup(self) -> None:
        """Refusals that need nothing built, the device, the collective group, the run folder's lease (rank 0),
        the resume point every rank agrees on, and the range of steps this call runs."""
        options = self.options
        self.plan = check_layout(self.recipe, self.parallelism, options.force)
        use_device()
        rank, world = init_distributed(self.recipe.parallel)
        self.ctx = RunContext(self.recipe, self.run_dir, rank, world)
        # one writer per run folder: rank 0 holds its lease before reading or writing anything there (a dry
        # run writes nothing there)
        if rank == 0 and dry_run_level() is None:
            if (options.resume or self.recipe.checkpoint.resume) == "latest" and not self.run_dir.exists():
                ckpt_mod.resolve_checkpoint("latest", ckpt_mod.RESUME, self.run_dir)  # says there is no such run
            self.lease = RunLease.acquire(self.run_dir, options.take_over)
        # Rank 0 coordinates checkpoints; the logging rank sees the real loss (with pipeline
        # parallelism only the last stage computes it).
        self.is_log_rank = rank == self.parallelism.log_rank(self.recipe.parallel)
        self.resume: ResumePoint = resume_point(self.ctx, options)
        total = self.recipe.train.steps
        self.stop_at = min(total, options.max_steps) if options.max_steps is not None else total

    def build(self) -> None:
        """This rank's data (at the resume point's position), the model, the compiled step, the checkpointer."""
        ctx, converter, loud = self.ctx, self.converter, self.options.progress and self.is_log_rank
        self.data = build_data(ctx, self.parallelism, self.resume.state.get("data"), loud, self.resolved_data)
        base = converter.weights_folder(self.recipe, self.run_dir)
        source = ModelSource(base, converter.loads_weights(self.resume.folder), base is None and self.is_log_rank)
        built = build_model(ctx, self.parallelism, converter, source, self.plan, loud)
        batch = (self.data.rows, self.data.seq_len)
        self.tensors, self.stats_mean = build_step(ctx, self.parallelism, converter, built, batch)
        self.counters = RunCounters(self.started)
        manager = ckpt_mod.CheckpointManager(
            self.run_dir / "checkpoints", self.recipe.checkpoint.keep_last, protected=self.resume.folder
        )  # the resumed checkpoint is never pruned
        shape = {"world_size": ctx.world, "global_batch_size": self.recipe.global_batch_size}
        self.checkpointer = Checkpointer(
            manager,
            TensorFiles(self.parallelism, ctx, self.tensors),
            {"data": self.data.dataset, "rng": RngState()},
            merged=[self.counters],
            fixed={**shape, "seq_len": self.data.seq_len},
        )

    def restore(self) -> None:
        """A sharded step compiles (its parameters are slices then) and reads this rank's slices of the
        weights (``LayoutStrategy.materialize``); a resume then loads the checkpoint's tensors, whole or
        sharded and of any layout, and every part's state (``Checkpointer.load``)."""
        fresh = self.resume.folder is None
        self.parallelism.materialize(self.ctx, self.tensors, self.converter, fresh)
        if not fresh:
            self.checkpointer.load(self.resume.folder, self.resume.state)

    def open_outputs(self) -> None:
        """Run folder (logging rank), metrics, alerts, throughput, stop request, heartbeat, progress, start lines."""
        recipe, run_dir = self.recipe, self.run_dir
        if self.is_log_rank:
            run_dir.mkdir(parents=True, exist_ok=True)
            self.checkpointer.manager.remove_partial()
            metrics_mod.truncate_after(run_dir / "metrics.jsonl", self.resume.step)  # before the writer opens it
            atomic_write_text(run_dir / "recipe.yaml", recipe.to_yaml())
        self.log = RunLog(self.ctx, self.is_log_rank, self.options.progress, self.resume.step, self.stop_at)
        self.throughput = Throughput(recipe.global_batch_size * self.data.seq_len)
        self.last_ckpt: Optional[Path] = None
        self.saved_step: Optional[int] = None
        self.evaluator = None  # built (and its graph compiled) at the first validation
        self.stop = StopRequest().install()  # SIGTERM: save at the next step boundary, then stop
        self.heartbeat = Heartbeat(run_dir, self.ctx.rank)
        if self.is_log_rank:
            for line in self._start_lines():
                self.log.print(line)

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
        saves = sum(1 for s in range(self.resume.step + 1, self.stop_at + 1) if self._saves_at(s))
        size = ckpt_mod.checkpoint_bytes(self.tensors.model_tensors, self.tensors.opt_tensors)
        warnings = recipe_warnings(recipe) + run_log.disk_warnings(recipe, saves, size, self.checkpointer.manager)
        if hasattr(data.dataset, "repeat_warnings"):  # a weighted mixture: a source read too many times
            warnings += data.dataset.repeat_warnings(self.stop_at * recipe.global_batch_size)
        return lines + [f"warning: {w}" for w in warnings] + run_log.validation_lines(recipe, data)

    # ---- the loop's pieces

    def train_step(self, step: int) -> bool:
        """One optimizer step with its logging, validation and checkpoint; True when the run stops here."""
        if self.lease is not None:
            self.lease.check()  # another job took the run folder over: stop before this step writes anything
        t0 = time.time()
        self.heartbeat.beat(step, step - 1)  # launch's watchdog: who did not reach a step
        self.converter.before_step(self.tensors.model, self.recipe.train.seed, step, self.ctx.rank)
        out = self.run_step()
        self.counters.tokens_seen += self.throughput.tokens_per_step
        # the first step of the call compiled the graph: tokens/s is measured from its end
        self.throughput.stepped(out.loss, step == self.resume.step + 1, t0)
        self.log.stepped(out.loss)
        val = self._maybe_evaluate(step)  # a validation step is always logged
        if val or step % self.recipe.logging.log_interval == 0 or step == self.stop_at:
            self.log.log(self._record(step, out, val))
        self.maybe_save(step)
        # the watchdog's step time: every step of this call but the first (the compile)
        self.heartbeat.beat(step, step, time.time() - t0 if step > self.resume.step + 1 else None)
        if not out.stop:
            return False
        # some rank got SIGTERM: every rank saves this step and stops (jobs/preempt.py)
        if self.saved_step != step:
            self.save(step)
        self.preempted = self.stop.name
        return True

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
        stop = self.stop.flag > 0
        if self.stats_mean is not None:  # the stop request rides on the AllReduce of the logged values
            loss_v, aux_v, stats_v, stop = self.stats_mean(loss_v, aux_v, stats_v, self.stop.flag)
        elif self.ctx.world > 1:
            stop = any_rank(self.stop.flag)
        return StepOut(loss_v, aux_v, stats_v, grad_norm, lr, overflow, cur_scale, stop)

    def _maybe_evaluate(self, step: int) -> Optional[Dict[str, float]]:
        """val_loss / val_ppl every ``train.eval_interval`` steps and at the end (needs data.validation)."""
        validation = self.data.validation
        if validation is None:
            return None
        every = self.recipe.train.eval_interval
        if not ((every and step % every == 0) or step == self.stop_at):
            return None
        if self.evaluator is None:
            from ms_deepseek.train.evaluate import Evaluator

            parallel = self.parallelism.eval_parallel(self.recipe.parallel)
            self.evaluator = Evaluator(self.tensors.model, validation.batches, self.ctx.world, parallel=parallel)
        start = time.time()
        result = self.evaluator()
        for name, per_source in self.data.validation_by_source.items():  # the same compiled eval graph
            result[f"val_loss/{name}"] = self.evaluator.loss(per_source.batches)
        self.throughput.evaluated(time.time() - start)  # kept out of tokens/s
        return result

    def _record(self, step: int, out: StepOut, val: Optional[Dict[str, float]]) -> Dict:
        """One metrics record (every rank computes it; the logging rank writes it)."""
        fields = run_log.elapsed_fields(self.counters, self.throughput)
        extra = dict(val or {})
        if hasattr(self.data.dataset, "source_counts"):  # a weighted mixture: samples drawn per source so far
            extra["samples_by_source"] = self.data.dataset.source_counts
        return self.log.record(step, out, fields, extra)

    def _saves_at(self, step: int) -> bool:
        """Checkpoint every ``checkpoint.save_interval`` steps and at the last step (``save_final``)."""
        ck = self.recipe.checkpoint
        return bool((ck.save_interval and step % ck.save_interval == 0) or (step == self.stop_at and ck.save_final))

    def maybe_save(self, step: int) -> None:
        """Checkpoint this step when the recipe saves at it (:meth:`_saves_at`)."""
        if self._saves_at(step):
            self.save(step)

    def save(self, step: int) -> None:
        """One checkpoint of this step (every rank takes part; rank 0 completes it)."""
        self.saved_step = step
        if self.lease is not None:
            self.lease.check(read=True)
        saved = self.checkpointer.save(step)
        if saved is not None:
            self.last_ckpt = saved

    def _compile_only(self) -> TrainResult:
        """MindSpore's dry run: compile the step for this rank's batch shape and stop (nothing is written)."""
        from mindspore import Tensor

        zeros = Tensor(np.zeros(self.tensors.input_shape, np.int32))  # a sharded step compiled already (restore)
        self.tensors.step_cell.compile(zeros, zeros)
        return TrainResult(
            run_dir=self.run_dir,
            steps=self.resume.step,
            final_loss=float("nan"),
            wall_s=time.time() - self.started,
            dry_run=dry_run_level(),
        )

    def _complete_result(self) -> TrainResult:
        metrics = self.run_dir / "metrics.jsonl"
        return TrainResult(
            run_dir=self.run_dir,
            steps=self.resume.step,
            final_loss=float("nan"),
            checkpoint=self.resume.folder,
            metrics_path=metrics if metrics.is_file() else None,
            complete=True,
        )

    def _result(self) -> TrainResult:
        losses = self.throughput.losses
        return TrainResult(
            run_dir=self.run_dir,
            steps=self.saved_step if self.preempted else self.stop_at,
            final_loss=losses[-1] if losses else float("nan"),
            losses=losses,
            checkpoint=self.last_ckpt or self.checkpointer.manager.latest(),  # rank 0's path (shared folder)
            metrics_path=self.log.writer.path if self.is_log_rank else None,
            tokens_per_s=self.throughput.steady_tokens_per_s,
            wall_s=time.time() - self.started,
            preempted=self.preempted,
        )
