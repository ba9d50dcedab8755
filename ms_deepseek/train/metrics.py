"""Training metrics: ``RUN_DIR/metrics.jsonl``, TensorBoard events, the console line.

One JSON object per logged step (keys in :data:`RECORD_KEYS`); non-finite numbers are
written as the strings ``"NaN"``, ``"Infinity"``, ``"-Infinity"`` so every line stays
valid JSON. The file is appended to and flushed after each record, so a crashed run
keeps every record it logged; on resume, records past the checkpoint's step are dropped
first (see :func:`truncate_after`). Reading the file back (live or crashed runs too) is
:func:`ms_deepseek.report.metrics_io.read_metrics`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np

from ms_deepseek.core.atomic import atomic_write_text

# tokens_per_s is measured from the end of the first step of a run (or resume), whose time (graph
# compile + one step) is the record's compile_s: a record of that step alone has no tokens_per_s.
RECORD_KEYS = (
    "step",
    "loss",
    "total_loss",
    "lr",
    "grad_norm",
    "tokens_per_s",
    "elapsed_s",
    "balance_expert",
    "balance_device",
    "balance_comm",
    "expert_load",
    "dropped_fraction",
)


def json_number(value: Any) -> Any:
    """Floats as JSON-safe values (non-finite -> string), recursively through lists and dicts."""
    if isinstance(value, dict):
        return {str(k): json_number(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_number(v) for v in value]
    if isinstance(value, (np.floating, float)):
        value = float(value)
        if math.isnan(value):
            return "NaN"
        if math.isinf(value):
            return "Infinity" if value > 0 else "-Infinity"
        return value
    if isinstance(value, np.integer):
        return int(value)
    return value


def truncate_after(path: Path, step: int) -> None:
    """Drop records with ``step > step`` (a resumed run re-logs them)."""
    if not path.is_file():
        return
    keep = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            if json.loads(line).get("step", 0) <= step:
                keep.append(line)
        except (ValueError, AttributeError):  # a line cut short by a crash
            continue
    atomic_write_text(path, "".join(line + "\n" for line in keep))


def moe_fields(stats: np.ndarray, moe_layers: List[int], num_experts: int) -> Dict[str, Any]:
    """``moe_stats`` [L_moe, E + 4] -> the record's balance / load / dropped fields."""
    if stats.size == 0:
        return {
            "balance_expert": 0.0,
            "balance_device": 0.0,
            "balance_comm": 0.0,
            "expert_load": {},
            "dropped_fraction": {},
        }
    E = num_experts
    return {
        "balance_expert": float(stats[:, E + 1].sum()),
        "balance_device": float(stats[:, E + 2].sum()),
        "balance_comm": float(stats[:, E + 3].sum()),
        "expert_load": {str(layer): [float(x) for x in stats[i, :E]] for i, layer in enumerate(moe_layers)},
        "dropped_fraction": {str(layer): float(stats[i, E]) for i, layer in enumerate(moe_layers)},
    }


class MetricsWriter:
    """Appends records to ``metrics.jsonl`` and mirrors the scalars to TensorBoard (rank 0 only)."""

    def __init__(self, run_dir: Path, tensorboard: bool = True, enabled: bool = True):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.enabled = enabled
        self._file = None
        self._tb = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", encoding="utf-8")
        if tensorboard:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(str(Path(run_dir) / "tb"))

    def write(self, record: Dict[str, Any]) -> None:
        if not self.enabled:
            return
        self._file.write(json.dumps(json_number(record), allow_nan=False) + "\n")
        self._file.flush()
        if self._tb is not None:
            step = int(record["step"])
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._tb.add_scalar(f"train/{key}", float(value), step)
            for name, count in record.get("samples_by_source", {}).items():
                self._tb.add_scalar(f"data/samples/{Path(name).name}", float(count), step)
            for layer, frac in record.get("dropped_fraction", {}).items():
                self._tb.add_scalar(f"moe/dropped_fraction/layer_{layer}", float(frac), step)
            for layer, load in record.get("expert_load", {}).items():
                if load:
                    self._tb.add_scalar(f"moe/max_expert_load/layer_{layer}", float(max(load)), step)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def console_line(record: Dict[str, Any], total_steps: int) -> str:
    """``step 40/300 | loss 5.812 | lr 2.9e-03 | gnorm 0.84 | 41.2k tok/s | drop 0.0% | 62s``."""
    dropped = record.get("dropped_fraction") or {}
    drop = max(dropped.values()) if dropped else 0.0
    tps = record.get("tokens_per_s")
    speed = [] if tps is None else [f"{tps / 1000:.1f}k tok/s" if tps >= 1000 else f"{tps:.0f} tok/s"]
    if record.get("compile_s") is not None:  # the first step of a run (or of a resume): compile + one step
        speed.append(f"compile {record['compile_s']:.1f}s")
    extra = ""
    if "val_loss" in record:
        extra += f" | val {record['val_loss']:.4f}"
    if "loss_scale" in record:
        extra += f" | scale {record['loss_scale']:.0f}"
    return (
        f"step {record['step']}/{total_steps} | loss {record['loss']:.4f} | lr {record['lr']:.2e} | "
        f"gnorm {record['grad_norm']:.3f} | {', '.join(speed)} | drop {100 * drop:.1f}% | "
        f"{record['elapsed_s']:.0f}s{extra}"
    )


def optional_memory(record: Dict[str, Any], memory: Optional[Dict[str, float]]) -> None:
    """Merge ``memory_allocated_gb`` / ``memory_reserved_gb`` / ``memory_fragmentation`` when known."""
    if not memory:
        return
    for key in ("memory_allocated_gb", "memory_reserved_gb", "memory_fragmentation"):
        if memory.get(key) is not None:
            record[key] = float(memory[key])
