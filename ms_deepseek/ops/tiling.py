"""Read the kernels' tiling decisions from the CPU libraries (the same C++ the Ascend host runs).

Each CPU library exports ``<Op>TilingQuery`` (the tiling struct) and
``<Op>ScheduleQuery`` (every tile the kernel visits, in order), computed by the
shared CANN-free headers in ``ops/<op>/common``. Used by the tests and handy for
checking how a shape will be cut on an NPU before running there.
"""

from __future__ import annotations

import ctypes
from typing import Dict, List

from ms_deepseek.ops import build

DEFAULT_CORE_NUM = 48
DEFAULT_UB_BYTES = 196352

STATUS = {0: "ok", 1: "bad shape", 2: "UB too small", 3: "bad config"}

_SPECS = {
    # op: (symbol prefix, input names, struct field names, schedule record fields)
    "fp32_softmax": (
        "Fp32Softmax",
        ("rows", "cols", "in_bytes", "num_inputs", "core_num", "ub_bytes"),
        (
            "rows",
            "cols",
            "in_bytes",
            "num_inputs",
            "align",
            "cols_aligned",
            "used_cores",
            "base_rows",
            "big_cores",
            "mode",
            "rows_per_tile",
            "col_tile",
            "col_tiles",
            "col_tail",
        ),
        ("core", "row_start", "rows", "col_start", "cols"),
    ),
    "expert_lookup": (
        "ExpertLookup",
        ("slots", "groups", "num_experts", "experts_per_rank", "capacity", "core_num", "ub_bytes"),
        (
            "slots",
            "groups",
            "group_slots",
            "num_experts",
            "experts_per_rank",
            "capacity",
            "used_cores",
            "chunk",
            "last_chunk",
            "tile",
            "hist_stride",
            "workspace_bytes",
        ),
        ("core", "start", "slots"),
    ),
    "repetition_penalty": (
        "RepetitionPenalty",
        ("batch", "vocab", "length", "core_num", "ub_bytes"),
        ("batch", "vocab", "length", "total", "used_cores", "chunk", "last_chunk", "tile", "id_tile"),
        ("core", "start", "len", "first_row", "last_row"),
    ),
}


class TilingError(ValueError):
    """The tiling function refused the problem (status code and meaning in the message)."""

    def __init__(self, status: int):
        super().__init__(f"tiling failed: status {status} ({STATUS.get(status, 'unknown')})")
        self.status = status


def _lib(op_name: str) -> ctypes.CDLL:
    return ctypes.CDLL(str(build.build(op_name)))


def _inputs(op_name: str, kwargs: Dict[str, int]):
    _, names, _, _ = _SPECS[op_name]
    values = {"core_num": DEFAULT_CORE_NUM, "ub_bytes": DEFAULT_UB_BYTES, **kwargs}
    if "groups" in names:
        values.setdefault("groups", 1)
    unknown = set(values) - set(names)
    if unknown:
        raise TypeError(f"{op_name}: unknown tiling inputs {sorted(unknown)}; expected {names}")
    return (ctypes.c_int64 * len(names))(*(int(values[n]) for n in names))


def tiling(op_name: str, **kwargs: int) -> Dict[str, int]:
    """The tiling struct for a problem, e.g. ``tiling("fp32_softmax", rows=4, cols=10, in_bytes=4, num_inputs=1)``."""
    prefix, _, fields, _ = _SPECS[op_name]
    out = (ctypes.c_int64 * len(fields))()
    fn = getattr(_lib(op_name), f"{prefix}TilingQuery")
    fn.restype = ctypes.c_int
    status = fn(_inputs(op_name, kwargs), out)
    if status != 0:
        raise TilingError(status)
    return dict(zip(fields, out))


def schedule(op_name: str, max_tiles: int = 1 << 16, **kwargs: int) -> List[Dict[str, int]]:
    """Every tile the kernel visits, in order, as dicts (fields depend on the operator)."""
    prefix, _, _, record = _SPECS[op_name]
    out = (ctypes.c_int64 * (len(record) * max_tiles))()
    fn = getattr(_lib(op_name), f"{prefix}ScheduleQuery")
    fn.restype = ctypes.c_int64
    n = fn(_inputs(op_name, kwargs), out, ctypes.c_int64(max_tiles))
    if n < 0:
        raise ValueError(f"{op_name}: schedule query failed (tiling error or more than {max_tiles} tiles)")
    width = len(record)
    return [dict(zip(record, out[i * width : (i + 1) * width])) for i in range(n)]
