"""What a run tells its user: the metrics records, the console lines, the alerts and the progress bar.

:class:`RunLog` is built once the run folder is ready; every rank computes each record (the collectives
behind its values run on every rank), only the logging rank writes, prints and raises alerts (under a
pipeline the last stage, which alone computes the loss: ``LayoutStrategy.log_rank``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Dict, List, Optional

import numpy as np

from ms_deepseek.checkpoint import training as ckpt_mod
from ms_deepseek.core.runtime import detect_device
from ms_deepseek.train import metrics as metrics_mod
from ms_deepseek.train.context import RunContext


@dataclass
class StepOut:
    """What one optimizer step hands to logging: host floats, plus device scalars read only when logged."""

    loss: float
    aux: float
    stats: np.ndarray  # [L_moe, E + 4] per-MoE-layer routing statistics
    grad_norm: float
    lr: object  # Tensor
    overflow: object  # Tensor (bool)
    loss_scale: object  # Tensor
    stop: bool = False  # some rank got SIGTERM: save this step and stop (jobs/preempt.py)


def alert_monitor():
    """The alerts' monitor (``logging.alerts``) of the logging rank."""
    from ms_deepseek.report.alerts import AlertMonitor

    return AlertMonitor()


def memory_metrics_fn():
    """Device memory numbers for the record; None on CPU, where MindSpore keeps no device pool."""
    if detect_device() == "CPU":
        return None
    from ms_deepseek.parallel_plan.memory import memory_metrics

    return memory_metrics


def say(msg: str, bar=None) -> None:
    """A console line, above the progress bar when one is shown."""
    if bar is not None:
        bar.write(msg)
    else:
        print(msg, flush=True)


class RunLog:
    """The metrics writer (``metrics.jsonl``, TensorBoard), the alerts, the progress bar and the console."""

    def __init__(self, ctx: RunContext, log_rank: bool, show_bar: bool, first: int, last: int):
        from ms_deepseek.core.progress import progress_bar

        recipe = ctx.recipe
        self.cfg, self.total, self.log_rank = ctx.cfg, recipe.train.steps, log_rank
        self.writer = metrics_mod.MetricsWriter(ctx.run_dir, recipe.logging.tensorboard and log_rank, enabled=log_rank)
        self.monitor = alert_monitor() if (log_rank and recipe.logging.alerts) else None
        self.memory_fn = memory_metrics_fn()
        self.bar = progress_bar(
            total=last,
            initial=first,
            desc="train",
            unit="step",
            dynamic_ncols=True,
            leave=False,
            enabled=show_bar and log_rank and recipe.logging.progress_bar,
        )

    def print(self, msg: str) -> None:
        say(msg, self.bar if not self.bar.disable else None)

    def stepped(self, loss: float) -> None:
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{loss:.3f}", refresh=False)

    def record(self, step: int, out: StepOut, fields: Dict, extra: Dict) -> Dict:
        """The step's record: its losses, learning rate and gradient norm, ``fields`` (time, throughput),
        the MoE routing statistics, ``extra`` (validation, the mixture's samples), the loss scale, device
        memory."""
        cfg = self.cfg
        record = {
            "step": step,
            "loss": out.loss,
            "total_loss": out.loss + out.aux,
            "lr": float(out.lr.asnumpy()),
            "grad_norm": out.grad_norm,
        }
        record.update(fields)
        record.update(metrics_mod.moe_fields(out.stats, cfg.moe_layer_indices, cfg.n_routed_experts or 0))
        record.update(extra)
        if cfg.compute_dtype == "float16":  # a dynamic loss scale
            record["loss_scale"] = float(out.loss_scale.asnumpy())
            record["overflow"] = bool(out.overflow.asnumpy())
        metrics_mod.optional_memory(record, self.memory_fn() if self.memory_fn else None)
        return record

    def log(self, record: Dict) -> None:
        """The logging rank writes the record, prints its line and the alerts it opens."""
        if not self.log_rank:
            return
        self.writer.write(record)
        self.print(metrics_mod.console_line(record, self.total))
        for alert in self.monitor.observe(record) if self.monitor is not None else []:
            self.print(f"ALERT {alert}")

    def close(self) -> None:
        self.bar.close()
        self.writer.close()


def disk_warnings(recipe, saves: int, size: int, manager) -> List[str]:
    """The run's ``saves`` planned checkpoints of ``size`` bytes against the free space of its checkpoints
    folder (each save is also checked before it is written: ``checkpoint.training.disk_full_as_one_line``)."""
    if not saves:
        return []
    ck = recipe.checkpoint
    held = len(manager.complete())
    # at most keep_last checkpoints stay, plus the one being written before the oldest is pruned
    more = max(0, min(held + saves, ck.keep_last + 1) - held)
    free = ckpt_mod.free_bytes(manager.folder)
    if more * size <= free:
        return []
    g = ckpt_mod.gigabytes
    return [
        f"checkpoint: this run writes {saves} checkpoint(s) of {g(size)}, up to {more} more at once "
        f"(checkpoint.keep_last {ck.keep_last}): {g(more * size)}, but {manager.folder} has {g(free)} "
        "free; a save that does not fit stops the run"
    ]


def validation_lines(recipe, data) -> List[str]:
    """The start's validation line and the validation notes (``data``: :class:`~.build.TrainData`)."""
    if data.validation is None:
        return []
    every = recipe.train.eval_interval
    per_source = "".join(
        f"; val_loss/{name}: {v.used_samples} of its {v.total_samples} held-out samples"
        for name, v in data.validation_by_source.items()
    )
    line = (
        f"validation: {data.validation.description}, "
        + (f"every {every} steps and at the end" if every else "at the end")
        + per_source
    )
    return [line] + [f"warning: {note}" for note in data.validation_notes]


def elapsed_fields(counters, throughput, now: Optional[float] = None) -> Dict:
    """The record's time and throughput fields; the throughput's interval starts anew."""
    now = time.time() if now is None else now
    fields = {"elapsed_s": counters.elapsed(now)}
    fields.update(throughput.interval_fields(now))
    throughput.reset_interval(now)
    return fields
