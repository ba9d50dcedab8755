"""What the trainer's parts are given instead of the trainer: who runs, and the tensors they run on.

* :class:`RunContext`: the recipe, the run folder, this worker's rank and the world size (frozen);
* :class:`ModelSource`: where the model's weights come from when it is built;
* :class:`TrainTensors`: the built model, its plan, the compiled step and what a checkpoint holds of it;
* the Protocols the trainer's parts meet: :class:`Stateful` (a part that gives and takes its own state),
  :class:`LayoutStrategy` (:mod:`.parallelism`) and :class:`ModelConverter` (:mod:`.lora_run`).

The layout strategies and the model converters read these and nothing else of a run, so each can be built
and tested without a trainer (``ARCHITECTURE.md``, "The trainer's parts").
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Protocol, Tuple

from ms_deepseek.config.recipe import Recipe


@dataclass(frozen=True)
class RunContext:
    """One worker's run: the recipe, the run folder, this worker's rank among ``world`` workers."""

    recipe: Recipe
    run_dir: Path
    rank: int = 0
    world: int = 1

    @property
    def cfg(self):
        """The model config (``DeepseekV2Config``) the recipe resolves to."""
        return self.recipe.model_config

    @property
    def par(self):
        """The recipe's ``parallel`` section (``ParallelConfig``)."""
        return self.recipe.parallel


@dataclass(frozen=True)
class TrainOptions:
    """The ``train`` command's choices about one call (``ms-deepseek train --help``)."""

    resume: Optional[str] = None  # --resume: auto, latest or a checkpoint path (None: the recipe's)
    force: bool = False  # --force: run a layout the planner says does not fit; set newer checkpoints aside
    progress: bool = True  # progress bars (off with --quiet)
    max_steps: Optional[int] = None  # stop after this many total steps (the schedule still spans train.steps)
    allow_changes: bool = False  # --allow-changes: a resume may change settings that break exactness
    skip_damaged: bool = False  # --skip-damaged: a damaged checkpoint gives way to the newest intact one
    take_over: bool = False  # --take-over: the run folder's lease is taken from a holder known to be dead


@dataclass(frozen=True)
class ModelSource:
    """Where a built model's weights come from."""

    base: Optional[Path]  # the converter's weights folder (a LoRA run: its frozen base); None: random init
    load: bool  # the model reads ``base`` when built (a full fine-tune that resumes reads its checkpoint)
    write_base: bool = False  # a LoRA run's random base is saved to RUN_DIR/base (by the logging rank)
    shapes_only: bool = False  # the compile check: nothing allocated, nothing read


@dataclass
class TrainTensors:
    """The built model and its compiled step, and the tensors a checkpoint holds of them.

    ``opt_shards`` is the parallel optimizer's cut of each parameter, known only once a sharded step has
    compiled (``parallelism.Sharded.materialize``); None otherwise."""

    model: Any  # DeepseekV2ForCausalLM
    applied: Any  # parallel_apply.apply.AppliedPlan
    model_tensors: Dict[str, Any]  # what a checkpoint holds of the model (a LoRA run: adapters, routers)
    opt_tensors: Dict[str, Any]  # the optimizer's state, the loss scale and its counter
    step_cell: Any  # the compiled train step (one graph per optimizer step)
    strategy_file: Path  # where a sharded step writes its compiled strategy
    micro_batches: int  # k: micro-batches per optimizer step
    rows: int  # this rank's rows per micro-batch
    seq_len: int
    opt_shards: Any = None

    @property
    def input_shape(self) -> Tuple[int, int]:
        """The step's input: ``[k * rows, seq_len]``."""
        return (self.micro_batches * self.rows, self.seq_len)

    @property
    def part(self):
        """``restore_into``'s ``part`` hook: the parallel optimizer's cut (None without optimizer sharding)."""
        return self.opt_shards.part if self.opt_shards is not None else None


class Stateful(Protocol):
    """A part of a run that gives and takes its own state (what ``state.json`` records of it)."""

    def state_dict(self) -> Dict: ...

    def load_state_dict(self, state: Dict) -> None: ...


class LayoutStrategy(Protocol):
    """How a run is laid out over its workers (:mod:`.parallelism`): data parallel or sharded. Every member
    the trainer and its builders use is declared here."""

    sharded: bool
    static_shapes: bool  # every batch [rows, seq_len]: one compiled shape on every rank

    def check(self, recipe: Recipe, device: str) -> None: ...

    def workers_message(self, par) -> str: ...

    def log_rank(self, par) -> int: ...

    def data_coordinates(self, rank: int, world: int, par, micro_batch: int) -> Tuple[int, int, int]: ...

    def block_rows(self, par, micro_batch: int, micro_batches: int) -> int: ...

    def build_model(self, cfg, weights_folder: Optional[Path], show_progress: bool, config_changes: Dict): ...

    def grad_reducer(self, optimizer, world: int): ...

    def wrap_step(self, step_cell, par, strategy_file: Path): ...

    def stats_mean(self, world: int) -> Optional[Callable]: ...

    def eval_parallel(self, par): ...

    def materialize(self, ctx: RunContext, tensors: TrainTensors, converter: ModelConverter, fresh: bool): ...

    def replica_state(self, ctx: RunContext, tensors: TrainTensors) -> Dict: ...

    def save(self, ctx: RunContext, tensors: TrainTensors, manager, step: int, state: Dict) -> Optional[Path]: ...

    def load(self, ctx: RunContext, tensors: TrainTensors, folder: Path) -> None: ...


class ModelConverter(Protocol):
    """What a run makes of the built model (:mod:`.lora_run`): the full model, or LoRA / QLoRA."""

    def weights_folder(self, recipe: Recipe, run_dir: Path) -> Optional[Path]: ...

    def loads_weights(self, resume_dir: Optional[Path]) -> bool: ...

    def convert(self, model, ctx: RunContext, source: ModelSource) -> None: ...

    def checkpoint_tensors(self, model) -> Dict[str, Any]: ...

    def describe(self, recipe: Recipe) -> Optional[str]: ...

    def before_step(self, model, seed: int, step: int, rank: int) -> None: ...

    def load_slices(self, ctx: RunContext, tensors: TrainTensors, layout, fresh: bool) -> None: ...
