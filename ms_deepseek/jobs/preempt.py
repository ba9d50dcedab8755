"""Preemption: a scheduler's SIGTERM (with its grace period) becomes a checkpoint at the next step boundary.

The worker does not die on SIGTERM: :class:`StopRequest` only records it. After every step the
trainer asks whether any rank got one (one number in the per-step AllReduce of the logged values,
so every rank stops after the same step), saves a complete checkpoint there on every rank and exits
with 128 + 15 and one line saying so; ``--resume auto`` then continues exactly. ``launch`` forwards
its own SIGTERM / SIGHUP / SIGINT to the workers as SIGTERM (jobs/supervise.py).
"""

from __future__ import annotations

import signal
import threading
from typing import Optional

from ms_deepseek.core.atomic import atomic_write_text


class StopRequest:
    """Records SIGTERM instead of dying of it (installed only in the main thread)."""

    def __init__(self):
        self.signum: Optional[int] = None
        self._previous = None

    def install(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_signal)
        return self

    def _on_signal(self, signum, _frame) -> None:
        self.signum = signum

    def restore(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    @property
    def flag(self) -> float:
        """1.0 once a stop signal arrived (what this rank adds to the per-step AllReduce)."""
        return 1.0 if self.signum is not None else 0.0

    @property
    def name(self) -> str:
        return signal.Signals(self.signum or signal.SIGTERM).name


# ---------------------------------------------------------------------------------- progress heartbeat
# RUN_DIR/.heartbeat/rank_N: "<steps started> <steps finished> [<median step seconds>]", read by launch
HEARTBEAT_DIR = ".heartbeat"
# set by launch's supervisor (jobs/supervise.py) in the workers' environment: its pid
SUPERVISOR_ENV = "MS_DEEPSEEK_SUPERVISOR"
FAILED_SUFFIX, ACK_SUFFIX = ".failed", ".ack"  # rank_N.failed: a step of rank N raised; rank_N.ack: launch's answer


class Heartbeat:
    """This rank's progress for launch's watchdog (jobs/supervise.py), and its Python stacks on SIGUSR1.

    Each beat carries the median time of this rank's recent steps (the first step of a run, the compile,
    left out), so launch's watchdog knows the step time however rarely it looks. When a step raises (on a
    data-parallel job usually a collective that gave up waiting for a rank that stopped making progress),
    :meth:`failed` tells launch before the worker dies and waits for its answer: launch dumps the stacks
    of the ranks behind first, which msrun kills as soon as this worker has exited."""

    def __init__(self, run_dir, rank: int):
        import collections
        import faulthandler
        import os
        import sys
        from pathlib import Path

        self.path = Path(run_dir) / HEARTBEAT_DIR / f"rank_{rank}"
        self._os = os
        self.times = collections.deque(maxlen=64)  # seconds of this rank's recent steps
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            for suffix in (FAILED_SUFFIX, ACK_SUFFIX):  # a previous job's failure is not this one's
                self._sibling(suffix).unlink(missing_ok=True)
        except OSError:
            self.path = None
        if threading.current_thread() is threading.main_thread():
            try:
                out = sys.stderr if sys.stderr.fileno() >= 0 else sys.__stderr__
            except (AttributeError, ValueError, OSError):  # stderr replaced by an object without a file
                out = sys.__stderr__  # the process's own fd 2: the worker's log under msrun
            faulthandler.register(signal.SIGUSR1, file=out, all_threads=True)

    def _sibling(self, suffix: str):
        return self.path.with_name(self.path.name + suffix)

    def beat(self, started: int, finished: int, step_s: Optional[float] = None) -> None:
        if step_s is not None:
            self.times.append(step_s)
        if self.path is None:
            return
        text = f"{started} {finished}"
        if self.times:
            text += f" {sorted(self.times)[len(self.times) // 2]:.6f}"
        try:
            atomic_write_text(self.path, text + "\n", fsync=False)
        except OSError:
            pass

    def failed(self, step: int, wait_s: float = 60.0) -> None:
        """Step ``step`` raised: write rank_N.failed and, under launch, wait (at most ``wait_s``, and only while
        launch lives) for rank_N.ack, written once launch has dumped the stacks of the ranks behind."""
        import time

        supervisor = self._os.environ.get(SUPERVISOR_ENV, "")
        if self.path is None:
            return
        try:
            self._sibling(FAILED_SUFFIX).write_text(f"{step}\n")
        except OSError:
            return
        if not supervisor.isdigit():
            return
        deadline = time.time() + wait_s
        while time.time() < deadline and not self._sibling(ACK_SUFFIX).exists():
            try:
                self._os.kill(int(supervisor), 0)
            except OSError:  # launch is gone: nobody to wait for
                return
            time.sleep(0.05)
