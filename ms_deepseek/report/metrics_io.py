"""Reading ``RUN_DIR/metrics.jsonl`` while a run may still be writing it.

Tolerates what a live or crashed run leaves: the strings "NaN" / "Infinity" /
"-Infinity" for non-finite numbers (anywhere, also inside expert_load lists),
missing optional keys, blank lines, a truncated last line, and unreadable lines
in the middle (skipped and counted, so the report can say so).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from ms_deepseek.core.errors import UserError

SPECIAL = {"NaN": float("nan"), "Infinity": float("inf"), "-Infinity": float("-inf")}


def decode_value(value: Any) -> Any:
    """Turn the non-finite strings back into floats, recursively."""
    if isinstance(value, str):
        return SPECIAL.get(value, value)
    if isinstance(value, list):
        if all(type(v) in (float, int) for v in value):  # the common case: plain numbers, no copy
            return value
        return [decode_value(v) for v in value]
    if isinstance(value, dict):
        return {k: decode_value(v) for k, v in value.items()}
    return value


def normalize_record(record: Dict[str, Any]) -> Dict[str, Any]:
    return {k: decode_value(v) for k, v in record.items()}


def number(record: Dict[str, Any], key: str) -> Optional[float]:
    """``record[key]`` as a float (NaN / inf kept), None when absent or not a number."""
    value = record.get(key)
    if isinstance(value, str):
        value = SPECIAL.get(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def finite(value: Optional[float]) -> bool:
    return value is not None and math.isfinite(value)


@dataclass
class MetricsFile:
    records: List[Dict[str, Any]] = field(default_factory=list)
    skipped_lines: List[int] = field(default_factory=list)  # 1-based numbers of unreadable lines
    truncated_tail: bool = False  # the last line was cut off (run still writing, or crashed mid-write)
    problems: List[str] = field(default_factory=list)  # "FILE:LINE: why" of every skipped line, for warnings


def read_metrics(path) -> MetricsFile:
    """Parse a metrics.jsonl; raises UserError only when the file itself is missing."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        raise UserError(f"{path}: no metrics file (is this a run folder? the trainer writes metrics.jsonl)") from None
    except OSError as exc:
        raise UserError(f"{path}: cannot read ({exc.strerror})") from None
    result = MetricsFile()
    lines = text.split("\n")
    last_index = max((i for i, ln in enumerate(lines) if ln.strip()), default=-1)
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if not isinstance(record, dict) or "step" not in record:
                raise ValueError("not a step record")
        except (ValueError, RecursionError) as exc:
            if i == last_index and not text.endswith("\n"):
                result.truncated_tail = True
            else:
                result.skipped_lines.append(i + 1)
                why = (
                    "nested too deeply"
                    if isinstance(exc, RecursionError)
                    else "not a step record"
                    if str(exc) == "not a step record"
                    else "not JSON"
                )
                result.problems.append(f"{path}:{i + 1}: {why}; line skipped")
            continue
        step = record["step"]
        # every consumer orders and plots by step: a record without a whole-number step is unusable
        if (
            isinstance(step, bool)
            or not isinstance(step, (int, float))
            or not math.isfinite(step)
            or step < 0
            or step != int(step)
        ):
            result.skipped_lines.append(i + 1)
            result.problems.append(f"{path}:{i + 1}: step {step!r} is not a whole number >= 0; line skipped")
            continue
        record["step"] = int(step)
        result.records.append(normalize_record(record))
    return result
