"""The communication MindSpore compiled into a rank's graph, by collective and by parallel axis, beside the planner's.

``plan --recipe R --compile`` dumps each rank's IR after MindSpore's ``validate`` pass (the graph as it will run,
this rank's slice shapes). Every communication operator there is one line

    %19(..) = AllGather(%18) {..} primitive_attrs: {.., group_rank_ids: (0, 1, .., 7), rank_size: I64(8), ..}
          : (<Tensor[BFloat16], (384, 2048)>) -> (<Tensor[BFloat16], (3072, 2048)>)

and the bytes it moves are those of its **input**, which is a ``Tensor`` or, when the operator reads a parameter
or an accumulation buffer directly (the optimizer shard's gather of a weight, the reduce-scatter of an
``accu_grads`` buffer), a ``Ref[Tensor[..]]``. Bytes one rank sends on a ring (:func:`wire_factor`): AllGather
(n-1) x its input, ReduceScatter and AlltoAll (n-1)/n, AllReduce 2(n-1)/n, a Send all of it; the planner counts
the same way (``parallel_plan/planner.py`` ``_stage_traffic`` / ``dp_sync``).

Each operator's group is one of the layout's axes (:func:`axis_of`): the tensor-parallel group, the expert
all-to-all, the point-to-point of a pipeline, or the data-parallel side (the optimizer shard's gathers and
reduce-scatters, the gradients' all-reduce over replicas, the routing statistics); per axis, the compiled bytes are
compared with the planner's ``communication_gb_per_step`` for the same reduced model (:func:`compare`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

from ms_deepseek.config.parallel import ParallelConfig

MIB = 2**20
GIB = 2**30  # the planner's GB (parallel_plan/costs.py GB)

COMM_KINDS = (
    "AlltoAll",
    "AlltoAllV",
    "AllGather",
    "AllReduce",
    "ReduceScatter",
    "Send",
    "Receive",
    "Broadcast",
    "_MicroStepAllGather",
    "_MirrorOperator",
    "_MirrorMicroStepOperator",
)
ITEMSIZE = {"Float32": 4, "Float16": 2, "BFloat16": 2, "Int32": 4, "Int64": 8, "Int8": 1, "UInt8": 1, "Bool": 1}

# The planner's traffic (``communication_gb_per_step``) per axis, and the axis each names.
PLANNER_KEYS = {"tp": "tp_allreduce", "ep": "ep_alltoall", "dp": "dp_sync", "pp": "pp_p2p"}
AXES = ("dp", "tp", "ep", "pp")

_OPERATOR = re.compile(r"= (" + "|".join(sorted(COMM_KINDS, key=len, reverse=True)) + r")\(")
# the first input of the ": (inputs) -> (outputs)" line: a Tensor, or a Ref[Tensor] (a parameter or buffer)
_FIRST_INPUT = re.compile(r"^\s*: \(<(?:Ref\[)?Tensor\[(\w+)\]\]?, \(([\d, ]*)\)")


@dataclass(frozen=True)
class CommOp:
    """One communication operator of a compiled graph: its kind, its input and its group's global ranks."""

    kind: str
    dtype: str
    shape: Tuple[int, ...]
    group: Tuple[int, ...]
    scope: str = ""
    instance: str = ""  # MindSpore's instance name: which pass inserted it (SYNC_INSTANCES)

    @property
    def mib(self) -> float:
        return math.prod(self.shape) * ITEMSIZE.get(self.dtype, 4) / MIB

    @property
    def wire_mib(self) -> float:
        """MiB this rank sends for it."""
        if self.kind == "Send":
            return self.mib
        return self.mib * wire_factor(self.kind, len(self.group))


