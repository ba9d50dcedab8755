"""``plan --recipe R --compile --memory``: MindSpore's own device-memory accounting beside the planner's.

Under ``MS_SIMULATION_LEVEL=1`` the compile check's worker compiles the training step and calls it once;
MindSpore runs it without kernels and accounts every allocation of its device memory pool (MindSpore's
"dry run" level 1; docs/planner.md, "Against MindSpore's memory accounting"). Two of its outputs are read here:

* the pool's peak, printed when the process ends (``plugin/ascend/res_manager/mem_manager/
  ascend_dynamic_mem_adapter.cc`` ``AscendDynamicMemAdapter::DevMemStatistics``): "Used peak memory usage
  (without fragments): NM" and "Actual peak memory usage (with fragments): NM";
* with ``MS_ALLOC_CONF=memory_tracker:True``, every block in ``rank_<id>/memory_block.csv`` of the working
  folder (``memory_block.csv`` for a process without a simulated world): its allocation and last-use
  times, size, kind (``Weight``, ``Kernel`` output, ``ConstantValue``, ...) and the node or parameter
  it belongs to. The blocks live at the time of the largest ``actual_used_memory`` sum to the peak.

The blocks live at the peak are grouped as the planner groups its estimate (:func:`block_category`):
weights, optimizer states (``adam_m.*`` / ``adam_v.*``), accumulated gradients (``accu_grads.*``),
activations (kernel outputs of the forward), backward (kernel outputs in the ``Gradients/`` scope:
activation gradients and the parameter gradients not yet accumulated), communication (outputs of
collective operators) and other (constants, inputs). MindSpore does not count kernel workspaces (no
``GetWorkspaceSize`` call at level 1), HCCL's buffers or the runtime's reserve: those stay the planner's
own margin, listed apart.
"""

from __future__ import annotations

import csv
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from ms_deepseek.core.errors import UserError

MIB = 2**20
GB = 1024**3  # the planner's "GB" (parallel.costs.GB): GiB, as MindSpore's "M" are MiB

_PEAK_LINES = {
    "used_peak_mb": re.compile(r"Used peak memory usage \(without fragments\): (\d+)M"),
    "actual_peak_mb": re.compile(r"Actual peak memory usage \(with fragments\): (\d+)M"),
}
_OPTIMIZER_STATE = re.compile(r"^(adam_m|adam_v|moments|moment1|moment2|exp_avg|exp_avg_sq)\.")
_COMM_OP = re.compile(
    r"(AllGather|AllReduce|AlltoAll|AlltoAllV|ReduceScatter|Send|Receive|Broadcast|"
    r"MicroStepAllGather|MirrorMicroStep)"
)
CATEGORIES = ("weights", "optimizer", "accumulated_gradients", "activations", "backward", "communication", "other")


def block_category(kind: str, node: str) -> str:
    """The planner-side group of one block of MindSpore's dump (``type`` and ``node_name`` columns)."""
    if kind == "Weight":
        if _OPTIMIZER_STATE.match(node):
            return "optimizer"
        if node.startswith("accu_grads."):
            return "accumulated_gradients"
        return "weights"
    if kind == "Kernel":
        op = node.rsplit("/", 1)[-1]
        if _COMM_OP.search(op):
            return "communication"
        return "backward" if node.startswith("Gradients/") else "activations"
    return "other"


def _op_name(node: str) -> str:
    """``Default/network-.../Mul-op12`` -> ``Mul``: the operator kind of a kernel block."""
    last = node.rsplit("/", 1)[-1]
    return re.sub(r"(-op\d+|_\d+|\d+)$", "", last)


def peak_lines(text: str) -> Dict[str, int]:
    """MindSpore's printed pool peaks (MiB) from a worker log; the last occurrence of each line counts."""
    out: Dict[str, int] = {}
    for key, pattern in _PEAK_LINES.items():
        found = pattern.findall(text)
        if found:
            out[key] = int(found[-1])
    return out


