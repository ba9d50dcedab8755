"""Preemption: a scheduler's SIGTERM (with its grace period) becomes a checkpoint at the next step boundary.

The worker does not die on SIGTERM: :class:`StopRequest` only records it. After every step the
trainer asks whether any rank got one (one number in the per-step AllReduce of the logged values,
so every rank stops after the same step), saves a complete checkpoint there on every rank and exits
with 128 + 15 and one line saying so; ``--resume auto`` then continues exactly. ``launch`` forwards
its own SIGTERM / SIGHUP / SIGINT to the workers as SIGTERM (train/supervise.py).
"""

from __future__ import annotations

import signal
import threading
from typing import Optional


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
HEARTBEAT_DIR = ".heartbeat"  # RUN_DIR/.heartbeat/rank_N: "<steps started> <steps finished>", read by launch


class Heartbeat:
    """This rank's progress for launch's watchdog (train/supervise.py), and its Python stacks on SIGUSR1."""

    def __init__(self, run_dir, rank: int):
        import faulthandler
        import os
        import sys
        from pathlib import Path

        self.path = Path(run_dir) / HEARTBEAT_DIR / f"rank_{rank}"
        self._os = os
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError:
            self.path = None
        if threading.current_thread() is threading.main_thread():
            try:
                out = sys.stderr if sys.stderr.fileno() >= 0 else sys.__stderr__
            except (AttributeError, ValueError, OSError):  # stderr replaced by an object without a file
                out = sys.__stderr__  # the process's own fd 2: the worker's log under msrun
            faulthandler.register(signal.SIGUSR1, file=out, all_threads=True)

    def beat(self, started: int, finished: int) -> None:
        if self.path is None:
            return
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            tmp.write_text(f"{started} {finished}\n")
            self._os.replace(tmp, self.path)
        except OSError:
            pass