def wire_factor(kind: str, n: int) -> float:
    """Bytes one rank sends on a ring per input byte of a collective over ``n`` ranks: AllGather (n-1) (its slice
    to every other rank), ReduceScatter and AlltoAll (n-1)/n, AllReduce 2(n-1)/n; a Receive sends nothing."""
    if n <= 1 or kind == "Receive":
        return 0.0
    if "AllGather" in kind:
        return float(n - 1)
    if kind == "AllReduce" or "Mirror" in kind:
        return 2.0 * (n - 1) / n
    return (n - 1) / n


def _group(line: str) -> Tuple[int, ...]:
    """The global ranks of an operator's group (``group_rank_ids``, else ``rank_list``), or its peers' count."""
    for key in ("group_rank_ids", "rank_list"):
        m = re.search(key + r": \(([\d, ]*)\)", line)
        if m:
            return tuple(int(x) for x in m.group(1).split(",") if x.strip())
    m = re.search(r"rank_size: I64\((\d+)\)", line) or re.search(r"split_count: I64\((\d+)\)", line)
    return tuple(range(int(m.group(1)))) if m else ()


def read_ops(path: Path) -> List[CommOp]:
    """Every communication operator of one IR file (``*_validate_*.ir``), in program order."""
    lines = Path(path).read_text(errors="replace").splitlines()
    out = []
    for i, line in enumerate(lines):
        m = _OPERATOR.search(line)
        if not m:
            continue
        t = _FIRST_INPUT.search(lines[i + 1]) if i + 1 < len(lines) else None
        shape = tuple(int(d) for d in t.group(2).split(",") if d.strip()) if t else (0,)
        scope = re.search(r"# Fullname with scope: \((.*)\)\s*$", lines[i + 2]) if i + 2 < len(lines) else None
        instance = re.search(r"instance name: (\w+)", line)
        out.append(
            CommOp(
                m.group(1),
                t.group(1) if t else "Float32",
                shape,
                _group(line),
                scope.group(1) if scope else "",
                instance.group(1) if instance else "",
            )
        )
    return out


def by_kind(ops: Sequence[CommOp]) -> Dict[str, Dict[str, float]]:
    """kind -> {count, mb (MiB of inputs), wire_mb (MiB sent)}: what ``plan --compile --json`` reports per graph."""
    out: Dict[str, Dict[str, float]] = {}
    for op in ops:
        entry = out.setdefault(op.kind, {"count": 0, "mb": 0.0, "wire_mb": 0.0})
        entry["count"] += 1
        entry["mb"] += op.mib
        entry["wire_mb"] += op.wire_mib
    for entry in out.values():
        entry["mb"] = round(entry["mb"], 1)
        entry["wire_mb"] = round(entry["wire_mb"], 1)
    return out


def _tp_group(rank: int, par: ParallelConfig) -> Tuple[int, ...]:
    first = rank - rank % par.tp
    return tuple(range(first, first + par.tp))


# Instance names MindSpore gives the collectives that synchronise parameters and gradients over their replicas,
# whatever group that is (a weight replicated over the tensor-parallel ranks is optimizer-sharded over them):
# the optimizer shard's gather and its gradient's reduce-scatter (step_parallel.cc, "parallel_optimizer_allgather";
# "grad_" prefixes the backward's), the mirror operators' gradient all-reduce, the global norm's.
SYNC_INSTANCES = ("parallel_optimizer", "grad_parallel_optimizer", "grad_mirror", "mirror", "PARALLEL_GLOBALNORM")


def axis_of(op: CommOp, rank: int, par: ParallelConfig) -> str:
    """The layout axis an operator's traffic belongs to: ``pp`` (Send / Receive), ``ep`` (an AlltoAll), ``dp`` (a
    parameter or gradient synchronisation, :data:`SYNC_INSTANCES`), ``tp`` (another collective over ``rank``'s
    tensor-parallel group), else ``dp`` (over data-parallel replicas or an expert's: the routing statistics)."""
    if op.kind in ("Send", "Receive"):
        return "pp"
    if op.kind.startswith("AlltoAll"):
        return "ep"
    if op.instance.startswith(SYNC_INSTANCES):
        return "dp"
    if par.tp > 1 and tuple(sorted(op.group)) == _tp_group(rank, par):
        return "tp"
    return "dp"


