"""The trainer's stateful parts, each giving and taking its own state (``state_dict`` / ``load_state_dict``).

* :class:`RunCounters`: tokens seen and training time, carried across resumes;
* :class:`RngState`: numpy's and MindSpore's generators (a resume continues their streams);
* :class:`Throughput`: the metrics counters of the logged interval and of the steady state (steps
  after the first, compile, step of a call): tokens/s, data wait, compile time, the losses;
* :class:`Checkpointer`: every stateful part of a run (the data position, the model and optimizer tensors,
  the RNG, the counters) and its save schedule: one call saves them all (:meth:`Checkpointer.save`), one
  puts them all at the resume point (:meth:`Checkpointer.restore`);
* :func:`run_state`: the one shape of ``state.json``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Dict, List, Optional

from ms_deepseek.checkpoint.tensors import restore_rng, rng_state
from ms_deepseek.train.build import TrainData
from ms_deepseek.train.context import LayoutStrategy, ModelConverter, RunContext, Stateful, TrainTensors


class RunCounters:
    """Tokens seen and seconds trained, this call's and every earlier call's of the run."""

    def __init__(self, started: float):
        self.started = started
        self.tokens_seen = 0
        self.elapsed_before = 0.0

    def elapsed(self, now: float) -> float:
        return self.elapsed_before + now - self.started

    def state_dict(self) -> Dict:
        return {"tokens_seen": self.tokens_seen, "elapsed_s": self.elapsed(time.time())}

    def load_state_dict(self, state: Dict) -> None:
        self.elapsed_before = float(state.get("elapsed_s", 0.0))
        self.tokens_seen = int(state.get("tokens_seen", 0))


class RngState:
    """numpy's and MindSpore's random generators."""

    def state_dict(self) -> Dict:
        return rng_state()

    def load_state_dict(self, state: Dict) -> None:
        restore_rng(state)


class Throughput:
    """The metrics counters: per logged interval (tokens, validation and batch-wait seconds, steps) and
    the steady state of this call (steps after the first, which compiled the graph)."""

    def __init__(self, tokens_per_step: int):
        self.tokens_per_step = tokens_per_step
        self.losses: List[float] = []
        self.interval_tokens, self.interval_start = 0, time.time()
        # per logged interval: seconds spent in validation (not training throughput) and waiting for batches
        self.interval_eval_s, self.interval_wait_s, self.interval_steps = 0.0, 0.0, 0
        self.steady_tokens, self.steady_time = 0, 0.0  # steps after the first (compile) step
        self.compile_s: Optional[float] = None  # the first step's time (graph compile + one step), logged once

    def waited(self, seconds: float) -> None:
        """A step waited ``seconds`` for its batches."""
        self.interval_wait_s += seconds
        self.interval_steps += 1

    def evaluated(self, seconds: float) -> None:
        self.interval_eval_s += seconds  # kept out of tokens/s

    def stepped(self, loss: float, first: bool, t0: float) -> None:
        """One step of the call done (``first``: it compiled the graph; tokens/s is measured from its end)."""
        self.losses.append(loss)
        if first:
            self.compile_s = time.time() - t0
            self.interval_start = time.time()
        else:
            self.interval_tokens += self.tokens_per_step
            self.steady_tokens += self.tokens_per_step
            self.steady_time += time.time() - t0

    def interval_fields(self, now: float) -> Dict:
        """tokens_per_s, data_wait_s and compile_s of the interval ending ``now`` (each when it has one);
        the interval starts anew."""
        record: Dict = {}
        if self.interval_tokens:  # none when the interval is the compile step alone; validation time excluded
            record["tokens_per_s"] = self.interval_tokens / max(now - self.interval_start - self.interval_eval_s, 1e-9)
        if self.interval_steps:  # mean seconds a step of the interval waited for its batch
            record["data_wait_s"] = self.interval_wait_s / self.interval_steps
        if self.compile_s is not None:
            record["compile_s"], self.compile_s = self.compile_s, None
        return record

    def reset_interval(self, now: float) -> None:
        self.interval_tokens, self.interval_start = 0, now
        self.interval_eval_s, self.interval_wait_s, self.interval_steps = 0.0, 0.0, 0

    @property
    def steady_tokens_per_s(self) -> float:
        return self.steady_tokens / self.steady_time if self.steady_time else 0.0


def run_state(step: int, data: Stateful, rng: Stateful, counters: Stateful, shape: Dict, replicas: Dict) -> Dict:
    """What ``state.json`` records of a run at ``step``, in the file's key order (part of its bytes): ``step``;
    the data position under ``data`` and the RNG under ``rng`` (each part's own ``state_dict``); the counters'
    fields (``tokens_seen``, ``elapsed_s``) and the run's shape (``world_size``, ``global_batch_size``,
    ``seq_len``) at the top level, where a resume's settings check reads the shape; a data-parallel job's
    ``replica_sha1`` (:meth:`~.context.LayoutStrategy.replica_state`). The writer adds ``files``, the digests
    of the files it wrote (``checkpoint.training``)."""
    return {
        "step": step,
        "data": data.state_dict(),
        "rng": rng.state_dict(),
        **counters.state_dict(),
        **shape,
        **replicas,
    }


class Checkpointer:
    """Every stateful part of one worker's run and its save schedule.

    The parts: the data position (:class:`~.build.TrainData`), the model and optimizer tensors (written and
    read by the layout strategy, :mod:`.parallelism`: whole tensors or this rank's slices), the RNG
    (:class:`RngState`) and the counters (:class:`RunCounters`). :meth:`save` writes them as one checkpoint
    (``state.json``: :func:`run_state`), :meth:`restore` puts every one at the resume point. The folders
    (atomic writes, digests, pruning that spares the resumed checkpoint) are
    :class:`ms_deepseek.checkpoint.training.CheckpointManager`'s."""

    def __init__(
        self,
        ctx: RunContext,
        strategy: LayoutStrategy,
        converter: ModelConverter,
        tensors: TrainTensors,
        data: TrainData,
        counters: RunCounters,
        manager,
        stop_at: int,
    ):
        self.ctx, self.strategy, self.converter, self.tensors = ctx, strategy, converter, tensors
        self.data, self.rng, self.counters = data, RngState(), counters
        self.manager, self.stop_at = manager, stop_at
        self.saved_step: Optional[int] = None  # the step of this call's last save
        self.last: Optional[Path] = None  # the folder of this call's last save (rank 0's path)

    def due(self, step: int) -> bool:
        """A checkpoint every ``checkpoint.save_interval`` steps and at the call's last step (``save_final``)."""
        ck = self.ctx.recipe.checkpoint
        return bool((ck.save_interval and step % ck.save_interval == 0) or (step == self.stop_at and ck.save_final))

    def state(self, step: int) -> Dict:
        """``state.json``'s content at ``step`` (every rank takes part: the replicas' digest is a collective)."""
        ctx = self.ctx
        shape = {
            "world_size": ctx.world,
            "global_batch_size": ctx.recipe.global_batch_size,
            "seq_len": self.data.seq_len,
        }
        replicas = self.strategy.replica_state(ctx, self.tensors)
        return run_state(step, self.data, self.rng, self.counters, shape, replicas)

    def save(self, step: int) -> Optional[Path]:
        """One checkpoint of every part at ``step``; every rank takes part, rank 0 completes it. The folder
        written (rank 0's path), or None on the ranks that write no folder of their own."""
        self.saved_step = step
        saved = self.strategy.save(self.ctx, self.tensors, self.manager, step, self.state(step))
        if saved is not None:
            self.last = saved
        return saved

    def restore(self, folder: Optional[Path], state: Dict) -> None:
        """Every part at the resume point ``folder`` (its ``state.json`` read as ``state``; None: the run's start),
        in this order: the data position, then the batches opened (the first one read: an unreadable shard stops
        the run before anything compiles); the tensors (``LayoutStrategy.materialize``: a sharded step compiles
        and reads its slices of the weights; then the checkpoint's tensors, whole or sharded, of any layout);
        the RNG after the tensors (reading them draws none) and the counters."""
        fresh = folder is None
        if not fresh and state.get("data") is not None:
            self.data.load_state_dict(state["data"])
        self.data.open()
        self.strategy.materialize(self.ctx, self.tensors, self.converter, fresh)
        if fresh:
            return
        self.strategy.load(self.ctx, self.tensors, folder)
        self.rng.load_state_dict(state.get("rng", {}))
        self.counters.load_state_dict(state)