def blocks_at_peak(csv_path: Path, top: int = 12) -> Dict:
    """Group the blocks live at the tracker's peak (:func:`block_category`, MiB) and list the largest
    operator groups among them (``top``)."""
    with open(csv_path, newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        raise UserError(f"{csv_path}: MindSpore's memory tracker wrote no blocks")
    try:
        peak_row = max(rows, key=lambda r: int(r["actual_used_memory"]))
    except KeyError as e:
        raise UserError(f"{csv_path}: no column {e} (MindSpore's memory_block.csv layout changed?)") from None
    t = int(peak_row["start_time_stamp"])
    groups = {c: 0 for c in CATEGORIES}
    ops: Dict[Tuple[str, str], List[int]] = {}
    for r in rows:
        if not int(r["start_time_stamp"]) <= t < int(r["end_time_stamp"]):
            continue
        size = int(r["size"])
        cat = block_category(r["type"], r["node_name"])
        groups[cat] += size
        name = _op_name(r["node_name"]) if r["type"] == "Kernel" else r["node_name"].split(".", 1)[0]
        entry = ops.setdefault((cat, name), [0, 0])
        entry[0] += size
        entry[1] += 1
    largest = sorted(ops.items(), key=lambda kv: -kv[1][0])[:top]
    return {
        "tracker_peak_mb": round(int(peak_row["actual_used_memory"]) / MIB, 1),
        "at_peak_mb": {k: round(v / MIB, 1) for k, v in groups.items()},
        "largest_at_peak": [
            {"category": c, "name": n, "blocks": b, "mb": round(s / MIB, 1)} for (c, n), (s, b) in largest
        ],
        "blocks": len(rows),
        "csv": str(csv_path),
    }


def read_accounting(log: Path, folder: Path) -> Dict:
    """MindSpore's accounting of one level-1 worker: the printed peaks (``log``) and the per-block dump
    under ``folder`` (``rank_<id>/memory_block.csv``; ``memory_block.csv`` without a simulated world)."""
    text = Path(log).read_text(errors="replace") if Path(log).is_file() else ""
    out: Dict = dict(peak_lines(text))
    for candidate in (Path(folder) / "memory_block.csv", Path(folder).parent / "memory_block.csv"):
        if candidate.is_file():
            out.update(blocks_at_peak(candidate))
            break
    if "used_peak_mb" not in out:
        out["error"] = (
            f"{log}: no 'Used peak memory usage' line: MindSpore printed no pool peak "
            "(did the step run under MS_SIMULATION_LEVEL=1?)"
        )
    return out


# ------------------------------------------------------------------------------ the comparison
# (row, planner StageMemory fields, MindSpore categories): what both count, side by side
ROWS: Sequence[Tuple[str, Tuple[str, ...], Tuple[str, ...]]] = (
    ("weights", ("weights", "scales"), ("weights",)),
    ("optimizer states", ("optimizer",), ("optimizer",)),
    ("gradients", ("gradients",), ("accumulated_gradients",)),
    ("activations + backward", ("activations", "working_set", "dequant_workspace"), ("activations", "backward")),
    ("communication", ("comm_buffers", "weight_copies"), ("communication",)),
    ("other (constants, inputs)", (), ("other",)),
)
MARGIN_FIELDS = ("hccl_buffers", "workspace")  # the planner counts them, MindSpore's level 1 does not


@dataclass
class Comparison:
    rank: int
    stage: int
    layers: int
    rows: List[Tuple[str, float, float]] = field(default_factory=list)  # (row, planner GB, MindSpore GB)
    planner_total: float = 0.0  # GB, what both count
    ms_total: float = 0.0  # GB, MindSpore's peak (the tracker's; the printed one when no dump)
    ms_actual: float = 0.0  # GB, with fragments
    margin: float = 0.0  # GB, the planner's parts MindSpore does not count

    @property
    def ratio(self) -> float:
        return self.planner_total / self.ms_total if self.ms_total else float("inf")


def compare(stage_memory, accounting: Dict, rank: int, layers: int) -> Comparison:
    """Planner (one stage's :class:`~ms_deepseek.parallel_plan.costs.StageMemory`, bytes) beside MindSpore's
    accounting of the same reduced model (:func:`read_accounting`, MiB)."""
    at_peak = accounting.get("at_peak_mb", {})
    c = Comparison(rank, stage_memory.stage, layers)
    for row, planner_fields, ms_cats in ROWS:
        p = sum(getattr(stage_memory, f) for f in planner_fields) / GB
        m = sum(at_peak.get(k, 0.0) for k in ms_cats) * MIB / GB
        c.rows.append((row, p, m))
    c.planner_total = sum(p for _, p, _ in c.rows)
    peak_mb = accounting.get("tracker_peak_mb") or accounting.get("used_peak_mb", 0)
    c.ms_total = peak_mb * MIB / GB
    c.ms_actual = accounting.get("actual_peak_mb", 0) * MIB / GB
    c.margin = sum(getattr(stage_memory, f) for f in MARGIN_FIELDS) / GB
    return c


def extrapolate(points: Sequence[Tuple[int, float]], to_layers: int) -> Optional[Tuple[float, float]]:
    """(value at ``to_layers``, per-layer slope) of the least-squares line through (layers, value) points;
    None with fewer than two depths."""
    xs = sorted({x for x, _ in points})
    if len(xs) < 2:
        return None
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    return my + slope * (to_layers - mx), slope


def format_comparison(c: Comparison) -> List[str]:
    lines = [f"    {'GB (GiB)':28s} {'planner':>9s} {'MindSpore':>10s} {'diff':>8s}"]
    for row, p, m in c.rows:
        lines.append(f"    {row:28s} {p:9.3f} {m:10.3f} {p - m:+8.3f}")
    lines.append(
        f"    {'total (what both count)':28s} {c.planner_total:9.3f} {c.ms_total:10.3f} "
        f"{c.planner_total - c.ms_total:+8.3f}  planner/MindSpore {c.ratio:.2f}"
    )
    if c.ms_actual:
        lines.append(
            f"    MindSpore with fragments {c.ms_actual:.2f}G; planner's own margin (HCCL buffers, "
            f"workspace) {c.margin:.2f}G, not counted by MindSpore's level 1"
        )
    return lines