def by_axis(ops: Sequence[CommOp], rank: int, par: ParallelConfig) -> Dict[str, Dict[str, Dict[str, float]]]:
    """axis -> kind -> {count, wire_mb}: the compiled traffic of one rank by the layout axis it serves."""
    out: Dict[str, Dict[str, Dict[str, float]]] = {}
    for op in ops:
        entry = out.setdefault(axis_of(op, rank, par), {}).setdefault(op.kind, {"count": 0, "wire_mb": 0.0})
        entry["count"] += 1
        entry["wire_mb"] += op.wire_mib
    for kinds in out.values():
        for entry in kinds.values():
            entry["wire_mb"] = round(entry["wire_mb"], 3)
    return out


def axis_totals(axes: Dict[str, Dict[str, Dict[str, float]]]) -> Dict[str, float]:
    """axis -> GiB sent per step (the planner's unit)."""
    return {a: sum(k["wire_mb"] for k in axes.get(a, {}).values()) * MIB / GIB for a in AXES}


# The planner prices each axis within this of what MindSpore compiled (planner / compiled - 1), on every shipped
# recipe (tests/compile/test_compile_recipes.py). An axis carrying less than FLOOR_SHARE of the rank's compiled
# traffic (the routing statistics of a one-device LoRA, say) is reported but not held to it: it cannot move the
# step time the planner derives by more than that share.
TOLERANCE = 0.10
FLOOR_SHARE = 0.02
AXIS_NAMES = {
    "dp": "data parallel (optimizer shard, gradients)",
    "tp": "tensor parallel",
    "ep": "expert all-to-all",
    "pp": "pipeline send",
}


def against_planner(axes: Dict[str, Dict[str, Dict[str, float]]], planner_gb: Dict[str, float]) -> List[Dict]:
    """Per axis: the compiled GiB this rank sends per step, the planner's for its stage, their ratio and whether
    they agree (:data:`TOLERANCE`, :data:`FLOOR_SHARE`)."""
    compiled = axis_totals(axes)
    floor = FLOOR_SHARE * sum(compiled.values())
    out = []
    for axis in AXES:
        got, priced = compiled[axis], float(planner_gb.get(PLANNER_KEYS[axis], 0.0))
        if max(got, priced) == 0.0:
            continue
        ratio = priced / got if got > 0 else None
        ok = max(got, priced) < floor or (ratio is not None and abs(ratio - 1.0) <= TOLERANCE)
        out.append(
            {
                "axis": axis,
                "compiled_gib": round(got, 4),
                "planner_gib": round(priced, 4),
                "ratio": round(ratio, 3) if ratio is not None else None,
                "ok": ok,
            }
        )
    return out


def format_axes(axes: Dict[str, Dict[str, Dict[str, float]]], rows: List[Dict], indent: str) -> List[str]:
    """Lines: per axis, the compiled collectives (count and GiB per kind) and the total beside the planner's."""
    lines = [f"{indent}traffic per step, GiB this rank sends (MindSpore | planner, planner / MindSpore):"]
    for row in rows:
        kinds = axes.get(row["axis"], {})
        parts = ", ".join(f"{k} {v['count']} {v['wire_mb'] * MIB / GIB:.2f}" for k, v in sorted(kinds.items()))
        ratio = f"{row['ratio']:.2f}" if row["ratio"] is not None else "-"
        flag = "" if row["ok"] else f"  <- differs by more than {TOLERANCE:.0%}"
        lines.append(
            f"{indent}  {AXIS_NAMES[row['axis']]}: {parts or 'none'} = {row['compiled_gib']:.2f} | "
            f"{row['planner_gib']:.2f} ({ratio}){flag}"
        )
    return lines
