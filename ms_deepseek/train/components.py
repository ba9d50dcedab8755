"""The trainer's stateful parts, each giving and taking its own state (``state_dict`` / ``load_state_dict``).

* :class:`RunCounters`: tokens seen and training time, carried across resumes;
* :class:`RngState`: numpy's and MindSpore's generators (a resume continues their streams);
* :class:`Throughput`: the metrics counters of the logged interval and of the steady state (steps
  after the first, compile, step of a call): tokens/s, data wait, compile time, the losses;
* :class:`Checkpointer`: one checkpoint of the run, saved and loaded: the model and optimizer tensors
  (through the layout, :mod:`ms_deepseek.train.parallelism`) and ``state.json``, assembled from the parts
  above and the data position (the dataset's own ``state_dict``).

The data position is the dataset's (``data.dataset``: ``state_dict()``, and ``state=`` when built).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from ms_deepseek.checkpoint.tensors import restore_rng, rng_state


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


class Checkpointer:
    """One checkpoint of every stateful part of a run, saved and loaded.

    ``state.json`` holds ``step``, each named part's ``state_dict`` under its name (the data position, the
    RNG), the ``merged`` parts' keys at its top level (the counters: ``tokens_seen``, ``elapsed_s``) and the
    run's fixed shape; the model and optimizer tensors go through ``files``, the layout strategy
    (:class:`ms_deepseek.train.parallelism.TensorFiles`), which writes whole tensors or this rank's slices.

    :meth:`load` gives every part its state back. A part without ``load_state_dict`` takes its state when it
    is built: the dataset (``build_train_dataset(state=)``), whose first batch is read before the model
    is built so that a bad shard at the resumed position stops the run before any compile."""

    def __init__(self, manager, files, parts: Dict[str, object], merged: Sequence[object] = (), fixed=None):
        self.manager, self.files, self.parts, self.merged = manager, files, dict(parts), list(merged)
        self.fixed = dict(fixed or {})

    def state(self, step: int) -> Dict:
        state: Dict = {"step": step}
        state.update({name: part.state_dict() for name, part in self.parts.items()})
        for part in self.merged:
            state.update(part.state_dict())
        state.update(self.fixed)
        return state

    def save(self, step: int) -> Optional[Path]:
        """Every rank takes part; the path of the checkpoint written (rank 0's), or None on other ranks."""
        return self.files.save(self.manager, step, self.state(step))

    def load(self, folder: Path, state: Dict) -> None:
        """Resume from ``folder`` (its ``state.json`` read as ``state``): the tensors first, then every part
        that takes its state back, in the order given (the RNG after the tensors: reading them draws none)."""
        self.files.load(folder)
        for name, part in self.parts.items():
            if hasattr(part, "load_state_dict"):
                part.load_state_dict(state.get(name, {}))
        for part in self.merged:
            part.load_state_dict(state)
